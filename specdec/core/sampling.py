"""The request's logits processors and exact sampling from a distribution.

The processors run in a fixed order — temperature, top-k, top-p, min-p — and produce the
exact distribution `p` (or the draft's `q`) that tokens are sampled from. Speculative
verification preserves exactly this distribution (docs/architecture.md, invariant 1).
"""

from __future__ import annotations

import bisect
import itertools

import torch

from specdec.core.params import SamplingParams


def apply_processors(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed logits [..., vocab] (-inf outside the kept set) for sampling params.

    Greedy requests are not processed: they take the argmax of the raw logits.
    """
    logits = logits.float()
    if params.greedy:
        return logits
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1.0 - params.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The exact distribution [..., vocab] (float64) that a token is sampled from.

    Greedy gives the one-hot of the argmax (ties: lowest token id).
    """
    if params.greedy:
        return one_hot(logits.argmax(dim=-1), logits.shape[-1])
    return apply_processors(logits, params).double().softmax(dim=-1)


def group_by_params(params: list[SamplingParams]) -> dict[SamplingParams, torch.Tensor]:
    """Row indices of a batch that share the same sampling params (processed together)."""
    groups: dict[tuple, tuple[SamplingParams, list[int]]] = {}
    for row, item in enumerate(params):
        groups.setdefault(item.processors, (item, []))[1].append(row)
    return {first: torch.tensor(rows) for first, rows in groups.values()}


def batched_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """probs_from_logits for a batch [B, ..., vocab] whose rows have their own params."""
    out = torch.empty(logits.shape, dtype=torch.float64)
    for key, rows in group_by_params(params).items():
        out[rows] = probs_from_logits(logits[rows], key)
    return out


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens.long(), vocab).double()


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index i with probability weights[..., i] / Σ weights using uniforms u [...].

    Exact inverse-CDF sampling in float64; the result always has a positive weight.
    """
    weights = weights.double()
    cdf = weights.cumsum(dim=-1)  # [..., vocab]
    target = (u.double() * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to total: fall back to the last positive weight.
    last_positive = (weights > 0).long().cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(index, last_positive)


def inverse_cdf_index(weights: list[float], u: float) -> int:
    """`sample_inverse_cdf` of one row of Python numbers (a few rows on a CPU): the same
    sequential float64 sums and comparisons, so the same index."""
    cdf = list(itertools.accumulate(map(float, weights)))
    index = bisect.bisect_right(cdf, u * cdf[-1])  # searchsorted, right
    last_positive = max((i for i, w in enumerate(weights) if w > 0), default=0)
    return min(index, last_positive)
