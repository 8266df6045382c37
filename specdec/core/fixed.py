"""The sampling hot path in fixed shapes, with nothing read back to the host: what one CUDA
graph can capture and replay (`specdec.core.graphs`).

The eager hot path (`specdec.core.processed`, `specdec.core.verify`) is built to touch as
little as it can: it processes a session's rows position by position only while the session
keeps accepting, finishes only the rows whose top-p nucleus runs past the window, and looks at
a row's whole vocabulary only where it must. Every one of those choices reads a value back
(`nonzero`, `any`, `tolist`): on a CPU that is free, on a GPU each is a stall, and the
~1,500 small operators of a sampling verify (~450 a draft step) cost a few µs each to launch
— a floor of ~5 ms a verify on an H200 (docs/benchmarks.md, "On an H200") whatever the
vocabulary.

Here the same decisions are made for every row at once, in shapes that depend only on the
batch's shape: every position of every session is processed, every row's whole-row sums are
computed and the right one selected with `torch.where`; the rows whose nucleus is past the
window are finished in the same pass (`_nucleus`). On a GPU the extra arithmetic is
microseconds; what is saved is the launches and the stalls.

The results are the eager path's: the same accepted counts and tokens, draft candidates and
q̃ weights, τ and top window bit for bit (tied values' tokens possibly listed in another order
where this window is wider), log Z within rounding (~1e-16 where `_nucleus` adds the same
masses in another order; ~1e-7 for a top-k row whose ties run past the window, which the eager
path sums over its sorted row in float32 chunks) — tests/unit/test_fixed_math.py compares both
on the small-batch stress set. A row where the fixed shapes cannot be exact is flagged (`redo`), and
the caller verifies that session again on the eager path: a nucleus whose cut lies past the
`NUCLEUS_SLOTS` largest values of its histogram bin, or a chunk draw that rounding sent to an
empty chunk. The window is at least `WINDOW` and covers the largest top-k of the batch (known
on the host: `ProcessorParams.top_k_max`), so no row's top-k set is cut by it.
"""

from __future__ import annotations

import torch

from specdec.core.logsum import masked_lse
from specdec.core.next_token import chunk_draw, window_draw
from specdec.core.processed import WINDOW, Processed, ProcessorParams, cuts
from specdec.core.proposal import WIRE_WEIGHT_MAX
from specdec.core.rng import Stream, uniform
from specdec.core.sampling import sample_inverse_cdf
from specdec.core.verify import DraftBlock, acceptance_probability

BINS_PER_NAT = 256  # histogram resolution of `_nucleus` (finer than the eager path's: a bin
BINS = 16384  # holds fewer tokens), 64 nats below the row's maximum; further down, one bin
NUCLEUS_SLOTS = 256  # the largest values of the cut's bin that `_nucleus` orders


def width_for(pp: ProcessorParams, vocab: int, window: int = WINDOW) -> int:
    """The window of a batch: `window`, widened to hold the largest top-k set (as
    `_thresholds` widens it), at most the vocabulary."""
    return min(vocab, max(window, pp.largest_top_k() + 1))


def process(
    logits: torch.Tensor, pp: ProcessorParams, width: int, window_only: bool = False
) -> tuple[Processed, torch.Tensor]:
    """`specdec.core.processed.process` of rows [R, vocab] in fixed shapes: (Processed,
    redo [R] bool — rows the fixed shapes could not finish exactly). `width` from
    `width_for`; with `window_only` (the draft) no row is finished past the window and log Z
    is NaN, as there. The window's cuts are `specdec.core.processed.cuts`' own, in its
    `fixed` form."""
    logits = logits if logits.dtype == torch.float32 else logits.float()
    values, ids = torch.topk(logits, width, dim=-1)
    temperature = pp.temperature.to(logits.device)
    z = values.float() / temperature[:, None]
    tau, log_z, fits, log_k, tau_k = cuts(logits, pp, z, not window_only, fixed=True)
    redo = torch.zeros_like(fits)
    if not window_only and width < logits.shape[1] and pp.top_p_used is not False:
        tau_n, log_z_n, redo_n = _nucleus(logits, pp, z[:, 0], log_k, tau_k)
        tau = torch.where(fits, tau, tau_n)
        log_z = torch.where(fits, log_z, log_z_n)
        redo = ~fits & redo_n
    return Processed(logits, temperature, tau, log_z, z, ids), redo


def _nucleus(logits, pp: ProcessorParams, z_max, log_norm, tau_k):
    """(τ, log Z, redo) of top-p for every row, as the eager path finishes a nucleus past the
    window (`specdec.core.nucleus.nucleus_cuts`), in fixed shapes: the histogram of each
    row's mass (tokens below top-k's τ_k left out; log_norm: the top-k set's log-mass) locates
    the bin where the nucleus ends; the `NUCLEUS_SLOTS` largest values of that bin are
    ordered (a top-k of the row with everything else masked) and the cut found among them.
    redo where the cut may lie past them. A min-p cut above top-p's replaces it, with its
    kept set summed over the row (as `specdec.core.nucleus.wide_rows`)."""
    rows, vocab = logits.shape
    temperature = pp.temperature.to(logits.device)
    z = logits / temperature[:, None]
    if pp.top_k_max is None or pp.top_k_max > 0:  # the top-k set (ties kept)
        z = torch.where(z >= tau_k[:, None], z, float("-inf"))
    depth = torch.sub(z_max[:, None], z).mul_(BINS_PER_NAT).nan_to_num_(posinf=BINS - 1)
    depth = depth.long().clamp_(0, BINS - 1)
    p = z.double().sub_(log_norm[:, None]).exp_()
    mass = torch.zeros(rows, BINS, dtype=torch.float64, device=z.device)
    cum = mass.scatter_add_(1, depth, p).cumsum(dim=1)
    b = (cum < pp.top_p[:, None]).sum(dim=1).clamp(max=BINS - 1)
    above = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    in_bin = depth == b[:, None]
    count = in_bin.sum(dim=1)
    slots = min(NUCLEUS_SLOTS, vocab)
    inside = torch.topk(torch.where(in_bin, z, float("-inf")), slots, dim=1).values
    p_in = torch.exp(inside.double() - log_norm[:, None])  # 0 past the bin's tokens
    before = above[:, None] + p_in.cumsum(dim=1) - p_in  # mass strictly above each token
    ranks = torch.arange(slots, device=z.device)
    n = ((before < pp.top_p[:, None]) & (ranks[None, :] < count[:, None])).sum(dim=1)
    tau = inside.gather(1, (n.clamp(min=1) - 1)[:, None]).squeeze(1)
    kept = above + torch.where(inside >= tau[:, None], p_in, 0.0).sum(dim=1)  # ties kept too
    log_z = log_norm + torch.log(kept)
    # the cut (or a run of ties at it) may continue past the ordered values
    redo = (count > slots) & ((n >= slots) | (inside[:, -1] >= tau))
    if pp.min_p_used is False:
        return tau, log_z, redo
    tau_m = (z_max.double() + torch.log(pp.min_p.clamp(min=1e-300))).float()
    raised = (pp.min_p > 0) & (tau_m > tau)
    log_z = torch.where(raised, masked_lse(z, tau_m, z_max), log_z)
    return torch.where(raised, tau_m, tau), log_z, redo & ~raised


def verify_sampling(
    rows: torch.Tensor,
    pp: ProcessorParams,
    block: DraftBlock,
    seeds: torch.Tensor,
    base_positions: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Processed]:
    """The sampling sessions' part of `specdec.core.verify.verify_logits` in fixed shapes:
    (accepted counts [S], next tokens [S], redo [S] bool, the processed rows) from their
    logits rows [S·(γ+1), vocab] (session-major), their processors (one row a session) and
    draft block. Every position is processed; the accept test u_i < min(1, p(y_i)/q̃(y_i))
    with the same uniforms; the recovered/bonus token drawn from the row after the accepted
    ones. redo: sessions to verify again on the eager path."""
    sessions, gamma = block.candidates.shape
    slots, device = gamma + 1, rows.device
    processed, redo_rows = process(rows, pp.repeat_rows(slots), width)
    steps = torch.arange(gamma, device=device)
    u = uniform(seeds[:, None], base_positions[:, None] + steps[None, :], Stream.ACCEPT)
    offered = steps[None, :] < block.num_candidates[:, None]
    y = torch.where(offered, block.candidates, 0)
    row0 = torch.arange(sessions, device=device) * slots  # first row of each session
    p_y = processed.prob((row0[:, None] + steps[None, :]).reshape(-1), y.reshape(-1))
    accept = offered & (
        u < acceptance_probability(p_y.reshape(sessions, gamma), block.q_of_candidates())
    )
    n = accept.long().cumprod(dim=1).sum(dim=1)
    rejected = n < block.num_candidates
    at = n.clamp(max=max(gamma - 1, 0))
    every = torch.arange(sessions, device=device)
    q_ids = block.q_ids[every, at] if gamma else None
    q_weights = block.q_weights[every, at] if gamma else None
    u_next = uniform(seeds, base_positions + n, Stream.RESIDUAL)
    tokens, empty = sample_next(processed, row0 + n, q_ids, q_weights, rejected, u_next)
    upto = torch.arange(slots, device=device)[None, :] <= n[:, None]
    redo = (redo_rows.reshape(sessions, slots) & upto).any(dim=1) | empty
    return n, tokens, redo, processed


def sample_next(processed: Processed, rows, q_ids, q_weights, rejected, u):
    """`specdec.core.next_token.sample_next` in fixed shapes: both draws for every row, the
    window's where the kept set is inside it; (tokens [S], empty [S] bool — a chunk draw that
    rounding sent to a chunk with no mass, which the eager path redraws densely)."""
    inside = processed.inside(rows)
    window = window_draw(processed, rows, q_ids, q_weights, rejected, u, fixed=True)
    chunks, empty = chunk_draw(processed, rows, q_ids, q_weights, rejected, u, fixed=True)
    return torch.where(inside, window, chunks), ~inside & empty


def propose_sampling(
    logits: torch.Tensor,
    pp: ProcessorParams,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    k: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampling rows' part of `specdec.core.proposal.propose_step` in fixed shapes:
    (candidates [S], q̃ ids [S, k], integer wire weights [S, k]) of rows [S, vocab], `width`
    ≥ k (`width_for(pp, vocab, max(WINDOW, k))`)."""
    processed, _ = process(logits, pp, width, window_only=True)
    z = processed.top_z[:, :k]
    scaled = torch.exp(z.double() - z[:, :1].double()) * WIRE_WEIGHT_MAX
    weights = torch.where(z >= processed.tau[:, None], torch.round(scaled), 0.0).to(torch.int64)
    ids = processed.top_ids[:, :k]
    u = uniform(seeds, positions, Stream.DRAFT)
    choice = sample_inverse_cdf(weights, u)
    return ids.gather(1, choice[:, None]).squeeze(1), ids, weights
