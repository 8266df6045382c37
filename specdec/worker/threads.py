"""Which threads of a worker touch the model, and their names.

torch's CPU build runs its parallel regions on GNU OpenMP, and libgomp keeps one pool of
threads per *thread that starts a region*. Once a process holds more pool threads than it
has CPUs, every pool stops spinning between regions and parks on a futex instead: each of a
forward pass's ~300 regions then waits for its threads to be woken (measured: 12 → 61 µs a
region with a second pool alive; a code-target step at `--threads 2` in a worker 20 ms
against 7 ms in-process; docs/benchmarks.md, "One OpenMP pool a worker"). So a worker runs
every pass of its model on one thread — the batcher's model thread — and loads the model on
a thread that exits before serving starts (a pool lives as long as the thread that made it).

The threads are named (Linux: `prctl(PR_SET_NAME)`, what `top -H`, `ps -L` and py-spy show),
and the threads OpenMP starts from them inherit the name: `specdec-model` is the model
thread and its pool, `specdec-load` the loading thread, gone once the worker serves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

MODEL_THREAD = "specdec-model"
LOAD_THREAD = "specdec-load"
_PR_SET_NAME = 15

T = TypeVar("T")


def name_this_thread(name: str) -> None:
    """Give the calling OS thread `name` (15 bytes at most on Linux); a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def named_thread(name: str) -> ThreadPoolExecutor:
    """An executor of one thread that names itself `name` when it starts."""
    return ThreadPoolExecutor(1, name, name_this_thread, (name,))


def model_thread() -> ThreadPoolExecutor:
    """The one thread that runs a worker's forward passes, named `specdec-model`."""
    return named_thread(MODEL_THREAD)


def on_a_passing_thread(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on a thread named `specdec-load` that has exited (with any OpenMP pool it
    started) when this returns; its exception is raised here."""
    with named_thread(LOAD_THREAD) as pool:
        return pool.submit(fn, *args).result()
