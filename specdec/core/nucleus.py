"""Top-p cuts past the window: a large nucleus found from a histogram, never a sort.

A row whose top-p nucleus holds more tokens than the window (`specdec.core.processed`) is
finished here: a histogram of its mass over bins of z locates the bin where the cumulative
mass reaches top_p, and only that bin's tokens are ordered. Rows go together, in blocks of
`WIDE_BLOCK` values, with the same ops per row as one row alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.core import row_kernel
from specdec.core.logsum import WIDE_BLOCK, masked_lse

if TYPE_CHECKING:
    from specdec.core.processed import ProcessorParams

BINS_PER_NAT = 16  # histogram resolution of `nucleus_cuts`
BINS = 1024  # 64 nats below the row's maximum; everything further down is one bin


def nucleus_cuts(
    z: torch.Tensor, z_max: torch.Tensor, top_p: torch.Tensor, log_norm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(τ, log Z) of top-p for rows z [U, vocab] whose nucleus is large, without sorting a row.

    A histogram of each row's mass over bins of z locates the bin where the cumulative mass
    reaches top_p; every token above that bin is kept, every token below it dropped, and
    only the tokens of that one bin are ordered (`bin_values`) to find the exact cut. All
    rows at once: the same ops per row as one row alone. Masses are float64 exps of z
    relative to log_norm [U] (the row's log-mass: the cut compares the masses with top_p);
    the kept mass is the bins above the cut's plus the cut bin's kept tokens, so log Z =
    log_norm + log(kept mass) — Σ_{z ≥ τ} exp(z) exactly, whatever rounding log_norm
    carries. z_max [U]: each row's largest z; top_p [U] float64."""
    rows = z.shape[0]
    depth = torch.sub(z_max[:, None], z).mul_(BINS_PER_NAT).long().clamp_(0, BINS - 1)
    p = z.double().sub_(log_norm[:, None]).exp_()
    mass = torch.zeros(rows, BINS, dtype=torch.float64, device=z.device)
    cum = mass.scatter_add_(1, depth, p).cumsum(dim=1)
    b = (cum < top_p[:, None]).sum(dim=1).clamp(max=BINS - 1)  # the bin where the nucleus ends
    above = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    inside, count = bin_values(z, depth == b[:, None])
    p_in = torch.exp(inside.double() - log_norm[:, None])  # 0 past the bin's tokens
    before = above[:, None] + p_in.cumsum(dim=1) - p_in  # mass strictly above each token
    ranks = torch.arange(inside.shape[1], device=z.device)
    n = ((before < top_p[:, None]) & (ranks[None, :] < count[:, None])).sum(dim=1)
    tau = inside.gather(1, (n.clamp(min=1) - 1)[:, None]).squeeze(1)
    kept = above + torch.where(inside >= tau[:, None], p_in, 0.0).sum(dim=1)  # ties kept too
    return tau, log_norm + torch.log(kept)


def bin_values(z: torch.Tensor, in_bin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of z [U, vocab] where `in_bin`, each row's descending and padded with −inf
    to the largest row's count [U, C], and the counts [U]: the bin's tokens gathered and
    sorted (by value, then stably by row), never a sort or top-k over a whole row."""
    where = in_bin.nonzero()  # [M, 2], row-major
    values = z[where[:, 0], where[:, 1]]
    rows = where[:, 0]
    order = values.sort(descending=True, stable=True).indices
    order = order[rows[order].sort(stable=True).indices]  # by row, descending within
    count = torch.bincount(rows, minlength=z.shape[0])
    start = count.cumsum(dim=0) - count
    rank = torch.arange(len(rows), device=z.device) - start[rows[order]]
    out = torch.full((z.shape[0], int(count.max())), float("-inf"), device=z.device)
    out[rows[order], rank] = values[order]
    return out, count


def wide_rows(
    logits: torch.Tensor, pp: ProcessorParams, log_all: torch.Tensor, z_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(τ, log Z) of rows [U, vocab] (top-k off) whose top-p nucleus is past the window,
    finished together in blocks of `WIDE_BLOCK` values; log_all: each row's log-mass, z_max
    its largest z (both from the window, `specdec.core.processed`). A min-p cut above top-p's
    sums its kept set over the row. On a CPU the compiled kernel cuts the rows where it is in
    use (`specdec.core.row_kernel`), one call for all of them, row by row."""
    device = logits.device
    kernel = row_kernel.for_device(device)
    if kernel is not None:
        tau, log_z = kernel.nucleus(logits, pp.temperature, z_max, pp.top_p, log_all)
        return _min_p(logits, pp, z_max, tau, log_z)
    step = max(1, WIDE_BLOCK // logits.shape[1])
    taus, log_zs = [], []
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        temperature, top_p = (x[rows].to(device) for x in (pp.temperature, pp.top_p))
        z = logits[rows].float() / temperature[:, None]
        tau, log_z = nucleus_cuts(z, z_max[rows], top_p, log_all[rows])
        tau, log_z = _min_p(logits[rows], pp[rows], z_max[rows], tau, log_z)
        taus.append(tau)
        log_zs.append(log_z)
    return torch.cat(taus), torch.cat(log_zs)


def _min_p(logits, pp: ProcessorParams, z_max, tau, log_z):
    """(τ, log Z) with min-p's cut where it lies above top-p's: its kept set summed over the
    row (`masked_lse`). Nothing to do where no row uses min-p."""
    if pp.min_p_used is False:
        return tau, log_z
    min_p = pp.min_p.to(logits.device)
    tau_m = (z_max.double() + torch.log(min_p.clamp(min=1e-300))).float()
    raised = (min_p > 0) & (tau_m > tau)
    if bool(raised.any()):
        r = raised.nonzero().squeeze(1)
        z = logits[r].float() / pp.temperature.to(logits.device)[r, None]
        tau[r] = tau_m[r]
        log_z[r] = masked_lse(z, tau[r], z_max[r])
    return tau, log_z
