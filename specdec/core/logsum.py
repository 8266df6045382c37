"""Log-masses of rows of logits, exact to float64 where sampling needs it.

log Σ exp(z) over a row's kept set is the normaliser of every processed distribution
(`specdec.core.processed`). Over a window (≤ `WIDE` values) it is computed all in float64;
over a whole row, exps in float32 (bandwidth) added in chunks of `CHUNK` values whose float32
sums are added in float64 (`sum64`): p then sums to 1 within ~1e-7, at a twentieth of a
float64 pass's cost on a CPU. Whole-row passes take blocks of rows of `WIDE_BLOCK` values,
whose temporaries stay in cache; a row's sum is the same whatever rows share its block.
"""

from __future__ import annotations

import torch

from specdec.core import row_kernel
from specdec.core.reduce import chunked

WIDE = 2048  # up to this many values (a window), log Z is computed all in float64
# values of the rows whole-row passes take together on a CPU (`full_lse`,
# `specdec.core.nucleus.wide_rows`): a float64 pass over them (2 MB) stays cached
WIDE_BLOCK = 1 << 18
CHUNK = 512  # float32 partial sums of this many values, added in float64 (`sum64`)


def chunk_sums(x: torch.Tensor) -> torch.Tensor:
    """float32 sums of consecutive chunks of `CHUNK` values of each row of x [R, N] (views,
    no copy), the last chunk possibly shorter: [R, ⌈N / CHUNK⌉]."""
    return chunked(x, torch.sum, CHUNK)


def sum64(x: torch.Tensor) -> torch.Tensor:
    """Row sums of float32 x [R, N] as float64, within ~1e-8 relative of an exact sum: the
    `chunk_sums` added in float64. A float64 accumulation (`sum(dtype=float64)`) converts
    every value and costs ~20× as much on a CPU; a whole-row float32 sum is off by ~1e-7."""
    return chunk_sums(x).double().sum(dim=-1)


def lse(z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
    """log Σ exp(z) per row [R, N] (−inf entries count 0), float64. A window: all in
    float64; a whole row: exp in float32 (bandwidth), summed by `sum64` — p then sums to 1
    within ~1e-7."""
    if z.shape[-1] <= WIDE:
        shifted = torch.exp(z.double() - z_max.double()[:, None])
        return torch.log(shifted.sum(dim=-1)) + z_max.double()
    return torch.log(sum64(torch.exp(z - z_max[:, None]))) + z_max.double()


def masked_lse(z: torch.Tensor, tau: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
    """log Σ_{z ≥ τ} exp(z) per row of z [R, N] (float64); z_max: each row's largest z."""
    kept = torch.where(z >= tau[:, None], z, torch.full_like(z, float("-inf")))
    return lse(kept, z_max)


def full_lse(logits, temperature, tau, z_max, scaled: bool = False) -> torch.Tensor:
    """log Σ_{z ≥ τ} exp(z) over whole rows (one pass; τ None, or −inf on every row: every
    token kept). On a CPU the rows go in blocks of `WIDE_BLOCK` values, whose temporaries
    stay in cache; each row's sum is the same whatever the blocks.

    `scaled` (for top-p's whole-row normaliser, which only places the cut): a row without a
    threshold has z scaled by 1/T instead of divided by T and exponentiated in place — a third
    of the passes on a CPU, at the price of a sum off by up to ~5e-7 relative (1/T rounds), a
    shift of the cumulative masses the cut compares with top_p of that size. Chosen row by
    row, so a row's sum does not depend on the rows beside it. A log Z that p itself is
    computed from is always summed over z divided by T, as `prob` computes z.

    On a CPU the compiled kernel sums each row where it is in use (`specdec.core.row_kernel`):
    the same choices, exps in float32 added in float64 (vectorised, in no fixed order)."""
    kernel = row_kernel.for_device(logits.device)
    if kernel is not None and logits.shape[-1] > WIDE:
        count = logits.shape[0]
        cut = torch.full((count,), float("-inf")) if tau is None else tau
        free = torch.isinf(cut) if scaled else torch.zeros(count, dtype=torch.bool)
        return kernel.lse(logits.float(), temperature, cut, z_max, free)
    every = tau is None or bool(torch.isinf(tau).all())
    if scaled and not every:  # rows without a threshold take the scaled sum, row by row
        free = torch.isinf(tau).nonzero().squeeze(1)  # (whatever rows share their batch)
        out = full_lse(logits, temperature, tau, z_max)
        if len(free):
            out[free] = full_lse(logits[free], temperature[free], None, z_max[free], True)
        return out
    count, vocab = logits.shape
    step = max(1, WIDE_BLOCK // vocab) if logits.device.type == "cpu" else max(count, 1)
    out = []
    for start in range(0, count, step):
        rows = slice(start, start + step)
        block = logits[rows], temperature[rows], z_max[rows]
        out.append(row_lse(*block, None if every else tau[rows], scaled and every))
    if not out:
        return torch.zeros(0, dtype=torch.float64, device=logits.device)
    return out[0] if len(out) == 1 else torch.cat(out)


def row_lse(logits, temperature, z_max, tau, scaled: bool) -> torch.Tensor:
    """`full_lse` of a block of rows; τ None: every token kept."""
    if scaled and logits.shape[-1] > WIDE:
        z = logits.float() * temperature.reciprocal()[:, None]  # = 1.0 / T, bit for bit
        z.sub_(z_max[:, None]).exp_()
        return torch.log(sum64(z)) + z_max.double()
    z = logits.float() / temperature[:, None]
    return lse(z, z_max) if tau is None else masked_lse(z, tau, z_max)
