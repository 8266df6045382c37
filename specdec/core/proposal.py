"""The draft's proposal distribution q̃ and its sparse wire codec (docs/architecture.md, invariant 2).

The draft applies the request's processors, keeps its top-K, quantises the kept
probabilities to integer wire weights, and defines q̃ = weight / Σ weight. Only then does it
sample its candidate from q̃, so the target verifies against exactly the distribution that
was sampled from, rebuilt from the same integers. Transport is O(γ·K), never O(γ·vocab).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core import row_kernel
from specdec.core.few_rows import few_rows
from specdec.core.params import SamplingParams
from specdec.core.processed import WINDOW, ProcessorParams, process
from specdec.core.reduce import first_argmax
from specdec.core.rng import Stream, uniform, uniform_scalar
from specdec.core.sampling import inverse_cdf_index, sample_inverse_cdf

WIRE_WEIGHT_MAX = 65535  # the most likely kept token gets this weight


@dataclass
class Proposal:
    """One draft step for a batch of sessions."""

    tokens: torch.Tensor  # [B] int64, the sampled candidates
    dist_ids: torch.Tensor | None  # [B, K] int64 token ids of q̃ (None when token-only)
    dist_weights: torch.Tensor | None  # [B, K] int64 wire weights (0 = not in q̃)

    def over(self, token_ids: torch.Tensor) -> Proposal:
        """The same proposal with column indices of a restricted head mapped to token ids
        (`token_ids[column]`): q̃ keeps its weights, only the ids it names change."""
        return Proposal(
            tokens=token_ids[self.tokens],
            dist_ids=None if self.dist_ids is None else token_ids[self.dist_ids],
            dist_weights=self.dist_weights,
        )


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
    graphs=None,
) -> Proposal:
    """Choose one candidate per session from draft logits [B, vocab] (on the model's device).

    Token-only sessions (greedy) take the argmax; the others sample from q̃ with the DRAFT
    stream at their absolute position. q̃ is the top-K of the processed distribution with
    weights round(WIRE_WEIGHT_MAX · p(v) / p_max) = round(WIRE_WEIGHT_MAX · exp(z_v − z_max)):
    the normaliser cancels, so only the window of the largest values is touched. graphs: a
    `specdec.core.graphs.SamplingGraphs` to draw the sampled rows in fixed shapes (one CUDA
    graph; the same candidates and q̃), or None.
    """
    batch, vocab = logits.shape
    device = logits.device
    sampled = [b for b in range(batch) if not token_only[b]]
    if not sampled:
        return Proposal(tokens=first_argmax(logits), dist_ids=None, dist_weights=None)
    k = min(wire_top_k, vocab)
    rows = logits if len(sampled) == batch else logits[sampled]  # no copy when all rows sample
    row_params = [params[b] for b in sampled]
    idx, done, pp = None, None, None
    if graphs is not None:
        pp = ProcessorParams.of(row_params, device=device)
        idx = torch.tensor(sampled, device=device)
        done = graphs.propose(rows, pp, seeds.to(device)[idx], positions.to(device)[idx], k)
    kernel = row_kernel.for_device(device) if done is None else None
    if kernel is not None:  # each row's step in one call (`specdec.core.row_kernel`)
        done = _kernel_step(kernel, rows, row_params, sampled, seeds, positions, k)
        if len(sampled) == batch:
            return Proposal(*done)
        idx = torch.tensor(sampled, device=device)
    if done is not None:
        chosen, ids, weights = done
    else:
        pp = ProcessorParams.of(row_params, device=device) if pp is None else pp
        processed = process(rows, pp, window=max(WINDOW, k), window_only=True)
        if few_rows(len(sampled), device):
            return _draw_few(logits, processed, sampled, seeds, positions, k)
        idx = torch.tensor(sampled, device=device) if idx is None else idx
        z = processed.top_z[:, :k]
        scaled = torch.exp(z.double() - z[:, :1].double()) * WIRE_WEIGHT_MAX
        weights = torch.where(z >= processed.tau[:, None], torch.round(scaled), 0.0)
        weights = weights.to(torch.int64)
        ids = processed.top_ids[:, :k]
        u = uniform(seeds.to(device)[idx], positions.to(device)[idx], Stream.DRAFT)
        chosen = ids.gather(1, sample_inverse_cdf(weights, u)[:, None]).squeeze(1)  # [S]
    tokens = torch.zeros(batch, dtype=torch.int64, device=device)
    if len(sampled) < batch:  # the argmax only where it is the candidate
        only = torch.tensor([b for b in range(batch) if token_only[b]], device=device)
        tokens[only] = first_argmax(logits[only])
    dist_ids = torch.zeros(batch, k, dtype=torch.int64, device=device)
    dist_weights = torch.zeros(batch, k, dtype=torch.int64, device=device)
    dist_ids[idx], dist_weights[idx], tokens[idx] = ids, weights, chosen
    return Proposal(tokens=tokens, dist_ids=dist_ids, dist_weights=dist_weights)


def _kernel_step(kernel, rows, params, sampled, seeds, positions, k):
    """The compiled kernel's draft step of the sampled rows: (candidates, q̃ ids, weights)."""
    seeds, positions = seeds.tolist(), positions.tolist()
    u = [uniform_scalar(seeds[b], positions[b], Stream.DRAFT) for b in sampled]
    temperature, top_k, top_p, min_p = zip(
        *((p.temperature, p.top_k, p.top_p, p.min_p) for p in params)
    )
    rows = rows if rows.dtype == torch.float32 else rows.float()  # as `process` takes them
    return kernel.draft(rows, temperature, top_k, top_p, min_p, k, u)


def _draw_few(logits, processed, sampled, seeds, positions, k) -> Proposal:
    """`propose_step`'s weights and draws for a few rows on a CPU, on Python numbers: the same
    exp (torch's), rounding (half to even) and inverse-CDF sums, so the same q̃ and tokens."""
    batch = logits.shape[0]
    z = processed.top_z[:, :k]
    scaled = torch.exp(z.double() - z[:, :1].double()).tolist()
    window, tau, ids = z.tolist(), processed.tau.tolist(), processed.top_ids[:, :k].tolist()
    seeds, positions = seeds.tolist(), positions.tolist()
    tokens, weights = [0] * batch, [[0] * k for _ in range(batch)]
    for j, b in enumerate(sampled):
        weights[b] = [
            round(e * WIRE_WEIGHT_MAX) if v >= tau[j] else 0 for e, v in zip(scaled[j], window[j])
        ]
        u = uniform_scalar(seeds[b], positions[b], Stream.DRAFT)
        tokens[b] = ids[j][inverse_cdf_index(weights[b], u)]
    if len(sampled) == batch:
        dist_ids = processed.top_ids[:, :k]
    else:
        dist_ids = torch.zeros(batch, k, dtype=torch.int64)
        dist_ids[sampled] = processed.top_ids[:, :k]
        only = [b for b in range(batch) if b not in sampled]  # the argmax only where it is
        for b, token in zip(only, first_argmax(logits[only]).tolist()):
            tokens[b] = token
    return Proposal(torch.tensor(tokens), dist_ids, torch.tensor(weights))


def dense_q(ids: torch.Tensor, weights: torch.Tensor, vocab: int) -> torch.Tensor:
    """q̃ as a dense float64 distribution [..., vocab] from wire ids/weights [..., K]."""
    weights = weights.double()
    dense = torch.zeros(*ids.shape[:-1], vocab, dtype=torch.float64, device=ids.device)
    dense.scatter_add_(-1, ids.long(), weights)
    return dense / weights.sum(dim=-1, keepdim=True)


def encode_sparse(ids: list[int], weights: list[int]) -> tuple[list[int], list[int]]:
    """Wire pairs of one q̃ row (K ids and integer weights, lists): zero weights dropped."""
    kept = [j for j, w in enumerate(weights) if w > 0]
    return [ids[j] for j in kept], [weights[j] for j in kept]


def sparse_q(ids: list[int], weights: list[float]) -> dict[int, float]:
    """q̃ of one position as {token: probability} from its wire ids and weights (lists): each
    token's weights summed, then divided by the total, as `dense_q` computes it (weights are
    integers, so the sums are exact in any order)."""
    mass: dict[int, float] = {}
    for token, weight in zip(ids, weights):
        mass[token] = mass.get(token, 0.0) + weight
    total = max(sum(weights), 1e-300)
    return {token: weight / total for token, weight in mass.items()}
