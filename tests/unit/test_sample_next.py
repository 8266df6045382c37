"""`sample_next` (the hot path's recovered/bonus draw without a dense row) against the dense
draw it replaces, uniform by uniform: peaked rows (sampled from the top window alone) and
flat rows (located by chunk masses, then sampled exactly inside one chunk); and a row that a
verify processed in a narrower window than its neighbours, drawn from its whole kept set."""

import pytest
import torch

from specdec.core import few_rows as few_rows_mod
from specdec.core.next_token import draw_next, sample_next
from specdec.core.params import SamplingParams
from specdec.core.processed import Processed, ProcessorParams, process
from specdec.core.rng import seed_tensor
from specdec.core.verify import DraftBlock, verify_logits

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


def mixed_window_rounds(rounds: int = 200) -> list[int]:
    """Bonus tokens of a session whose rows were processed in windows of two widths: beside a
    top-k 100 session (a window of 101) at its first position, alone (64) at its second. Its
    bonus row is flat under top-p 0.9 (every token tied, all kept): the bonus is uniform over
    the vocabulary, not confined to the 64 tokens of its window."""
    vocab = 8192
    peaked = torch.zeros(vocab)
    peaked[7] = 50.0  # the second session's candidate, accepted with p ≈ 1
    logits = torch.stack(
        [
            torch.stack([torch.arange(vocab, dtype=torch.float32) / vocab, torch.zeros(vocab)]),
            torch.stack([peaked, torch.zeros(vocab)]),
        ]
    )
    params = ProcessorParams.of(
        [SamplingParams(temperature=1.0, top_k=100), SamplingParams(temperature=1.0, top_p=0.9)]
    )
    candidates = torch.tensor([[0], [7]])  # the first: outside its top-k, rejected
    block = DraftBlock(
        candidates,
        torch.tensor([1, 1]),
        candidates[..., None],
        torch.ones(2, 1, 1, dtype=torch.float64),
    )
    tokens = []
    for seed in range(rounds):
        result = verify_logits(
            logits,
            torch.tensor([False, False]),
            params,
            block,
            seed_tensor([seed, seed]),
            torch.tensor([0, 0]),
        )
        assert result.num_accepted.tolist() == [0, 1]
        tokens.append(int(result.output_tokens[1, 1]))
    return tokens


@pytest.mark.parametrize("few", [few_rows_mod.FEW_ROWS, 0])
def test_a_row_from_a_narrower_window_is_drawn_from_its_whole_kept_set(monkeypatch, few):
    monkeypatch.setattr(few_rows_mod, "FEW_ROWS", few)
    assert len(set(mixed_window_rounds())) > 150  # uniform over 8192: ~197 distinct of 200


def test_negative_control_the_gathered_window_edge_confines_the_draw(monkeypatch):
    """Reading a gathered row's edge from the widest window's last column (−inf padding: 'all
    kept inside the window') confines the draw to the row's 64 window tokens."""
    monkeypatch.setattr(Processed, "window_edge", lambda self: self.top_z[:, -1])
    assert len(set(mixed_window_rounds())) <= 64
