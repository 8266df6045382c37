"""A few rows on a CPU: the processed distribution's decisions on Python floats.

At low concurrency a round has a handful of sampling rows, and on a CPU each of them costs
far more in per-op dispatch (~5–10 µs a torch op, ~100 ops a pass) than in arithmetic. So
for up to `FEW_ROWS` rows `specdec.core.processed` takes `cuts_few` instead of its tensor
`cuts`: the thresholds are decided on Python floats, while every exp, log and sum stays
torch's op on the same values — the same τ and log Z bit for bit
(tests/unit/test_small_batch_math.py). Where the compiled sampling kernel is in use, rows of
more than `WIDE` values take its `window` on both paths instead (`specdec.core.row_kernel`)."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec.core.logsum import full_lse

if TYPE_CHECKING:
    from specdec.core.processed import ProcessorParams

FEW_ROWS = 8  # up to this many rows on a CPU, the decisions run on Python floats (`few_rows`)


def few_rows(count: int, device: torch.device) -> bool:
    """Whether `count` rows on `device` take the small-batch path (on a CPU, up to
    `FEW_ROWS`; see the module docstring)."""
    return device.type == "cpu" and 0 < count <= FEW_ROWS


def row_index(rows: list[int]) -> slice | torch.Tensor:
    """Row numbers as an index: a slice (a view, no copy) when they are consecutive."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows)


def cuts_few(logits: torch.Tensor, pp: ProcessorParams, z: torch.Tensor, with_log_z: bool = True):
    """`cuts` for a few rows on a CPU, decided on Python floats. The window's float32 values
    compare exactly as doubles; every exp, log and sum is still torch's op on the values
    `cuts` gives it (Python's and numpy's exp and log differ from torch's by an ulp now and
    then, their sums add in another order), whole-row sums go to `full_lse` with the same
    rows, and only the cumulative sum is Python's, adding in torch's (sequential) order. So
    each result is `cuts`' bit for bit."""
    rows, vocab = logits.shape
    width = z.shape[1]
    narrow = width < vocab
    window = z.tolist()  # [R][W], descending
    top_k, top_p, min_p = pp.top_k.tolist(), pp.top_p.tolist(), pp.min_p.tolist()
    zd = z.double()
    shifted = torch.exp(zd - zd[:, :1])  # [R, W] exp(z − z_max), as `lse` computes it

    def pick(x: torch.Tensor, group: list[int]) -> torch.Tensor:
        """The rows `group` of x (x itself when they are all its rows: no op)."""
        return x if len(group) == rows else x[row_index(group)]

    def lse(tau: list[float], rows_past: list[bool], scaled: bool = False) -> list[float]:
        """log Σ_{z ≥ τ} exp(z) per row: from the window, or from the whole row where
        `rows_past` (those rows in one `full_lse`, as `cuts` makes it)."""
        out = [0.0] * rows
        inside = [r for r in range(rows) if not rows_past[r]]
        past = [r for r in range(rows) if rows_past[r]]
        if inside:
            cut = torch.tensor([[tau[r]] for r in inside], dtype=torch.float32)
            kept = torch.where(pick(z, inside) >= cut, pick(shifted, inside), 0.0)
            for r, log_sum in zip(inside, torch.log(kept.sum(dim=-1)).tolist()):
                out[r] = log_sum + window[r][0]
        if past:
            cut = None
            if any(tau[r] > -math.inf for r in past):
                cut = torch.tensor([tau[r] for r in past], dtype=torch.float32)
            z_max = pick(z, past)[:, 0]
            sums = full_lse(pick(logits, past), pick(pp.temperature, past), cut, z_max, scaled)
            for r, log_sum in zip(past, sums.tolist()):
                out[r] = log_sum
        return out

    tau_k = [window[r][k - 1] if 0 < k < vocab else -math.inf for r, k in enumerate(top_k)]
    p_on = [p < 1.0 for p in top_p]
    tau_p, fits, log_k = [-math.inf] * rows, [True] * rows, [math.nan] * rows
    if any(p_on):
        # top-p renormalises over the top-k set: its log-mass, from the window when it fits
        k_past = [on and window[r][-1] >= tau_k[r] and narrow for r, on in enumerate(p_on)]
        log_k = lse(tau_k, k_past, scaled=True)
        mass = torch.exp(zd - torch.tensor(log_k, dtype=torch.float64)[:, None]).tolist()
        for r, on in enumerate(p_on):
            if on:  # mass strictly above each rank: the cumulative sum less the rank's own
                before = (c - m for c, m in zip(itertools.accumulate(mass[r]), mass[r]))
                keep = sum(b < top_p[r] and v >= tau_k[r] for b, v in zip(before, window[r]))
                tau_p[r] = window[r][max(keep, 1) - 1]
                fits[r] = not (max(keep, 1) == width and narrow)
    tau = [max(tau_k[r], tau_p[r]) for r in range(rows)]
    if any(m > 0.0 for m in min_p):
        log_min = torch.log(pp.min_p.clamp(min=1e-300)).tolist()
        for r, m in enumerate(min_p):
            if m > 0.0:  # z_max + log min_p, rounded to float32 as `.float()` rounds it
                tau[r] = max(tau[r], float(np.float32(window[r][0] + log_min[r])))
    log_z = (
        lse(tau, [window[r][-1] >= tau[r] and fits[r] and narrow for r in range(rows)])
        if with_log_z
        else [math.nan] * rows
    )
    return (
        torch.tensor(tau, dtype=torch.float32),
        torch.tensor(log_z, dtype=torch.float64),
        fits,
        torch.tensor(log_k, dtype=torch.float64),
    )
