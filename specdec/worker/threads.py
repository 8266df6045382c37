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

`--cpu-bind` pins the model thread and its pool, one CPU each. Unpinned, Linux may leave two
threads of one pool sharing a CPU while another CPU idles — for a whole forward pass and more
(seen on the 2-CPU benchmark machine: a pass of the code target 20 ms instead of 10, its two
threads taking turns on one CPU while the other idled, since neither stays off its CPU long
enough to be moved) — and every parallel region then waits for the thread not running.
`auto` pins only where the worker's CPUs are its own: the process may run on exactly
`--threads` CPUs (a Kubernetes pod under the static CPU manager, a container given a cpuset,
`taskset`, or `specdec up`, whose target worker takes every core). On a CPU set shared with
other workers, pinning each to the same first CPUs would stack them; there, name the CPUs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
import threading
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


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8` → [0, 1, 2, 3, 8] (the list syntax of taskset and cpusets); ValueError if not."""
    cpus: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise ValueError(f"--cpu-bind: {text!r} is not auto, off or a CPU list like 0-3,8")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise ValueError(f"--cpu-bind: {part.strip()!r} is an empty range")
        cpus += range(first, last + 1)
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"--cpu-bind: {text!r} names a CPU twice")
    return cpus


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on (None where the OS does not say: no pinning)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return set(getaffinity(0)) if getaffinity else None


def bind_plan(setting: str, threads: int, device: str, allowed: set[int] | None) -> list[int]:
    """The CPUs `--cpu-bind` pins the model's threads to, one each; [] = not pinned.

    `off`: none. `auto`: on a CPU device at `--threads` ≥ 2, the allowed CPUs where they are
    exactly `--threads` (see the module's docstring). A list: exactly `--threads` CPUs, each
    one the process may run on (ValueError naming the flag otherwise).
    """
    if setting == "off" or allowed is None:
        return []
    if setting == "auto":
        if not str(device).startswith("cpu") or threads < 2 or len(allowed) != threads:
            return []
        return sorted(allowed)
    cpus = parse_cpu_list(setting)
    if len(cpus) != threads:
        raise ValueError(f"--cpu-bind: {setting!r} names {len(cpus)} CPUs for --threads {threads}")
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise ValueError(
            f"--cpu-bind: CPU {outside[0]} is not one this process may run on "
            f"({format_cpus(sorted(allowed))})"
        )
    return cpus


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] → `0-2,5`."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def pin_pool(cpus: list[int]) -> dict[int, int]:
    """On the model thread: pin it to cpus[0] and its OpenMP pool's threads to the others, one
    each. Returns {OS thread id: CPU}. The pool exists once a parallel region ran on this
    thread; one runs first, big enough to use every thread."""
    import torch

    torch.ones(1 << 20).mul_(2.0)
    me = threading.get_native_id()
    pool = sorted(t for t in _threads_named(MODEL_THREAD) if t != me)
    plan = {me: cpus[0]}
    rest = cpus[1:] or cpus
    for i, tid in enumerate(pool):
        plan[tid] = rest[i % len(rest)]
    for tid, cpu in plan.items():
        os.sched_setaffinity(tid, {cpu})
    return plan


def _threads_named(name: str) -> list[int]:
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    tids.append(int(tid))
        except FileNotFoundError:  # exited meanwhile
            continue
    return tids
