"""Target engine: one batched forward over many sessions' candidate blocks, then each
session's rejection sampling (specdec.core.verify). Runs in the model thread."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core import graphs
from specdec.core.params import SamplingParams
from specdec.core.processed import ProcessorParams
from specdec.core.rng import seed_tensor
from specdec.core.verify import DraftBlock, verify_logits
from specdec.engine.kv import KVSession
from specdec.engine.model import ModelRuntime


@dataclass
class VerifyItem:
    session: KVSession
    base_len: int
    candidates: list[int]
    dist_ids: list[list[int]] | None  # per candidate, None when token-only
    dist_weights: list[list[int]] | None
    params: SamplingParams
    seed: int
    return_logprobs: bool
    top_logprobs: int = 0  # with return_logprobs: alternatives per output token


@dataclass
class VerifyOutcome:
    num_accepted: int
    output_ids: list[int]
    logprobs: list[float]
    computed_tokens: int
    top_logprobs: list[tuple[list[int], list[float]]] | None = None  # per output token


@dataclass
class PrefillItem:
    """A chunk of committed tokens whose KV is computed ahead of the first Verify."""

    session: KVSession
    tokens: list[int]


class TargetEngine:
    def __init__(
        self, runtime: ModelRuntime, sampling_graphs: str = "auto", sampling_graphs_mb: int = 4096
    ):
        if runtime.head_ids is not None:
            raise ValueError(
                "model: a restricted LM head (head.safetensors) can serve only as a draft; "
                "verification needs the target's full distribution"
            )
        self.runtime = runtime
        # --sampling-graphs, --sampling-graphs-mb
        self.graphs = graphs.for_device(sampling_graphs, runtime.device, sampling_graphs_mb)

    def process(self, items: list) -> list:
        """Run one batch from the batcher: prefill chunks and verify blocks, one forward each."""
        results: list = [None] * len(items)
        prefill = [i for i, item in enumerate(items) if isinstance(item, PrefillItem)]
        if prefill:
            self.runtime.forward(  # logits of one position: the KV is what a prefill is for
                [items[i].session for i in prefill], [items[i].tokens for i in prefill], keep=1
            )
            for i in prefill:
                results[i] = len(items[i].tokens)
        verify = [i for i, item in enumerate(items) if not isinstance(item, PrefillItem)]
        if verify:
            for i, outcome in zip(verify, self.verify([items[i] for i in verify])):
                results[i] = outcome
        return results

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutcome]:
        """Verify every item's candidates in one forward pass (batched over sessions).

        The LM head runs for each session's last γ+1 positions only; the logits stay on the
        model's device and go to `verify_logits` whole: no per-session loop touches them.
        """
        gamma = max(len(item.candidates) for item in items)
        inputs = [item.session.pending() + item.candidates for item in items]
        logits = self.runtime.forward([item.session for item in items], inputs, keep=gamma + 1)
        block = draft_block(items, gamma, logits.device)
        greedy = torch.tensor([item.params.greedy for item in items], device=logits.device)
        sampling = ProcessorParams.of(
            [item.params for item in items if not item.params.greedy], device=logits.device
        )
        seeds = seed_tensor([item.seed for item in items], device=logits.device)
        base = torch.tensor([item.base_len for item in items], device=logits.device)
        # a session with g < γ candidates: its p_1..p_{g+1} are the first g+1 of its last γ+1
        shift = torch.tensor([gamma - len(item.candidates) for item in items], device=logits.device)
        if bool(shift.any()):
            slots = (torch.arange(gamma + 1, device=logits.device)[None] + shift[:, None]).clamp(
                max=gamma
            )
            logits = logits.gather(1, slots[..., None].expand(-1, -1, logits.shape[-1]))
        result = verify_logits(logits, greedy, sampling, block, seeds, base, self.graphs)
        num_accepted = result.num_accepted.tolist()
        outputs = result.output_tokens.tolist()
        logprobs, tops = self._logprobs(items, logits, greedy, result)
        outcomes = []
        for b, item in enumerate(items):
            n = num_accepted[b]
            # keep the accepted candidates' KV; the recovered/bonus token has none yet
            item.session.crop(item.base_len + n)
            outcomes.append(
                VerifyOutcome(n, outputs[b][: n + 1], logprobs[b], len(inputs[b]), tops[b])
            )
        return outcomes

    def _logprobs(self, items, logits, greedy, result):
        """log p of each output token under the request's processed p (the raw softmax for
        greedy requests), and its `top_logprobs` likeliest alternatives from the same
        distribution, for the items that asked; from the verify's own processed rows."""
        out: list[list[float]] = [[] for _ in items]
        tops: list = [None for _ in items]
        wanted = [b for b, item in enumerate(items) if item.return_logprobs]
        if not wanted:
            return out, tops
        processed = result.processed
        sampling_row = {int(b): i for i, b in enumerate((~greedy).nonzero().squeeze(1).tolist())}
        for b in wanted:
            n = int(result.num_accepted[b])
            k = items[b].top_logprobs
            tokens = result.output_tokens[b, : n + 1]
            positions = torch.arange(n + 1, device=logits.device)
            if items[b].params.greedy:
                lp = logits[b, : n + 1].double().log_softmax(-1)
                values = lp[positions, tokens]
                top_lp, top_ids = lp.topk(k, dim=-1) if k else (None, None)
            else:
                rows = sampling_row[b] * logits.shape[1] + positions
                values = processed.prob(rows, tokens).log()
                top_lp, top_ids = processed.top(rows, k) if k else (None, None)
            out[b] = values.tolist()
            if k:
                tops[b] = [
                    (
                        [int(t) for t, v in zip(ids, lps) if v != float("-inf")],
                        [float(v) for v in lps if v != float("-inf")],
                    )
                    for ids, lps in zip(top_ids.tolist(), top_lp.tolist())
                ]
        return out, tops


def draft_block(items: list[VerifyItem], gamma: int, device) -> DraftBlock:
    """The items' candidates and sparse q̃ as padded tensors (token-only: the candidate, 1),
    padded on Python lists and made into one tensor each (a tensor and indexed writes a
    candidate cost 117 µs for one session's block with q̃ of 64 at γ = 4; 47 µs so)."""
    k = max([len(ids) for item in items for ids in (item.dist_ids or [])] + [1])
    candidates, q_ids, q_weights = [], [], []
    for item in items:
        pad = gamma - len(item.candidates)
        candidates += item.candidates + [0] * pad
        if item.dist_ids is None:
            q_ids += [[c] + [0] * (k - 1) for c in item.candidates]
            q_weights += [[1.0] + [0.0] * (k - 1) for _ in item.candidates]
        else:
            q_ids += [ids + [0] * (k - len(ids)) for ids in item.dist_ids]
            q_weights += [weights + [0] * (k - len(weights)) for weights in item.dist_weights]
        q_ids += [[0] * k] * pad
        q_weights += [[0.0] * k] * pad
    shape = (len(items), gamma, k)
    return DraftBlock(
        torch.tensor(candidates, dtype=torch.int64, device=device).reshape(shape[:2]),
        torch.tensor([len(item.candidates) for item in items], device=device),
        torch.tensor(q_ids, dtype=torch.int64, device=device).reshape(shape),
        torch.tensor(q_weights, dtype=torch.float64, device=device).reshape(shape),
    )
