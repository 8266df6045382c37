"""Exact properties of the processors, q̃ codec, counter-based randomness and batched verify."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.core.params import SamplingParams
from specdec.core.proposal import (
    WIRE_WEIGHT_MAX,
    dense_q,
    encode_sparse,
    propose_step,
    quantise,
)
from specdec.core.rng import Stream, seed_tensor, uniform, uniform_scalar
from specdec.core.sampling import apply_processors, probs_from_logits, sample_inverse_cdf
from specdec.core.verify import verify_block
from specdec.serving.wire import validate_sparse


def test_uniform_is_a_pure_function_of_seed_position_stream():
    seeds = seed_tensor([1, 2**64 - 1, 42])
    positions = torch.tensor([0, 5, 1_000_000])
    batched = uniform(seeds, positions, Stream.ACCEPT)
    singles = [
        uniform_scalar(s, p, Stream.ACCEPT) for s, p in [(1, 0), (2**64 - 1, 5), (42, 1_000_000)]
    ]
    assert batched.tolist() == singles
    assert not torch.equal(batched, uniform(seeds, positions, Stream.RESIDUAL))
    assert not torch.equal(batched, uniform(seeds, positions + 1, Stream.ACCEPT))


def test_the_python_int_path_draws_the_tensor_path_s_bits():
    """Few draws are computed on Python ints: the same 53 bits as the vectorised path, for
    seeds across the whole uint64 range, broadcast shapes and every stream."""
    from specdec.core import rng

    gen = torch.Generator().manual_seed(9)
    seeds = seed_tensor(
        [0, 1, 2**63 - 1, 2**63, 2**64 - 1] + torch.randint(0, 2**62, (11,), generator=gen).tolist()
    )
    positions = torch.randint(0, 2**40, (16,), generator=gen)
    for stream in Stream:
        small = uniform(seeds, positions, stream)
        assert torch.equal(small, rng._uniform_tensor(seeds, positions, stream))
        grid = uniform(seeds[:4, None], positions[None, :8], stream)  # [4, 8], broadcast
        assert grid.shape == (4, 8)
        assert torch.equal(grid, rng._uniform_tensor(seeds[:4, None], positions[None, :8], stream))
    # negative control: another stream's bits differ
    assert not torch.equal(
        uniform(seeds, positions, Stream.DRAFT),
        rng._uniform_tensor(seeds, positions, Stream.ACCEPT),
    )


def test_uniform_is_uniform():
    u = uniform(seed_tensor([7]), torch.arange(200_000), Stream.DRAFT)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u.float(), bins=20, min=0.0, max=1.0)
    assert chisquare(counts.tolist()).pvalue > 1e-3
    # negative control: a biased generator fails the same test
    assert (
        chisquare(torch.histc((u**1.05).float(), bins=20, min=0.0, max=1.0).tolist()).pvalue < 1e-6
    )


def test_processors_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda params: (apply_processors(logits, params) > float("-inf")).int().tolist()[0]  # noqa: E731
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [1, 1, 0, 0]
    assert kept(SamplingParams(temperature=1.0, top_p=0.7)) == [1, 1, 0, 0]
    assert kept(SamplingParams(temperature=1.0, top_p=0.76)) == [1, 1, 1, 0]
    assert kept(SamplingParams(temperature=1.0, min_p=0.3)) == [1, 1, 1, 0]
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]], dtype=torch.float64))
    greedy = probs_from_logits(torch.tensor([[1.0, 3.0, 3.0]]), SamplingParams())
    assert greedy.tolist() == [[0.0, 1.0, 0.0]]  # ties: lowest id


def test_params_validation_names_the_field():
    with pytest.raises(ValueError, match="sampling.top_p"):
        SamplingParams(temperature=1.0, top_p=1.5).validate()
    with pytest.raises(ValueError, match="sampling.temperature"):
        SamplingParams(temperature=-1.0).validate()


def test_quantise_and_dense_q_are_exact_and_sparse():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)
    ids, weights = quantise(probs, 3)
    assert ids.tolist() == [[0, 1, 2]] and weights[0, 0] == WIRE_WEIGHT_MAX
    wire_ids, wire_weights = encode_sparse(ids[0], weights[0])
    q = dense_q(torch.tensor(wire_ids), torch.tensor(wire_weights), 4)
    assert float(q.sum()) == pytest.approx(1.0, abs=1e-15)
    assert q.tolist() == (
        torch.tensor(wire_weights, dtype=torch.float64) / sum(wire_weights)
    ).tolist() + [0.0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        validate_sparse([0, 9], [1, 1], 4, "draft_dists[0]")
    with pytest.raises(ValueError, match="repeat"):
        validate_sparse([1, 1], [1, 1], 4, "draft_dists[0]")


def test_draft_samples_exactly_from_the_wire_q():
    """The candidate follows q̃ (the quantised top-K), not the draft's full q."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])).repeat(40_000, 1)
    params = [SamplingParams(temperature=1.0)] * len(logits)
    seeds = seed_tensor(range(len(logits)))
    step = propose_step(
        logits, params, seeds, torch.zeros(len(logits), dtype=torch.int64), 3, [False] * len(logits)
    )
    q = dense_q(step.dist_ids[0], step.dist_weights[0], 5)
    counts = torch.bincount(step.tokens, minlength=5)
    # outside the top-3 is never sampled (sampling from the full q would produce ids 3 and 4)
    assert counts[3] == 0 and counts[4] == 0
    expected = q[:3] / q[:3].sum() * int(counts.sum())
    assert chisquare(counts[:3].double().numpy(), expected.numpy()).pvalue > 1e-3
    skewed = torch.tensor([0.42, 0.33, 0.25], dtype=torch.float64) * int(counts.sum())
    assert chisquare(counts[:3].double().numpy(), skewed.numpy()).pvalue < 1e-6  # negative control


def test_inverse_cdf_never_picks_zero_weight():
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]]).repeat(3, 1)
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    assert sample_inverse_cdf(weights, u).tolist() == [1, 3, 3]


def test_batched_verify_equals_one_at_a_time():
    gen = torch.Generator().manual_seed(3)
    batch, gamma, vocab = 16, 4, 11
    p = torch.softmax(torch.randn(batch, gamma + 1, vocab, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(batch, gamma, vocab, generator=gen, dtype=torch.float64), -1)
    candidates = torch.randint(0, vocab, (batch, gamma), generator=gen)
    num = torch.randint(0, gamma + 1, (batch,), generator=gen)
    seeds, base = seed_tensor(range(batch)), torch.randint(0, 100, (batch,), generator=gen)
    together = verify_block(p, q, candidates, num, seeds, base)
    for b in range(batch):
        g = int(num[b])
        alone = verify_block(
            p[b : b + 1, : g + 1],
            q[b : b + 1, :g],
            candidates[b : b + 1, :g],
            num[b : b + 1],
            seeds[b : b + 1],
            base[b : b + 1],
        )
        n = int(alone.num_accepted[0])
        assert n == int(together.num_accepted[b]) and n <= g
        assert (
            alone.output_tokens[0, : n + 1].tolist() == together.output_tokens[b, : n + 1].tolist()
        )
