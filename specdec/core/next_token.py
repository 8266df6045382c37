"""The token after the accepted candidates: the recovered token at the first rejection, drawn
from the normalised residual max(p − q̃, 0), or the bonus token, drawn from p, when every
candidate was accepted (docs/architecture.md, "Verification").

`draw_next` draws it from dense float64 rows (the reference `verify_block` uses);
`sample_next` is the hot path's draw from processed rows (`specdec.core.processed`) and the
draft's sparse q̃ — the same inverse-CDF draw in vocabulary order, without a dense row: from
the top window where the kept set lies inside it (`window_draw`), otherwise from float32
chunk masses and one exact chunk (`_sample_chunks`). A few rows on a CPU draw on Python
numbers (`sample_next_few`).
"""

from __future__ import annotations

import torch

from specdec.core import row_kernel
from specdec.core.few_rows import few_rows, row_index
from specdec.core.logsum import CHUNK, chunk_sums
from specdec.core.processed import Processed
from specdec.core.proposal import dense_q, sparse_q
from specdec.core.sampling import inverse_cdf_index, sample_inverse_cdf


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Normalised max(p − q, 0) [..., vocab]; p itself where the residual has no mass.

    The fallback is only reached through rounding (rejection has probability 0 when p = q).
    """
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-300), p)


def draw_next(p_next, q_next, rejected, u) -> torch.Tensor:
    """`next_token` with the uniforms given."""
    dist = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)
    return sample_inverse_cdf(dist, u)


def sample_next(
    processed: Processed,
    rows: torch.Tensor,
    q_ids: torch.Tensor | None,
    q_weights: torch.Tensor | None,
    rejected: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """The recovered token (from the residual max(p − q̃, 0), where `rejected`) or the bonus
    token (from p) of processed rows [S], by inverse CDF in vocabulary order with uniforms u —
    `next_token`'s draw without a dense float64 row. q̃ has K entries, so the residual is p
    except at those K tokens, where it is p − min(p, q̃). The mass of every chunk of `CHUNK`
    tokens comes from float32 exps (summed per chunk, scaled to p in float64); the chunk
    where u · mass falls is then sampled exactly in float64. The draw equals the dense one
    unless u · mass lies within float32 rounding (~1e-7 of a chunk's mass) of a chunk
    boundary. A row whose kept set lies inside its top window (a peaked row: the usual case)
    is sampled from the window alone, exactly (`window_draw`). q_ids, q_weights: [S, K]
    q̃ of each row's position (None: no candidates)."""
    if few_rows(len(rows), rows.device):
        args = (x if x is None else x.tolist() for x in (rows, q_ids, q_weights, rejected, u))
        return torch.tensor(sample_next_few(processed, *args))
    tokens = torch.empty(len(rows), dtype=torch.int64, device=rows.device)
    inside = processed.inside(rows)  # nothing kept past the row's window
    for mask, sample in ((inside, window_draw), (~inside, _sample_chunks)):
        r = mask.nonzero().squeeze(1)
        if len(r):
            qi = None if q_ids is None else q_ids[r]
            qw = None if q_weights is None else q_weights[r]
            tokens[r] = sample(processed, rows[r], qi, qw, rejected[r], u[r])
    return tokens


def sample_next_few(processed, rows, q_ids, q_weights, rejected, u) -> list[int]:
    """`sample_next` for a few rows on a CPU, every argument a list (q_ids, q_weights: [S][K]
    or None). A row whose kept set is inside the window is drawn as `window_draw` draws
    it, on Python numbers (torch's exp, the same sequential sums and comparisons); the
    others by `_sample_chunks`."""
    tokens = [0] * len(rows)
    edge, tau = processed.window_edge().tolist(), processed.tau.tolist()
    inside = [j for j, r in enumerate(rows) if edge[r] < tau[r] or edge[r] == float("-inf")]
    if inside:
        i = row_index([rows[j] for j in inside])
        top_z, log_z = processed.top_z[i], processed.log_z[i]
        p = torch.exp(top_z.double() - log_z[:, None]).tolist()
        for j, z, p_row, ids in zip(inside, top_z.tolist(), p, processed.top_ids[i].tolist()):
            kept = [(t, pv) for t, pv, zv in zip(ids, p_row, z) if zv >= tau[rows[j]]]
            q = sparse_q(q_ids[j], q_weights[j]) if q_ids is not None and rejected[j] else None
            tokens[j] = _draw_window(kept, q, u[j])
    out = [j for j in range(len(rows)) if j not in inside]
    kernel = row_kernel.for_device(processed.logits.device) if out else None
    if kernel is not None:  # the compiled draw takes the lists as they are
        qi = [] if q_ids is None else [q_ids[j] for j in out]
        qw = [] if q_weights is None else [q_weights[j] for j in out]
        drawn = kernel_draw(
            kernel,
            processed,
            [rows[j] for j in out],
            qi,
            qw,
            [rejected[j] for j in out],
            [u[j] for j in out],
        )
        for j, token in zip(out, drawn):
            tokens[j] = token
    elif out:
        qi = None if q_ids is None else torch.tensor([q_ids[j] for j in out])
        qw = (
            None
            if q_weights is None
            else torch.tensor([q_weights[j] for j in out], dtype=torch.float64)
        )
        drawn = _sample_chunks(
            processed,
            torch.tensor([rows[j] for j in out]),
            qi,
            qw,
            torch.tensor([rejected[j] for j in out]),
            torch.tensor([u[j] for j in out], dtype=torch.float64),
        )
        for j, token in zip(out, drawn.tolist()):
            tokens[j] = token
    return tokens


def kernel_draw(kernel, processed, rows, q_ids, q_weights, rejected, u) -> list[int]:
    """The compiled kernel's draws (`specdec.core.row_kernel`) of processed rows, every
    argument a list (q_ids, q_weights: [S][K], or [] without q̃): the dense draw, up to float64
    rounding where u · Σp meets a block's boundary."""
    p = processed
    logits = p.logits if p.logits.dtype == torch.float32 else p.logits.float()
    return kernel.draw(logits, rows, p.temperature, p.tau, p.log_z, q_ids, q_weights, rejected, u)


def _draw_window(kept: list[tuple[int, float]], q: dict[int, float] | None, u: float) -> int:
    """One `window_draw` draw on Python numbers from the kept (token, p) pairs of a window
    (its other tokens add zeros to the CDF, so leaving them out changes no sum): p, or where
    q̃ is given the residual max(p − q̃, 0) (p where it has no mass: rounding only), by
    inverse CDF in vocabulary order."""
    kept = sorted(kept)  # vocabulary order (tokens are distinct)
    tokens, p = [t for t, _ in kept], [pv for _, pv in kept]
    if q is not None:
        residual = [max(pv - q.get(t, 0.0), 0.0) for t, pv in kept]
        if any(r > 0 for r in residual):
            p = residual
    return tokens[inverse_cdf_index(p, u)]


def _normalised(q_weights: torch.Tensor) -> torch.Tensor:
    """Wire weights [S, K] as q̃'s probabilities, float64."""
    return q_weights.double() / q_weights.sum(dim=-1, keepdim=True).clamp_min(1e-300)


def _q_at(ids: torch.Tensor, q_ids: torch.Tensor, q_weights: torch.Tensor) -> torch.Tensor:
    """q̃ of tokens ids [S, N] from the sparse q̃ [S, K], float64."""
    q = _normalised(q_weights)
    return ((ids[:, :, None] == q_ids[:, None, :]) * q[:, None, :]).sum(dim=-1)


def window_draw(processed, rows, q_ids, q_weights, rejected, u, fixed=False) -> torch.Tensor:
    """`sample_next` for rows whose kept set is inside the top window: p (or the residual)
    over the window's tokens in vocabulary order, float64 — the dense draw's cumulative sums
    exactly (the other tokens add zeros). `fixed`: the residual computed for every row (no
    value read back; the same tokens)."""
    tz, ids = processed.top_z[rows], processed.top_ids[rows]
    log_z, tau = processed.log_z[rows], processed.tau[rows]
    w = torch.where(tz >= tau[:, None], torch.exp(tz.double() - log_z[:, None]), 0.0)
    if q_ids is not None and (fixed or bool(rejected.any())):
        residual = (w - _q_at(ids, q_ids, q_weights)).clamp_min(0.0)
        use = rejected & (residual.sum(dim=-1) > 0)  # no residual mass: p (rounding only)
        w = torch.where(use[:, None], residual, w)
    order = ids.argsort(dim=1)
    ids, w = ids.gather(1, order), w.gather(1, order)
    return ids.gather(1, sample_inverse_cdf(w, u)[:, None]).squeeze(1)


def _sample_chunks(processed, rows, q_ids, q_weights, rejected, u) -> torch.Tensor:
    """`sample_next` for rows whose kept set runs past the window (see there). On a CPU the
    compiled kernel draws them where it is in use (`specdec.core.row_kernel`, `kernel_draw`),
    row by row."""
    kernel = row_kernel.for_device(rows.device)
    if kernel is not None:
        lists = [[] if x is None else x.tolist() for x in (q_ids, q_weights)]
        drawn = kernel_draw(kernel, processed, rows.tolist(), *lists, rejected.tolist(), u.tolist())
        return torch.tensor(drawn, dtype=torch.int64, device=rows.device)
    tokens, empty = chunk_draw(processed, rows, q_ids, q_weights, rejected, u)
    empty = empty.nonzero().squeeze(1)  # rounding chose a chunk with no mass
    if len(empty):
        p = processed.dense(rows[empty])
        q = (
            p
            if q_ids is None
            else dense_q(q_ids[empty], q_weights[empty], processed.logits.shape[1])
        )
        tokens[empty] = draw_next(p, q, rejected[empty], u[empty])
    return tokens


def chunk_draw(processed, rows, q_ids, q_weights, rejected, u, fixed=False):
    """`_sample_chunks`' draw: (tokens, empty [S] bool — rows whose chosen chunk has no mass,
    reachable by rounding only, whose token is not valid). `fixed`: the residual computed for
    every row (no value read back; the same tokens)."""
    logits = processed.logits[rows].float()
    sessions, vocab = logits.shape
    device = logits.device
    z = logits / processed.temperature[rows, None]
    tau, log_z = processed.tau[rows], processed.log_z[rows]
    z_max = processed.top_z[rows, 0]
    e = torch.exp(z - z_max[:, None]).masked_fill_(z < tau[:, None], 0.0)
    scale = torch.exp(z_max.double() - log_z)[:, None]
    mass = chunk_sums(e).double() * scale  # [S, chunks]: p's mass per chunk
    delta = None
    if q_ids is not None and (fixed or bool(rejected.any())):
        zq = z.gather(1, q_ids)
        p_q = torch.where(zq >= tau[:, None], torch.exp(zq.double() - log_z[:, None]), 0.0)
        # residual − p at the K tokens
        delta = -torch.minimum(p_q, _normalised(q_weights)) * rejected[:, None]
        residual = mass.scatter_add(1, q_ids // CHUNK, delta).clamp_min_(0.0)
        # no residual mass is reachable only by rounding (p = q̃): sample p there
        has_mass = residual.sum(dim=-1) > 0
        mass = torch.where(has_mass[:, None], residual, mass)
        delta = delta * has_mass[:, None]
    cum = mass.cumsum(dim=1)
    target = u.double() * cum[:, -1]
    chunk = torch.searchsorted(cum, target[:, None], right=True).squeeze(1)
    chunk = torch.minimum(chunk, (mass > 0).long().cumsum(dim=1).argmax(dim=1))
    start = chunk * CHUNK
    index = start[:, None] + torch.arange(CHUNK, device=device)
    inside = index < vocab
    zc = z.gather(1, index.clamp(max=vocab - 1))
    w = torch.exp(zc.double() - log_z[:, None])
    w = torch.where(inside & (zc >= tau[:, None]), w, 0.0)  # [S, CHUNK] exact p
    if delta is not None:
        offset = q_ids - start[:, None]
        here = (offset >= 0) & (offset < CHUNK)
        w = w.scatter_add(1, offset.clamp(0, CHUNK - 1), delta * here).clamp_min_(0.0)
    rows_ = torch.arange(sessions, device=device)
    before = torch.where(chunk > 0, cum[rows_, (chunk - 1).clamp(min=0)], 0.0)
    local = torch.searchsorted(w.cumsum(dim=1), (target - before)[:, None], right=True)
    last = (w > 0).long().cumsum(dim=1).argmax(dim=1)  # rounding past the chunk's end
    return start + torch.minimum(local.squeeze(1), last), w.sum(dim=1) <= 0
