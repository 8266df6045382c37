"""The draft stops a block early after a candidate it was unsure of (`min_confidence`,
coordinator --draft-confidence): the candidates it does propose are exactly those of a full
block (same q̃, same counter-based draws), it stops right after the first one whose own
probability is below the threshold, and the probability it reads is the draft's — checked
against a softmax computed here from the model's logits, not against the engine's helper."""

from __future__ import annotations

import pytest
import torch

from draft_worker.engine import ModelProposer, ProposeItem
from specdec.core.params import SamplingParams
from specdec.core.proposal import sparse_q
from specdec.engine.kv import KVSession
from specdec.engine.model import ModelRuntime, RuntimeSettings

GAMMA = 6
PROMPTS = ["def add(a, b):\n    return", "import os\n", "class Point:\n    def", "x = [1, 2"]
SAMPLING = SamplingParams(temperature=1.0, top_k=4)


@pytest.fixture(scope="module")
def runtime(model_dirs):
    return ModelRuntime(RuntimeSettings(model_dirs["draft"], device="cpu"))


def propose(runtime, history, params, min_confidence=0.0, seed=5):
    session = KVSession("s")
    session.sync(history)
    item = ProposeItem(
        session, len(history), GAMMA, params, seed, params.greedy, min_confidence=min_confidence
    )
    return ModelProposer(runtime, wire_top_k=8).process([item])[0]


def greedy_probabilities(runtime, history, candidates) -> list[float]:
    """The draft's own softmax (float64) at the argmax of each step, from full forwards."""
    out = []
    for i in range(len(candidates)):
        session = KVSession("ref")
        session.sync(history + candidates[:i])
        logits = runtime.forward([session], [session.pending()], keep=1)[0, -1].double()
        out.append(float(torch.softmax(logits, dim=-1).max()))
    return out


def expected_stop(confidences: list[float], threshold: float) -> int:
    """Candidates a block keeps: up to and including the first below the threshold."""
    for i, c in enumerate(confidences):
        if c < threshold:
            return i + 1
    return len(confidences)


@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.9])
def test_greedy_blocks_stop_after_the_first_unsure_candidate(runtime, threshold):
    stops = []
    for prompt in PROMPTS:
        history = runtime.tokenizer.encode(prompt)
        full = propose(runtime, history, SamplingParams())
        confidences = greedy_probabilities(runtime, history, full.candidates)
        short = propose(runtime, history, SamplingParams(), threshold)
        n = expected_stop(confidences, threshold)
        assert short.candidates == full.candidates[:n], (prompt, confidences)
        stops.append(n)
    if threshold == 0.9:  # the tiny draft is unsure: the threshold did cut blocks short
        assert min(stops) < GAMMA


def test_sampled_blocks_stop_on_the_candidates_own_q(runtime):
    cut = 0
    for seed in range(12):
        history = runtime.tokenizer.encode(PROMPTS[seed % len(PROMPTS)])
        full = propose(runtime, history, SAMPLING, seed=seed)
        q = [
            sparse_q(ids, weights)[token]
            for token, ids, weights in zip(full.candidates, full.dist_ids, full.dist_weights)
        ]
        short = propose(runtime, history, SAMPLING, 0.6, seed=seed)
        n = expected_stop(q, 0.6)
        assert short.candidates == full.candidates[:n]
        assert short.dist_ids == full.dist_ids[:n] and short.dist_weights == full.dist_weights[:n]
        cut += n < GAMMA
    assert cut >= 3  # enough blocks were actually cut to make the comparison mean something


def test_a_stopped_session_does_not_stop_the_others_in_its_batch(runtime):
    """Two sessions in one draft pass, one asking for an early stop: the other gets its γ."""
    histories = [runtime.tokenizer.encode(p) for p in PROMPTS[:2]]
    alone = [propose(runtime, h, SamplingParams()).candidates for h in histories]
    items = []
    for i, h in enumerate(histories):
        session = KVSession(f"s{i}")
        session.sync(h)
        items.append(ProposeItem(session, len(h), GAMMA, SamplingParams(), 0, True, 0.99 * i))
    together = ModelProposer(runtime, wire_top_k=8).process(items)
    assert together[0].candidates == alone[0]
    assert len(together[1].candidates) < GAMMA  # negative control: the other one did stop
    assert together[1].candidates == alone[1][: len(together[1].candidates)]


def test_a_pass_reports_its_longest_delta_to_every_session_in_it(runtime):
    """A new prompt and a session one token past its last pass in one draft pass: the pass's
    first step computes both rows at the prompt's length, and both outcomes say so (the
    coordinator leaves such passes out of its draft step estimate); each keeps its own
    `computed_tokens`. Negative control: the running session alone reports its own delta."""
    prompt = runtime.tokenizer.encode(PROMPTS[2])
    proposer = ModelProposer(runtime, wire_top_k=8)

    def running(name):  # its KV holds the prompt already: one new token to feed
        session = KVSession(name)
        session.sync(prompt)
        proposer.process([ProposeItem(session, len(prompt), 1, SamplingParams(), 0, True)])
        session.sync(prompt + [prompt[0]])
        return ProposeItem(session, len(prompt) + 1, 2, SamplingParams(), 0, True)

    new = KVSession("new")
    new.sync(prompt)
    together = proposer.process(
        [running("a"), ProposeItem(new, len(prompt), 2, SamplingParams(), 0, True)]
    )
    assert [o.computed_tokens for o in together] == [1, len(prompt)]
    assert [o.pass_longest for o in together] == [len(prompt), len(prompt)]
    (alone,) = proposer.process([running("b")])
    assert alone.computed_tokens == alone.pass_longest == 1
