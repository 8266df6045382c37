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
in full only at each session's first rejected (or bonus) position, one row per session.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.processed import Processed, ProcessorParams, process
from specdec.core.rng import Stream, uniform
from specdec.core.sampling import sample_inverse_cdf


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
    dist = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)
    return sample_inverse_cdf(dist, uniform(seeds, positions, Stream.RESIDUAL))


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
    gamma = slots - 1
    device = logits.device
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    next_tokens = torch.zeros(batch, dtype=torch.int64, device=device)
    candidates, num = block.candidates, block.num_candidates
    steps = torch.arange(gamma, device=device)
    g = greedy.nonzero().squeeze(1)
    if len(g):  # accepted while the candidate is the argmax; the next token is the argmax
        best = (logits if len(g) == batch else logits[g]).argmax(dim=-1)  # [G, γ+1]
        same = (candidates[g] == best[:, :gamma]) & (steps[None, :] < num[g, None])
        num_accepted[g] = same.long().cumprod(dim=1).sum(dim=1)
        next_tokens[g] = best.gather(1, num_accepted[g, None]).squeeze(1)
    s = (~greedy).nonzero().squeeze(1)
    processed = None
    if len(s):
        rows = logits if len(s) == batch else logits[s]  # no copy when all rows sample
        processed = process(rows.reshape(-1, vocab), params.repeat_rows(slots))
        row0 = torch.arange(len(s), device=device) * slots  # first row of each session
        safe = torch.where(steps[None, :] < num[s, None], candidates[s], 0)
        p_y = processed.prob((row0[:, None] + steps[None, :]).reshape(-1), safe.reshape(-1))
        q_y = DraftBlock(candidates[s], num[s], block.q_ids[s], block.q_weights[s])
        n = accepted_prefix(
            p_y.reshape(len(s), gamma), q_y.q_of_candidates(), num[s], seeds[s], base_positions[s]
        )
        p_next = processed.dense(row0 + n)  # [S, vocab]: the only dense rows
        rejected = n < num[s]
        q_next = block.dense_q(s, n.clamp(max=max(gamma - 1, 0)), vocab) if gamma else p_next
        num_accepted[s] = n
        next_tokens[s] = next_token(p_next, q_next, rejected, seeds[s], base_positions[s] + n)
    result = assemble(candidates, num_accepted, next_tokens)
    result.processed = processed
    return result
