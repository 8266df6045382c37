"""`sample_next` (the hot path's recovered/bonus draw without a dense row) against the dense
draw it replaces, uniform by uniform: peaked rows (sampled from the top window alone) and
flat rows (located by chunk masses, then sampled exactly inside one chunk)."""

import pytest
import torch

from specdec.core.next_token import draw_next, sample_next
from specdec.core.params import SamplingParams
from specdec.core.processed import ProcessorParams, process

VOCAB, K, DRAWS = 5000, 16, 200


def rows_of(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, VOCAB, generator=gen) * (2.0 if kind == "peaked" else 0.3)
    if kind == "peaked":
        top = torch.randint(0, VOCAB, (n, 6), generator=gen)
        x = x.scatter_add(1, top, 9.0 + 4.0 * torch.rand(n, 6, generator=gen))
    return x


@pytest.mark.parametrize("kind", ["peaked", "flat"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sample_next_draws_what_the_dense_draw_draws(kind, top_p):
    n = 6
    params = [SamplingParams(temperature=0.8, top_p=top_p)] * n
    logits = rows_of(kind, n, seed=1)
    processed = process(logits, ProcessorParams.of(params))
    rows = torch.arange(n)
    gen = torch.Generator().manual_seed(2)
    # q̃ over K tokens: half of them among the likeliest (so the residual differs from p)
    likely = processed.top_ids[:, : K // 2]
    q_ids = torch.cat([likely, torch.randint(0, VOCAB, (n, K // 2), generator=gen)], dim=1)
    q_weights = torch.randint(1, 65535, (n, K), generator=gen).double()
    dense_p = processed.dense(rows)
    dense_q = torch.zeros(n, VOCAB, dtype=torch.float64).scatter_add_(1, q_ids, q_weights)
    dense_q /= dense_q.sum(dim=-1, keepdim=True)
    rejected = torch.tensor([True, False] * (n // 2))
    mismatches = 0
    for _ in range(DRAWS):
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        got = sample_next(processed, rows, q_ids, q_weights, rejected, u)
        expected = draw_next(dense_p, dense_q, rejected, u)
        mismatches += int((got != expected).sum())
    assert mismatches == 0
    if kind == "peaked" and top_p < 1:
        assert bool((processed.top_z[:, -1] < processed.tau).all())  # the window path ran
    if kind == "flat":
        assert not bool((processed.top_z[:, -1] < processed.tau).any())  # the chunk path ran


def test_negative_control_a_wrong_q_is_detected():
    """The same comparison catches a draw from the residual of another q̃."""
    n = 4
    params = [SamplingParams(temperature=1.0)] * n
    processed = process(rows_of("flat", n, seed=3), ProcessorParams.of(params))
    rows = torch.arange(n)
    gen = torch.Generator().manual_seed(4)
    q_ids = processed.top_ids[:, :K]
    q_weights = torch.full((n, K), 1000.0, dtype=torch.float64)
    dense_p = processed.dense(rows)
    other = torch.zeros(n, VOCAB, dtype=torch.float64)
    other.scatter_add_(1, processed.top_ids[:, K : 2 * K], q_weights)  # different tokens
    other /= other.sum(dim=-1, keepdim=True)
    rejected = torch.ones(n, dtype=torch.bool)
    mismatches = 0
    for _ in range(DRAWS):
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        got = sample_next(processed, rows, q_ids, q_weights, rejected, u)
        mismatches += int((got != draw_next(dense_p, other, rejected, u)).sum())
    assert mismatches > 0
