"""The compiled sampling math of rows whose kept set runs past the top window, on a CPU.

A row whose top-p nucleus is larger than the window (a flat row: a weak model's, or any
model's where it hesitates) is finished by a histogram of its mass (`specdec.core.nucleus`)
and its next token is drawn from chunk masses (`specdec.core.next_token`): a few passes over
the row, which the tensor path dispatches as ~40 small torch ops each. On a CPU at one session
that dispatch, not the arithmetic, is most of a sampling round's math (~0.9 ms of a γ = 0
verify of a flat 8k row, on this project's test machine). `csrc/sampling_rows.cpp` does each
row's passes in one call: the same histogram and cut for τ and log Z, and the draw as the
dense reference draws it (inverse CDF in vocabulary order over float64 p, or the residual
max(p − q̃, 0)), exactly, without the chunk approximation. Each row is computed alone, so a
row's result does not depend on the rows beside it: the small-batch path and the batched path
agree on a CPU with it as without it.

`--sampling-kernel` (both workers) chooses: auto (the compiled kernel where it builds, once
per machine like the attention and linear kernels, `specdec.engine.compiled`; else torch's
ops) | compiled (that, or fail) | torch. Without a worker's choice (a library caller, the
benchmarks) the first use resolves auto. CUDA rows and the fixed shapes of the sampling graphs
(`specdec.core.fixed`) always take torch's ops.
"""

from __future__ import annotations

import threading

import torch

from specdec.engine.compiled import Extension

KERNELS = ("auto", "compiled", "torch")
EXTENSION = Extension(
    "specdec_sampling", "sampling_rows.cpp", "the compiled sampling kernel", "torch's ops"
)

_lock = threading.Lock()
_chosen: list = []  # [module or None] once chosen (None: torch's ops)


def select(choice: str) -> bool:
    """Choose the kernel for this process (a worker, from --sampling-kernel): True where the
    compiled kernel is in use. `compiled` raises ValueError naming the flag where it cannot
    be built."""
    if choice not in KERNELS:
        raise ValueError(f"--sampling-kernel: expected one of {list(KERNELS)}, got {choice!r}")
    module = (
        None if choice == "torch" else EXTENSION.module("--sampling-kernel", choice == "compiled")
    )
    with _lock:
        _chosen[:] = [module]
    return module is not None


def for_device(device: torch.device):
    """The compiled module for rows on `device`, or None (torch's ops): CPU rows only; the
    first call without a choice resolves auto."""
    if device.type != "cpu":
        return None
    if not _chosen:
        with _lock:
            if not _chosen:
                found = EXTENSION.get()
                _chosen.append(None if isinstance(found, str) else found)
    return _chosen[0]
