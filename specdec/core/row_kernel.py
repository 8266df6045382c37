"""The compiled sampling math of a CPU's sampling rows, one call for all of them, row by row.

At one session on a CPU a round's sampling math is a few hundred small torch ops — each
costing more in dispatch than in arithmetic — and most of them go to flat rows (a weak
model's, or any model's where it hesitates), whose top-p nucleus is larger than the top
window: their cut from a histogram of the row's mass (`specdec.core.nucleus`), their
whole-row log-sums (`specdec.core.logsum`) and their next token's draw from chunk masses
(`specdec.core.next_token`) take a few passes over the row each.
`specdec/core/csrc/sampling_rows.cpp` does each row's passes in one call:
- `nucleus`: the same histogram and cut for τ and log Z (τ bit for bit the torch path's);
- `lse`: whole-row log-sums, float32 exps added in float64 (vectorised);
- `draw`: the recovered or bonus token as the dense reference draws it (inverse CDF in
  vocabulary order over float64 p, or the residual max(p − q̃, 0)), unless u · Σp falls
  within float64 rounding (~1e-16) of a 512-value block's boundary (the torch path: float32
  rounding of a chunk's mass, ~1e-7);
- `draft`: a draft step's q̃ and candidate (`specdec.core.proposal.propose_step`): the
  window, the processors' cut, the integer weights and the draw, as the torch path computes
  them (tokens of equal logit in the window ordered by id: torch's topk orders ties as it likes);
- `argmax`: greedy's first maximum of a row (`specdec.core.reduce.first_argmax`): one
  vectorised pass over blocks' maxima, then the first block holding the maximum;
- `top`: the processors' window of a row (`specdec.core.processed.top_window`, torch.topk's
  values; tokens of equal logit by id): the blocks' maxima bound the window from below, so
  only the values above that bound are sorted (~2.7× torch's topk at a 64-value window);
- `window`: a sampling row's window and its processors' cuts (`specdec.core.processed.
  _thresholds`: τ, whether the nucleus fits the window, log Z, top-p's log-mass) in one call, for
  every CPU row of more than `WIDE` values, few or many (the small-batch path's `cuts_few`
  and the batched `cuts` are torch's ops): the same window, τ and fits as `top` then `cuts`,
  log Z to ~1e-14 (the window's float64 sums: the same terms, std::exp, in rank order); the
  whole-row sums are `lse`'s; the draft's step (`draft`) takes its window and cut the same
  way (`window_row`). One session's sampling verify pass at 8k values, every
  candidate accepted: 0.94 → 0.39 ms (`python -m bench.math --quick`, one thread).
Exps are ATen's own, one call a row; none is asked for exp(−inf) or a subnormal result, which
take its slow path (~7× and ~180× a value's cost here).
Each row is computed alone, so a row's result does not depend on the rows beside it: the
small-batch path and the batched path agree on a CPU with it as without it. Lossless either
way: the target verifies against the q̃ the draft sent, and p is cut and drawn from exactly.

`--sampling-kernel` (both workers) chooses: auto (the compiled kernel where it builds, once
per machine like the attention and linear kernels, `specdec.core.compiled`; else torch's
ops) | compiled (that, or fail) | torch. Without a worker's choice (a library caller, the
benchmarks) the first use resolves auto. CUDA rows and the fixed shapes of the sampling graphs
(`specdec.core.fixed`) always take torch's ops.
"""

from __future__ import annotations

import os
import threading

import torch

from specdec.core.compiled import Extension

KERNELS = ("auto", "compiled", "torch")
EXTENSION = Extension(
    "specdec_sampling",
    "sampling_rows.cpp",
    "the compiled sampling kernel",
    "torch's ops",
    directory=os.path.join(os.path.dirname(__file__), "csrc"),
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
