"""Speculative verification: rejection sampling of a block of candidates, batched over sessions.

Given the target's γ+1 distributions p_1..p_{γ+1} (after the request's processors) and the
draft's q̃_1..q̃_γ, candidate y_i is accepted when u < p_i(y_i)/q̃_i(y_i) (Leviathan et al.,
Chen et al.; docs/architecture.md, "Verification"). At the first rejection the **recovered token** is drawn from the
normalised residual max(p_i − q̃_i, 0); when all γ are accepted the **bonus token** is drawn
from p_{γ+1}. The round stops at the first rejection. Token-only drafts are one-hot q̃.

Greedy is the special case p = one-hot(argmax): a candidate is accepted exactly when it
equals the target's argmax, and the recovered/bonus token is the argmax — so greedy rows
are an argmax comparison, with no softmax and no one-hot (`verify_logits`).
Randomness comes from the session's counter-based stream at the absolute position.

Two front ends share the rule: `verify_block` takes dense p and q̃ (the reference the
lossless tests check), `verify_logits` the hot path: the target's logits, the processors as
tensors and the draft's sparse q̃ — p is evaluated only at the candidates (B·γ numbers) and
in full only at each session's first rejected (or bonus) position, one row per session; the
sampling rows are processed (top-k/top-p/min-p) position by position for the sessions still
accepting, so a session's rows after its first rejection are never touched. A few sessions
on a CPU take the same steps with their bookkeeping on Python numbers (`_verify_few`): the
same result, without ~300 tensor ops of dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.processed import (
    CHUNK,
    Processed,
    ProcessorParams,
    chunk_sums,
    few_rows,
    process,
    row_index,
)
from specdec.core.proposal import dense_q, sparse_q
from specdec.core.reduce import first_argmax
from specdec.core.rng import Stream, uniform, uniform_scalar
from specdec.core.sampling import inverse_cdf_index, sample_inverse_cdf


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64
    output_tokens: torch.Tensor  # [B, γ+1] int64: accepted then recovered/bonus, -1 padded
    num_output: torch.Tensor  # [B] int64 = num_accepted + 1
    # the hot path's processed p of the sampling rows ([S·(γ+1)] rows, session order), so a
    # caller wanting log-probabilities does not process the logits again
    processed: Processed | None = None


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) per token [..., vocab]; defined as 0 where q = 0 (never proposed)."""
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.zeros_like(p))
    return ratio.clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Normalised max(p − q, 0) [..., vocab]; p itself where the residual has no mass.

    The fallback is only reached through rounding (rejection has probability 0 when p = q).
    """
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-300), p)


def accepted_prefix(
    p_y: torch.Tensor,
    q_y: torch.Tensor,
    num_candidates: torch.Tensor,
    seeds: torch.Tensor,
    base_positions: torch.Tensor,
) -> torch.Tensor:
    """How many candidates are accepted [B]: u_i < min(1, p(y_i)/q̃(y_i)), up to the first
    rejection. p_y, q_y: [B, γ] float64 at the candidates."""
    gamma = p_y.shape[1]
    steps = torch.arange(gamma, device=p_y.device)
    valid = steps[None, :] < num_candidates[:, None]  # [B, γ]
    u = uniform(seeds[:, None], base_positions[:, None] + steps[None, :], Stream.ACCEPT)
    accepted = (u < acceptance_probability(p_y, q_y)) & valid
    return accepted.long().cumprod(dim=1).sum(dim=1)  # stop at the first rejection


def next_token(
    p_next: torch.Tensor,
    q_next: torch.Tensor,
    rejected: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The recovered token (residual of p_next − q_next where rejected) or the bonus token
    (p_next) [S]. p_next, q_next: [S, vocab] float64; positions: absolute, [S]."""
    return draw_next(p_next, q_next, rejected, uniform(seeds, positions, Stream.RESIDUAL))


def draw_next(p_next, q_next, rejected, u) -> torch.Tensor:
    """`next_token` with the uniforms given."""
    dist = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)
    return sample_inverse_cdf(dist, u)


def assemble(
    candidates: torch.Tensor, num_accepted: torch.Tensor, next_tokens: torch.Tensor
) -> VerifyResult:
    """Accepted candidates then the recovered/bonus token, -1 padded: [B, γ+1]."""
    batch, gamma = candidates.shape
    rows = torch.arange(batch, device=candidates.device)
    output = torch.full((batch, gamma + 1), -1, dtype=torch.int64, device=candidates.device)
    keep = torch.arange(gamma, device=candidates.device)[None, :] < num_accepted[:, None]
    output[:, :gamma] = torch.where(keep, candidates, output[:, :gamma])
    output[rows, num_accepted] = next_tokens
    return VerifyResult(
        num_accepted=num_accepted, output_tokens=output, num_output=num_accepted + 1
    )


def verify_block(
    p: torch.Tensor,
    q: torch.Tensor,
    candidates: torch.Tensor,
    num_candidates: torch.Tensor,
    seeds: torch.Tensor,
    base_positions: torch.Tensor,
) -> VerifyResult:
    """Rejection-sample a block of candidates for B sessions at once, from dense p and q̃.

    p: [B, γ+1, vocab] float64 target distributions; q: [B, γ, vocab] float64 draft q̃
    (one-hot rows for token-only drafts); candidates: [B, γ] int64 (padding ignored);
    num_candidates: [B] (γ_b ≤ γ); seeds: [B] int64; base_positions: [B] absolute position
    of candidate 1 (= committed length before the round).
    """
    batch, gamma = candidates.shape
    valid = torch.arange(gamma)[None, :] < num_candidates[:, None]
    safe = torch.where(valid, candidates, torch.zeros_like(candidates))
    p_y = p[:, :gamma].gather(2, safe[..., None]).squeeze(2)  # [B, γ]
    q_y = q.gather(2, safe[..., None]).squeeze(2)  # [B, γ]
    num_accepted = accepted_prefix(p_y, q_y, num_candidates, seeds, base_positions)
    rows = torch.arange(batch)
    p_next = p[rows, num_accepted]  # [B, vocab]
    q_next = q[rows, num_accepted.clamp(max=max(gamma - 1, 0))] if gamma else p_next
    rejected = num_accepted < num_candidates
    tokens = next_token(p_next, q_next, rejected, seeds, base_positions + num_accepted)
    return assemble(candidates, num_accepted, tokens)


@dataclass
class DraftBlock:
    """The candidates of B sessions and their sparse q̃, as the wire carries them."""

    candidates: torch.Tensor  # [B, γ] int64 (padding ignored)
    num_candidates: torch.Tensor  # [B] int64
    q_ids: torch.Tensor  # [B, γ, K] int64 token ids of q̃ (token-only: the candidate)
    q_weights: torch.Tensor  # [B, γ, K] float64 wire weights, 0 = padding

    def q_of_candidates(self) -> torch.Tensor:
        """q̃(y_i) = weight of y_i / Σ weights, [B, γ] float64."""
        hit = (self.q_ids == self.candidates[..., None]).double()
        total = self.q_weights.sum(dim=-1).clamp_min(1e-300)
        return (hit * self.q_weights).sum(dim=-1) / total

    def dense_q(self, rows: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
        """q̃ at one position per row as [len(rows), vocab] float64 (one row per session)."""
        ids, weights = self.q_ids[rows, position], self.q_weights[rows, position]
        dense = torch.zeros(len(rows), vocab, dtype=torch.float64, device=ids.device)
        dense.scatter_add_(1, ids, weights)
        return dense / weights.sum(dim=-1, keepdim=True).clamp_min(1e-300)


def verify_logits(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    params: ProcessorParams,
    block: DraftBlock,
    seeds: torch.Tensor,
    base_positions: torch.Tensor,
) -> VerifyResult:
    """The hot path: verify B sessions from the target's logits [B, γ+1, vocab] (p_1..p_{γ+1}
    of each session, on the model's device). greedy: [B] bool; params: the processors of the
    sampling rows (in row order); seeds, base_positions: [B]."""
    batch, slots, vocab = logits.shape
    if few_rows(batch, logits.device):
        return _verify_few(logits, greedy, params, block, seeds, base_positions)
    gamma = slots - 1
    device = logits.device
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    next_tokens = torch.zeros(batch, dtype=torch.int64, device=device)
    candidates, num = block.candidates, block.num_candidates
    steps = torch.arange(gamma, device=device)
    g = greedy.nonzero().squeeze(1)
    if len(g):  # accepted while the candidate is the argmax; the next token is the argmax
        best = first_argmax(logits if len(g) == batch else logits[g])  # [G, γ+1]
        same = (candidates[g] == best[:, :gamma]) & (steps[None, :] < num[g, None])
        num_accepted[g] = same.long().cumprod(dim=1).sum(dim=1)
        next_tokens[g] = best.gather(1, num_accepted[g, None]).squeeze(1)
    s = (~greedy).nonzero().squeeze(1)
    processed = None
    if len(s):
        rows = logits if len(s) == batch else logits[s]  # no copy when all rows sample
        n, processed = _accept_sampling(
            rows.reshape(-1, vocab),
            params,
            DraftBlock(candidates[s], num[s], block.q_ids[s], block.q_weights[s]),
            seeds[s],
            base_positions[s],
        )
        row0 = torch.arange(len(s), device=device) * slots  # first row of each session
        rejected = n < num[s]
        at = n.clamp(max=max(gamma - 1, 0))
        q_ids = block.q_ids[s, at] if gamma else None
        q_weights = block.q_weights[s, at] if gamma else None
        u = uniform(seeds[s], base_positions[s] + n, Stream.RESIDUAL)
        num_accepted[s] = n
        next_tokens[s] = sample_next(processed, row0 + n, q_ids, q_weights, rejected, u)
    result = assemble(candidates, num_accepted, next_tokens)
    result.processed = processed
    return result


def _verify_few(logits, greedy, params, block, seeds, base_positions) -> VerifyResult:
    """`verify_logits` for a few sessions on a CPU, its bookkeeping on Python numbers (a
    torch op costs ~5–10 µs of dispatch here, a Python step well under one)."""
    batch, slots, vocab = logits.shape
    gamma = slots - 1
    candidates, offered = block.candidates.tolist(), block.num_candidates.tolist()
    greedy = greedy.tolist()
    num_accepted, next_tokens = [0] * batch, [0] * batch
    g = [b for b in range(batch) if greedy[b]]
    if g:  # accepted while the candidate is the argmax; the next token is the argmax
        for b, best in zip(g, first_argmax(logits[row_index(g)]).tolist()):
            run = 0
            while run < offered[b] and candidates[b][run] == best[run]:
                run += 1
            num_accepted[b], next_tokens[b] = run, best[run]
    s = [b for b in range(batch) if not greedy[b]]
    processed = None
    if s:
        i = row_index(s)
        sampling = DraftBlock(
            block.candidates[i], block.num_candidates[i], block.q_ids[i], block.q_weights[i]
        )
        counts, tokens, processed = _verify_sampling_few(
            logits[i].reshape(-1, vocab), params, sampling, seeds[i], base_positions[i]
        )
        for b, count, token in zip(s, counts, tokens):
            num_accepted[b], next_tokens[b] = count, token
    output = [  # accepted candidates, then the recovered/bonus token, -1 padded
        candidates[b][:n] + [next_tokens[b]] + [-1] * (gamma - n)
        for b, n in enumerate(num_accepted)
    ]
    accepted = torch.tensor(num_accepted)
    return VerifyResult(accepted, torch.tensor(output), accepted + 1, processed)


def _verify_sampling_few(
    rows, params, block, seeds, base_positions
) -> tuple[list[int], list[int], Processed]:
    """`_accept_sampling`, then `sample_next` at each session's last position, for a few
    sessions on a CPU: the same rows processed in the same groups (position by position,
    the sessions still accepting together), the same uniforms, p(y) (`Processed.prob_of`)
    and q̃(y) (`sparse_q`), so the same accepted counts, next tokens and processed rows."""
    sessions, gamma = block.candidates.shape
    slots = gamma + 1
    candidates, offered = block.candidates.tolist(), block.num_candidates.tolist()
    q_ids, q_weights = block.q_ids.tolist(), block.q_weights.tolist()  # [S][γ][K]
    seeds, base = seeds.tolist(), base_positions.tolist()
    n = [0] * sessions
    going, parts = list(range(sessions)), []  # sessions whose position i is processed
    for i in range(slots):
        index = row_index([b * slots + i for b in going])
        part = process(rows[index], params[row_index(going)])
        parts.append((index, part))
        for b in going:
            n[b] = i
        if i == gamma:
            break
        asked = [r for r, b in enumerate(going) if i < offered[b]]  # rows of `part`
        p_y = part.prob_of(asked, [candidates[going[r]][i] for r in asked])
        accepted = []
        for r, p in zip(asked, p_y):
            b = going[r]
            q_y = sparse_q(q_ids[b][i], q_weights[b][i]).get(candidates[b][i], 0.0)
            if uniform_scalar(seeds[b], base[b] + i, Stream.ACCEPT) < _acceptance(p, q_y):
                accepted.append(b)
                n[b] = i + 1
        going = accepted
        if not going:
            break
    processed = Processed.gather(rows, parts)
    at = [min(a, gamma - 1) for a in n]  # q̃ of the position drawn at (none when γ = 0)
    tokens = _sample_next_few(
        processed,
        [b * slots + a for b, a in enumerate(n)],
        [q_ids[b][a] for b, a in enumerate(at)] if gamma else None,
        [q_weights[b][a] for b, a in enumerate(at)] if gamma else None,
        [a < offered[b] for b, a in enumerate(n)],
        [uniform_scalar(seeds[b], base[b] + a, Stream.RESIDUAL) for b, a in enumerate(n)],
    )
    return n, tokens, processed


def _acceptance(p: float, q: float) -> float:
    """`acceptance_probability` of one token: min(1, p/q), 0 where q = 0."""
    return min(p / max(q, 1e-300), 1.0) if q > 0 else 0.0


def _accept_sampling(
    rows: torch.Tensor,
    params: ProcessorParams,
    block: DraftBlock,
    seeds: torch.Tensor,
    base_positions: torch.Tensor,
) -> tuple[torch.Tensor, Processed]:
    """Accepted candidates of S sampling sessions [S] from their logits rows [S·(γ+1), vocab]
    (session-major), processing position by position only the sessions still accepting: a
    session's rows after its first rejection are never processed (the costly part at a real
    vocabulary is the flat rows' top-p), so a round processes Σ (accepted + 1) rows, not
    S·(γ+1). The same test as `accepted_prefix`, u_i < min(1, p(y_i)/q̃(y_i)) with the same
    uniforms, so the result is the same. Returns the counts and the processed rows (rows
    past a session's last one are left unprocessed: τ = +inf, p = 0)."""
    sessions, gamma = block.candidates.shape
    slots, device = gamma + 1, rows.device
    steps = torch.arange(gamma, device=device)
    u = uniform(seeds[:, None], base_positions[:, None] + steps[None, :], Stream.ACCEPT)
    q_y = block.q_of_candidates()  # [S, γ]
    n = torch.zeros(sessions, dtype=torch.int64, device=device)
    going = torch.arange(sessions, device=device)  # sessions whose position i is processed
    parts: list[tuple[torch.Tensor, Processed]] = []
    for i in range(slots):
        index = going * slots + i
        part = process(rows[index], params[going])
        parts.append((index, part))
        n[going] = i
        if i == gamma:
            break
        offered = i < block.num_candidates[going]
        y = torch.where(offered, block.candidates[going, i], 0)
        p_y = part.prob(torch.arange(len(going), device=device), y)
        accept = offered & (u[going, i] < acceptance_probability(p_y, q_y[going, i]))
        n[going[accept]] = i + 1
        going = going[accept]
        if not len(going):
            break
    return n, Processed.gather(rows, parts)


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
    is sampled from the window alone, exactly (`_sample_window`). q_ids, q_weights: [S, K]
    q̃ of each row's position (None: no candidates)."""
    if few_rows(len(rows), rows.device):
        args = (x if x is None else x.tolist() for x in (rows, q_ids, q_weights, rejected, u))
        return torch.tensor(_sample_next_few(processed, *args))
    tokens = torch.empty(len(rows), dtype=torch.int64, device=rows.device)
    inside = processed.top_z[rows, -1] < processed.tau[rows]  # nothing kept past the window
    if processed.top_z.shape[1] >= processed.logits.shape[1]:
        inside[:] = True
    for mask, sample in ((inside, _sample_window), (~inside, _sample_chunks)):
        r = mask.nonzero().squeeze(1)
        if len(r):
            qi = None if q_ids is None else q_ids[r]
            qw = None if q_weights is None else q_weights[r]
            tokens[r] = sample(processed, rows[r], qi, qw, rejected[r], u[r])
    return tokens


def _sample_next_few(processed, rows, q_ids, q_weights, rejected, u) -> list[int]:
    """`sample_next` for a few rows on a CPU, every argument a list (q_ids, q_weights: [S][K]
    or None). A row whose kept set is inside the window is drawn as `_sample_window` draws
    it, on Python numbers (torch's exp, the same sequential sums and comparisons); the
    others by `_sample_chunks`."""
    tokens = [0] * len(rows)
    last, tau = processed.top_z[:, -1].tolist(), processed.tau.tolist()
    whole = processed.top_z.shape[1] >= processed.logits.shape[1]
    inside = [j for j, r in enumerate(rows) if whole or last[r] < tau[r]]
    if inside:
        i = row_index([rows[j] for j in inside])
        top_z, log_z = processed.top_z[i], processed.log_z[i]
        p = torch.exp(top_z.double() - log_z[:, None]).tolist()
        for j, z, p_row, ids in zip(inside, top_z.tolist(), p, processed.top_ids[i].tolist()):
            kept = [(t, pv) for t, pv, zv in zip(ids, p_row, z) if zv >= tau[rows[j]]]
            q = sparse_q(q_ids[j], q_weights[j]) if q_ids is not None and rejected[j] else None
            tokens[j] = _draw_window(kept, q, u[j])
    out = [j for j in range(len(rows)) if j not in inside]
    if out:
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


def _draw_window(kept: list[tuple[int, float]], q: dict[int, float] | None, u: float) -> int:
    """One `_sample_window` draw on Python numbers from the kept (token, p) pairs of a window
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


def _sample_window(processed, rows, q_ids, q_weights, rejected, u) -> torch.Tensor:
    """`sample_next` for rows whose kept set is inside the top window: p (or the residual)
    over the window's tokens in vocabulary order, float64 — the dense draw's cumulative sums
    exactly (the other tokens add zeros)."""
    tz, ids = processed.top_z[rows], processed.top_ids[rows]
    log_z, tau = processed.log_z[rows], processed.tau[rows]
    w = torch.where(tz >= tau[:, None], torch.exp(tz.double() - log_z[:, None]), 0.0)
    if q_ids is not None and bool(rejected.any()):
        residual = (w - _q_at(ids, q_ids, q_weights)).clamp_min(0.0)
        use = rejected & (residual.sum(dim=-1) > 0)  # no residual mass: p (rounding only)
        w = torch.where(use[:, None], residual, w)
    order = ids.argsort(dim=1)
    ids, w = ids.gather(1, order), w.gather(1, order)
    return ids.gather(1, sample_inverse_cdf(w, u)[:, None]).squeeze(1)


def _sample_chunks(processed, rows, q_ids, q_weights, rejected, u) -> torch.Tensor:
    """`sample_next` for rows whose kept set runs past the window (see there)."""
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
    if q_ids is not None and bool(rejected.any()):
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
    tokens = start + torch.minimum(local.squeeze(1), last)
    empty = (w.sum(dim=1) <= 0).nonzero().squeeze(1)  # rounding chose a chunk with no mass
    if len(empty):
        p = processed.dense(rows[empty])
        q = p if q_ids is None else dense_q(q_ids[empty], q_weights[empty], vocab)
        tokens[empty] = draw_next(p, q, rejected[empty], u[empty])
    return tokens
