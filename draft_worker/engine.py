"""Draft proposers. One module concept: propose γ candidates for many sessions at once.

- ModelProposer: a small causal LM; each draft step is ONE batched forward across sessions
  of different lengths; candidates are sampled from q̃ (or argmax when token-only). A
  session asking for it (`min_confidence`) stops early after a candidate the draft was unsure
  of: the next position is then drawn by the target from p, so the text's law is unchanged.
- NgramProposer: prompt lookup — no model; the continuation of the most recent earlier
  occurrence of the history's last n tokens (token-only, so q̃ is one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core import graphs
from specdec.core.params import SamplingParams
from specdec.core.proposal import encode_sparse, propose_step, sparse_q
from specdec.core.rng import seed_tensor
from specdec.engine.kv import KVSession
from specdec.engine.model import ModelRuntime
from specdec.text.tokenizer import eos_token_ids, load_tokenizer, vocab_fingerprint


@dataclass
class ProposeItem:
    session: KVSession
    base_len: int
    gamma: int
    params: SamplingParams
    seed: int
    token_only: bool
    min_confidence: float = 0.0  # stop after a candidate the draft gave less (0 = never)


@dataclass
class ProposeOutcome:
    candidates: list[int]
    dist_ids: list[list[int]]  # empty when token-only
    dist_weights: list[list[int]]
    token_only: bool
    computed_tokens: int
    pass_longest: int = 0  # the longest delta of the pass's items (its first step's rows)


class ModelProposer:
    kind = "model"

    def __init__(
        self,
        runtime: ModelRuntime,
        wire_top_k: int,
        sampling_graphs: str = "auto",
        sampling_graphs_mb: int = 4096,
    ):
        self.runtime = runtime
        self.wire_top_k = wire_top_k
        # --sampling-graphs, --sampling-graphs-mb
        self.graphs = graphs.for_device(sampling_graphs, runtime.device, sampling_graphs_mb)
        self.vocab_size = runtime.vocab_size
        self.max_context = runtime.max_context
        self.vocab_fingerprint = runtime.vocab_fingerprint
        self.eos_token_ids = runtime.eos_token_ids
        self.model_name = runtime.model_name
        self.device = str(runtime.device)
        self.head_ids = runtime.head_ids  # column -> token id when the head is restricted

    def process(self, items: list[ProposeItem]) -> list[ProposeOutcome]:
        outcomes = [
            ProposeOutcome([], [], [], item.token_only, len(item.session.pending()))
            for item in items
        ]
        inputs = [item.session.pending() for item in items]
        longest = max(map(len, inputs), default=0)
        for outcome in outcomes:
            outcome.pass_longest = longest
        stopped = [False] * len(items)  # the draft was unsure of its last candidate
        for step in range(max(item.gamma for item in items)):
            active = [i for i, item in enumerate(items) if step < item.gamma and not stopped[i]]
            if not active:
                break
            last = self.runtime.forward(
                [items[i].session for i in active], [inputs[i] for i in active], keep=1
            )[:, -1]  # [A, vocab], on the model's device
            proposal = propose_step(
                last,
                [items[i].params for i in active],
                seed_tensor([items[i].seed for i in active], device=last.device),
                torch.tensor([items[i].base_len + step for i in active], device=last.device),
                self.wire_top_k,
                [items[i].token_only for i in active],
                self.graphs,
            )
            if self.head_ids is not None:  # head columns -> token ids (q̃ is unchanged)
                proposal = proposal.over(self.head_ids)
            tokens = proposal.tokens.tolist()
            if proposal.dist_ids is not None:
                dist_ids, dist_weights = proposal.dist_ids.tolist(), proposal.dist_weights.tolist()
            sure = greedy_confidence(last, [items[i] for i in active])
            for row, i in enumerate(active):
                outcomes[i].candidates.append(tokens[row])
                if not items[i].token_only:
                    ids, weights = encode_sparse(dist_ids[row], dist_weights[row])
                    outcomes[i].dist_ids.append(ids)
                    outcomes[i].dist_weights.append(weights)
                    if items[i].min_confidence > 0:
                        confidence = sparse_q(ids, weights).get(tokens[row], 0.0)
                        stopped[i] = confidence < items[i].min_confidence
                elif row in sure:
                    stopped[i] = sure[row] < items[i].min_confidence
                inputs[i] = [tokens[row]]
        return outcomes


def greedy_confidence(logits: torch.Tensor, items: list[ProposeItem]) -> dict[int, float]:
    """row → the draft's softmax probability of its argmax, for the token-only (greedy) rows
    of logits [A, vocab] that stop on low confidence: max p = 1 / Σ exp(l − l_max). Its raw
    logits, as Hugging Face's assistant_confidence_threshold reads a greedy assistant."""
    rows = [r for r, item in enumerate(items) if item.token_only and item.min_confidence > 0]
    if not rows:
        return {}
    picked = logits[rows].float()
    top = picked.max(dim=-1).values
    confidence = torch.exp(top - torch.logsumexp(picked, dim=-1))
    return dict(zip(rows, confidence.tolist()))


class NgramProposer:
    """Prompt-lookup drafting: needs only the tokenizer (for the vocabulary check)."""

    kind = "ngram"

    def __init__(
        self, model_dir: str, max_ngram: int = 4, min_ngram: int = 1, max_context: int = 1 << 20
    ):
        tokenizer = load_tokenizer(model_dir)
        self.vocab_size = len(tokenizer)
        self.max_context = max_context
        self.vocab_fingerprint = vocab_fingerprint(tokenizer)
        self.eos_token_ids = list(eos_token_ids(tokenizer))
        self.model_name = "ngram"
        self.device = "cpu"
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def lookup(self, history: list[int], gamma: int) -> list[int]:
        """Continuation of the most recent earlier match of the longest suffix n-gram."""
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            suffix = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    return history[start + n : start + n + gamma]
        return []

    def process(self, items: list[ProposeItem]) -> list[ProposeOutcome]:
        return [
            ProposeOutcome(self.lookup(item.session.tokens, item.gamma), [], [], True, 0)
            for item in items
        ]
