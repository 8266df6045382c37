"""Pipelined rounds through the whole stack (coordinator --pipeline on): a block drafted
during a verify is used only when it is exactly what a Propose from the committed prefix would
return, so greedy output still equals the target's own and sampled output still follows the
target's distribution — also over the positions that came from blocks drafted ahead."""

from __future__ import annotations

import itertools

import grpc
import pytest
import torch
from scipy.stats import chisquare
from test_generate import hf_greedy
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from specdec.launcher.stack import Stack, StackSettings
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

PROMPTS = ["def add(a, b):", "class Point:\n    def", "import os\n", "for i in range(10):\n"]


def pipelined_stack(model_dirs, *coordinator_args: str, **settings) -> Stack:
    """The tiny pair as real processes with `--pipeline on`."""
    return Stack(
        StackSettings(
            model_dirs["target"],
            model_dirs["draft"],
            port=0,
            log_level="warning",
            coordinator_args=["--pipeline", "on", *coordinator_args],
            **settings,
        )
    )


@pytest.fixture(scope="module")
def stub(model_dirs):
    with pipelined_stack(model_dirs) as running:
        channel = grpc.insecure_channel(running.address)
        yield coordinator_pb2_grpc.CoordinatorStub(channel)
        channel.close()


def request(prompt, gamma, **sampling) -> coordinator_pb2.GenerateRequest:
    sampling.setdefault("ignore_eos", True)
    req = coordinator_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(**sampling)
    )
    if gamma is not None:
        req.speculation.num_speculative_tokens = gamma
    return req


@pytest.mark.parametrize("gamma", [None, 1, 3])
def test_greedy_with_blocks_drafted_ahead_equals_target_generate(stub, hf, gamma):
    used = 0
    for prompt in PROMPTS:
        expected = hf_greedy(hf, prompt, 32)
        response = stub.Generate(request(prompt, gamma, max_new_tokens=32), timeout=60)
        assert list(response.token_ids) == expected, (prompt, gamma)
        used += response.stats.drafted_ahead
    if gamma is not None:  # (the adaptive policy mostly chooses γ = 0 on the tiny pair)
        assert used > 0  # blocks drafted ahead were verified, not only discarded


def hf_joint(hf, prompt: str, n: int, temperature: float, top_k: int) -> dict[tuple, float]:
    """Exact probability of every n-token continuation, with Hugging Face's own warpers."""
    model, tokenizer = hf
    warpers = [TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)]
    joint: dict[tuple, float] = {}

    def walk(ids: list[int], prefix: tuple, mass: float) -> None:
        if len(prefix) == n:
            joint[prefix] = mass
            return
        with torch.no_grad():
            scores = model(torch.tensor([ids])).logits[:, -1].double()
        for warper in warpers:
            scores = warper(torch.tensor([ids]), scores)
        probs = torch.softmax(scores, dim=-1)[0]
        for token in probs.nonzero().flatten().tolist():
            walk(ids + [token], prefix + (token,), mass * float(probs[token]))

    walk(tokenizer.encode(prompt), (), 1.0)
    return joint


def p_value(samples: list[tuple], joint: dict) -> float:
    if any(s not in joint for s in samples):
        return 0.0
    cells = sorted(joint)
    observed = [sum(1 for s in samples if s == c) for c in cells]
    expected = [joint[c] * len(samples) for c in cells]
    return float(chisquare(observed, expected).pvalue)


def four_token_samples(stub, prompt: str, gamma: int) -> tuple[list[tuple], list]:
    """800 seeded 4-token samples at temperature 1, top-k 2, and each one's statistics."""
    samples, stats = [], []
    for seed in range(800):
        response = stub.Generate(
            request(prompt, gamma, temperature=1.0, top_k=2, seed=seed, max_new_tokens=4),
            timeout=30,
        )
        samples.append(tuple(response.token_ids))
        stats.append(response.stats)
    return samples, stats


@pytest.mark.slow
def test_four_tokens_with_blocks_drafted_ahead_follow_the_target_distribution(stub, hf):
    """γ = 1, 4 tokens: round 1 verifies a candidate at position 0 (bonus at 1) while the
    draft guesses position 1 and drafts position 2; when both hold, round 2 verifies that
    block (bonus at 3). The joint of all 4 tokens (16 cells under top-k 2) must be HF's."""
    prompt = "def add(a, b):"
    samples, stats = four_token_samples(stub, prompt, 1)
    used = sum(s.drafted_ahead for s in stats)
    assert used >= 100, used  # enough of the samples went through a block drafted ahead
    assert p_value(samples, hf_joint(hf, prompt, 4, 1.0, 2)) > 1e-3
    # negative control: the same samples against another distribution are rejected
    assert p_value(samples, hf_joint(hf, prompt, 4, 0.5, 2)) < 1e-4
    # and the positions drafted ahead carry information: shuffling them across samples
    # (keeping positions 0-1) must break the joint
    shuffled = [a[:2] + b[2:] for a, b in zip(samples, itertools.islice(samples, 1, None))]
    assert p_value(shuffled, hf_joint(hf, prompt, 4, 1.0, 2)) < 1e-4


@pytest.mark.slow
def test_a_draft_killed_while_blocks_are_drafted_ahead_leaves_the_output_exact(model_dirs, hf):
    """Two drafts, --pipeline on: the session's draft is killed mid-stream (whichever call
    finds it dead first — its own Propose or the block drafted ahead — fails it over). No
    token is lost or repeated and the greedy output is still HF's."""
    import signal

    from specdec.client import Client

    prompt = "def add(a, b):"
    expected = hf_greedy(hf, prompt, 64)
    stack = pipelined_stack(model_dirs, "--draft-timeout-s", "2", draft_workers=2)
    with stack, Client(stack.address, timeout_s=120) as client:
        stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(stack.address))
        tokens, last, killed = [], None, None
        for chunk in client.stream(
            prompt, max_new_tokens=64, ignore_eos=True, num_speculative_tokens=3, session_id="k"
        ):
            assert chunk.offset == len(tokens), "a token was lost or repeated"
            tokens += list(chunk.token_ids)
            last = chunk
            if killed is None and len(tokens) >= 16:
                info = stub.GetSession(coordinator_pb2.GetSessionRequest(session_id="k"))
                killed = info.draft_worker
                index = stack.draft_addresses.index(killed)
                stack.child(f"draft-worker-{index}").signal(signal.SIGKILL)
        info = stub.GetSession(coordinator_pb2.GetSessionRequest(session_id="k"))
    assert killed and tokens == expected
    assert last.stats.draft_failovers >= 1 and last.stats.drafted_ahead > 0
    assert info.draft_worker not in ("", killed)  # moved to the other draft
