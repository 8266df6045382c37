"""Speculative verification: rejection sampling of a block of candidates, batched over sessions.

Given the target's γ+1 distributions p_1..p_{γ+1} (after the request's processors) and the
draft's q̃_1..q̃_γ, candidate y_i is accepted when u < p_i(y_i)/q̃_i(y_i) (Leviathan et al.,
Chen et al.; docs/architecture.md, "Verification"). At the first rejection the **recovered token** is drawn from the
normalised residual max(p_i − q̃_i, 0); when all γ are accepted the **bonus token** is drawn
from p_{γ+1}. The round stops at the first rejection. Token-only drafts are one-hot q̃.

Greedy needs no special case: p is then the one-hot of the target's argmax, so a candidate is
accepted exactly when it equals the argmax, and the recovered/bonus token is the argmax.
Randomness comes from the session's counter-based stream at the absolute position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.rng import Stream, uniform
from specdec.core.sampling import sample_inverse_cdf


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] int64
    output_tokens: torch.Tensor  # [B, γ+1] int64: accepted then recovered/bonus, -1 padded
    num_output: torch.Tensor  # [B] int64 = num_accepted + 1


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


def verify_block(
    p: torch.Tensor,
    q: torch.Tensor,
    candidates: torch.Tensor,
    num_candidates: torch.Tensor,
    seeds: torch.Tensor,
    base_positions: torch.Tensor,
) -> VerifyResult:
    """Rejection-sample a block of candidates for B sessions at once.

    p: [B, γ+1, vocab] float64 target distributions; q: [B, γ, vocab] float64 draft q̃
    (one-hot rows for token-only drafts); candidates: [B, γ] int64 (padding ignored);
    num_candidates: [B] (γ_b ≤ γ); seeds: [B] int64; base_positions: [B] absolute position
    of candidate 1 (= committed length before the round).
    """
    batch, gamma = candidates.shape
    steps = torch.arange(gamma)
    valid = steps[None, :] < num_candidates[:, None]  # [B, γ]
    safe = torch.where(valid, candidates, torch.zeros_like(candidates))
    p_y = p[:, :gamma].gather(2, safe[..., None]).squeeze(2)  # [B, γ]
    q_y = q.gather(2, safe[..., None]).squeeze(2)  # [B, γ]
    u = uniform(seeds[:, None], base_positions[:, None] + steps[None, :], Stream.ACCEPT)
    accepted = (u < acceptance_probability(p_y, q_y)) & valid  # with probability min(1, p/q̃)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # stop at the first rejection

    rows = torch.arange(batch)
    p_next = p[rows, num_accepted]  # [B, vocab]
    rejected = num_accepted < num_candidates
    q_next = q[rows, num_accepted.clamp(max=max(gamma - 1, 0))] if gamma else p_next
    next_dist = torch.where(rejected[:, None], residual_distribution(p_next, q_next), p_next)
    u_next = uniform(seeds, base_positions + num_accepted, Stream.RESIDUAL)
    next_token = sample_inverse_cdf(next_dist, u_next)  # recovered or bonus token

    output = torch.full((batch, gamma + 1), -1, dtype=torch.int64)
    keep = steps[None, :] < num_accepted[:, None]
    output[:, :gamma] = torch.where(keep, candidates, output[:, :gamma])
    output[rows, num_accepted] = next_token
    return VerifyResult(
        num_accepted=num_accepted, output_tokens=output, num_output=num_accepted + 1
    )
