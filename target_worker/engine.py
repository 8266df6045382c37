"""Target engine: one batched forward over many sessions' candidate blocks, then each
session's rejection sampling (specdec.core.verify). Runs in the model thread."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.params import SamplingParams
from specdec.core.proposal import dense_q
from specdec.core.rng import seed_tensor
from specdec.core.sampling import batched_probs, one_hot
from specdec.core.verify import verify_block
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


@dataclass
class VerifyOutcome:
    num_accepted: int
    output_ids: list[int]
    logprobs: list[float]
    computed_tokens: int


@dataclass
class PrefillItem:
    """A chunk of committed tokens whose KV is computed ahead of the first Verify."""

    session: KVSession
    tokens: list[int]


class TargetEngine:
    def __init__(self, runtime: ModelRuntime):
        self.runtime = runtime

    def process(self, items: list) -> list:
        """Run one batch from the batcher: prefill chunks and verify blocks, one forward each."""
        results: list = [None] * len(items)
        prefill = [i for i, item in enumerate(items) if isinstance(item, PrefillItem)]
        if prefill:
            self.runtime.forward(
                [items[i].session for i in prefill], [items[i].tokens for i in prefill]
            )
            for i in prefill:
                results[i] = len(items[i].tokens)
        verify = [i for i, item in enumerate(items) if not isinstance(item, PrefillItem)]
        if verify:
            for i, outcome in zip(verify, self.verify([items[i] for i in verify])):
                results[i] = outcome
        return results

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutcome]:
        """Verify every item's candidates in one forward pass (batched over sessions)."""
        vocab = self.runtime.vocab_size
        inputs = [item.session.pending() + item.candidates for item in items]
        computed = [len(x) for x in inputs]
        logits = self.runtime.forward([item.session for item in items], inputs)
        gamma = max(len(item.candidates) for item in items)
        batch = len(items)
        target_logits = torch.zeros(batch, gamma + 1, vocab)
        q = torch.zeros(batch, gamma, vocab, dtype=torch.float64)
        candidates = torch.zeros(batch, gamma, dtype=torch.int64)
        for b, (item, rows) in enumerate(zip(items, logits)):
            g = len(item.candidates)
            target_logits[b, : g + 1] = rows[-(g + 1) :]  # p_1..p_{g+1}
            if g:
                candidates[b, :g] = torch.tensor(item.candidates)
                if item.dist_ids is None:
                    q[b, :g] = one_hot(candidates[b, :g], vocab)
                else:
                    for i in range(g):
                        q[b, i] = dense_q(
                            torch.tensor(item.dist_ids[i]),
                            torch.tensor(item.dist_weights[i]),
                            vocab,
                        )
        params = [item.params for item in items]
        p = batched_probs(target_logits, params)  # [B, γ+1, vocab]
        result = verify_block(
            p,
            q,
            candidates,
            torch.tensor([len(item.candidates) for item in items]),
            seed_tensor([item.seed for item in items]),
            torch.tensor([item.base_len for item in items]),
        )
        outcomes = []
        for b, item in enumerate(items):
            n = int(result.num_accepted[b])
            output = result.output_tokens[b, : n + 1].tolist()
            # keep the accepted candidates' KV; the recovered/bonus token has none yet
            item.session.crop(item.base_len + n)
            logprobs = []
            if item.return_logprobs:
                dist = (
                    p[b, : n + 1]
                    if not item.params.greedy
                    else target_logits[b, : n + 1].double().log_softmax(-1).exp()
                )
                logprobs = dist[torch.arange(n + 1), torch.tensor(output)].log().tolist()
            outcomes.append(VerifyOutcome(n, output, logprobs, computed[b]))
        return outcomes
