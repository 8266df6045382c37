"""The draft's proposal distribution q̃ and its sparse wire codec (docs/architecture.md, invariant 2).

The draft applies the request's processors, keeps its top-K, quantises the kept
probabilities to integer wire weights, and defines q̃ = weight / Σ weight. Only then does it
sample its candidate from q̃, so the target verifies against exactly the distribution that
was sampled from, rebuilt from the same integers. Transport is O(γ·K), never O(γ·vocab).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.params import SamplingParams
from specdec.core.rng import Stream, uniform
from specdec.core.sampling import (
    apply_processors,
    group_by_params,
    sample_inverse_cdf,
)
from specdec.errors import InvalidArgument

WIRE_WEIGHT_MAX = 65535  # the most likely kept token gets this weight


@dataclass
class Proposal:
    """One draft step for a batch of sessions."""

    tokens: torch.Tensor  # [B] int64, the sampled candidates
    dist_ids: torch.Tensor | None  # [B, K] int64 token ids of q̃ (None when token-only)
    dist_weights: torch.Tensor | None  # [B, K] int64 wire weights (0 = not in q̃)


def quantise(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K of probs [B, vocab] as (ids [B, K], integer weights [B, K]), weights ≥ 0.

    The largest kept probability maps to WIRE_WEIGHT_MAX, so every row has positive mass.
    """
    top = torch.topk(probs.double(), min(top_k, probs.shape[-1]), dim=-1)
    scaled = top.values / top.values[:, :1] * WIRE_WEIGHT_MAX
    return top.indices, torch.round(scaled).to(torch.int64)


def propose_step(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: torch.Tensor,
    positions: torch.Tensor,
    wire_top_k: int,
    token_only: list[bool],
) -> Proposal:
    """Choose one candidate per session from draft logits [B, vocab].

    Token-only sessions (greedy, or asked for) take the argmax; the others sample from q̃
    with the DRAFT stream at their absolute position.
    """
    batch = logits.shape[0]
    tokens = logits.argmax(dim=-1)  # [B]
    sampled = [b for b in range(batch) if not token_only[b]]
    if not sampled:
        return Proposal(tokens=tokens, dist_ids=None, dist_weights=None)
    k = min(wire_top_k, logits.shape[-1])
    dist_ids = torch.zeros(batch, k, dtype=torch.int64)
    dist_weights = torch.zeros(batch, k, dtype=torch.int64)
    idx = torch.tensor(sampled)
    for key, rows in group_by_params([params[b] for b in sampled]).items():
        rows = idx[rows]
        probs = apply_processors(logits[rows], key).double().softmax(dim=-1)
        dist_ids[rows], dist_weights[rows] = quantise(probs, k)
    u = uniform(seeds[idx], positions[idx], Stream.DRAFT)
    choice = sample_inverse_cdf(dist_weights[idx], u)  # [S]
    tokens[idx] = dist_ids[idx].gather(1, choice[:, None]).squeeze(1)
    return Proposal(tokens=tokens, dist_ids=dist_ids, dist_weights=dist_weights)


def dense_q(ids: torch.Tensor, weights: torch.Tensor, vocab: int) -> torch.Tensor:
    """q̃ as a dense float64 distribution [..., vocab] from wire ids/weights [..., K]."""
    weights = weights.double()
    dense = torch.zeros(*ids.shape[:-1], vocab, dtype=torch.float64)
    dense.scatter_add_(-1, ids.long(), weights)
    return dense / weights.sum(dim=-1, keepdim=True)


def encode_sparse(ids: torch.Tensor, weights: torch.Tensor) -> tuple[list[int], list[int]]:
    """Wire pairs of one q̃ row [K]: zero weights dropped."""
    keep = weights > 0
    return ids[keep].tolist(), weights[keep].tolist()


def validate_sparse(ids: list[int], weights: list[int], vocab: int, field: str) -> None:
    """Raise InvalidArgument naming the field when a wire q̃ is not a valid distribution."""
    if not ids:
        raise InvalidArgument(f"{field}.token_ids must not be empty")
    if len(ids) != len(weights):
        raise InvalidArgument(
            f"{field}: token_ids and weights differ in length ({len(ids)} vs {len(weights)})"
        )
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"{field}.token_ids must not repeat a token")
    if max(ids) >= vocab:
        raise InvalidArgument(f"{field}.token_ids: {max(ids)} is outside the vocabulary ({vocab})")
    if sum(weights) <= 0:
        raise InvalidArgument(f"{field}.weights must have a positive sum")
