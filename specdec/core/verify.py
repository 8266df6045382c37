"""Speculative verification: rejection sampling of a block of candidates, batched over sessions.

Given the target's γ+1 distributions p_1..p_{γ+1} (after the request's processors) and the
draft's q̃_1..q̃_γ, candidate y_i is accepted when u < p_i(y_i)/q̃_i(y_i) (Leviathan et al.,
Chen et al.; docs/architecture.md, "Verification"). At the first rejection the **recovered token** is drawn from the
normalised residual max(p_i − q̃_i, 0); when all γ are accepted the **bonus token** is drawn
from p_{γ+1} (both drawn in `specdec.core.next_token`). The round stops at the first
rejection. Token-only drafts are one-hot q̃.

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

from specdec.core.few_rows import few_rows, row_index
from specdec.core.next_token import draw_next, sample_next, sample_next_few
from specdec.core.processed import Processed, ProcessorParams, process
from specdec.core.proposal import sparse_q
from specdec.core.reduce import first_argmax
from specdec.core.rng import Stream, uniform, uniform_scalar


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
    graphs=None,
) -> VerifyResult:
    """The hot path: verify B sessions from the target's logits [B, γ+1, vocab] (p_1..p_{γ+1}
    of each session, on the model's device). greedy: [B] bool; params: the processors of the
    sampling rows (in row order); seeds, base_positions: [B]. graphs: a
    `specdec.core.graphs.SamplingGraphs` to verify the sampling sessions in fixed shapes
    (one CUDA graph; the same results), or None."""
    batch, slots, vocab = logits.shape
    if graphs is None and few_rows(batch, logits.device):
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
        sampling = DraftBlock(candidates[s], num[s], block.q_ids[s], block.q_weights[s])
        args = (rows.reshape(-1, vocab), params, sampling, seeds[s], base_positions[s])
        done = None if graphs is None else graphs.verify(*args)
        if done is None:
            n, processed = _accept_sampling(*args)
            row0 = torch.arange(len(s), device=device) * slots  # first row of each session
            rejected = n < num[s]
            at = n.clamp(max=max(gamma - 1, 0))
            q_ids = block.q_ids[s, at] if gamma else None
            q_weights = block.q_weights[s, at] if gamma else None
            u = uniform(seeds[s], base_positions[s] + n, Stream.RESIDUAL)
            tokens = sample_next(processed, row0 + n, q_ids, q_weights, rejected, u)
        else:
            n, tokens, processed = done
        num_accepted[s] = n
        next_tokens[s] = tokens
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
    tokens = sample_next_few(
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
