"""Blocks the draft cuts short (coordinator --draft-confidence) through the whole stack, with
blocks drafted ahead (--pipeline on): whether position i is drafted depends only on the
draft's own prefix, so greedy output is still the target's and sampled output still follows
the target's distribution, Hugging Face's warpers as the reference."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from test_generate import hf_greedy
from test_pipelined import (
    PROMPTS,
    four_token_samples,
    hf_joint,
    p_value,
    pipelined_stack,
    request,
)

from specdec.serving.redis_embedded import free_port
from specdec.v1 import coordinator_pb2_grpc

THRESHOLD = "0.75"


@pytest.fixture(scope="module")
def stub(model_dirs):
    with pipelined_stack(model_dirs, "--draft-confidence", THRESHOLD) as running:
        channel = grpc.insecure_channel(running.address)
        yield coordinator_pb2_grpc.CoordinatorStub(channel)
        channel.close()


@pytest.mark.parametrize("gamma", [None, 2, 5])
def test_greedy_with_blocks_cut_short_equals_target_generate(stub, hf, gamma):
    asked = drafted = 0
    for prompt in PROMPTS:
        response = stub.Generate(request(prompt, gamma, max_new_tokens=32), timeout=60)
        assert list(response.token_ids) == hf_greedy(hf, prompt, 32), (prompt, gamma)
        asked += response.stats.drafts * (gamma or 0)
        drafted += response.stats.draft_tokens
    if gamma == 5:  # the tiny draft is rarely 75 % sure: blocks were cut short
        assert drafted < asked / 2, (drafted, asked)


@pytest.mark.slow
def test_four_tokens_from_blocks_cut_short_follow_the_target_distribution(stub, hf):
    """γ = 3, 4 tokens at temperature 1, top-k 2: without a cut the first round always
    drafts 3 candidates, so a session that drafted fewer than 3 in all proves a cut. The
    joint of the 4 tokens (16 cells) must be HF's."""
    prompt = "def add(a, b):"
    samples, stats = four_token_samples(stub, prompt, 3)
    cut = sum(s.draft_tokens < 3 for s in stats)
    assert cut >= 100, cut  # enough samples went through blocks cut short
    assert p_value(samples, hf_joint(hf, prompt, 4, 1.0, 2)) > 1e-3
    # negative control: the same samples against another distribution are rejected
    assert p_value(samples, hf_joint(hf, prompt, 4, 0.5, 2)) < 1e-4


@pytest.mark.parametrize("value", ["1.0", "-0.1", "nan"])
def test_the_coordinator_refuses_a_threshold_outside_0_1(model_dirs, value):
    """A real coordinator process: --draft-confidence outside [0, 1) stops it at the start
    (exit 2, the flag named), before it binds a port or touches Redis; 0.5 passes it."""
    argv = [sys.executable, "-m", "coordinator", "--tokenizer", model_dirs["target"]]
    argv += ["--port", str(free_port()), "--redis-url", "redis://127.0.0.1:1/0"]
    bad = subprocess.run([*argv, "--draft-confidence", value], capture_output=True, text=True)
    assert bad.returncode == 2, bad.stderr
    assert "--draft-confidence must be in [0, 1)" in bad.stderr
    # negative control: an accepted threshold gets past the check, to the next one
    ok = subprocess.run(
        [*argv, "--draft-confidence", "0.5", "--max-starting", "0"], capture_output=True, text=True
    )
    assert ok.returncode == 2 and "--max-starting must be at least 1" in ok.stderr, ok.stderr
    assert "--draft-confidence" not in ok.stderr.splitlines()[-1]
