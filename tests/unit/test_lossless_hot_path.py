"""Lossless through the hot path: the draft's `propose_step` with a sparse q̃ of K < vocab
tokens, the target's `verify_logits` from float32 logits, γ = 2 so that the bonus token of a
fully accepted round is the third token — inside the tested joint distribution of the first
three tokens. A bonus drawn from the wrong row must fail the same test (negative control)."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_lossless import (
    P_FAIL,
    P_PASS,
    TABLE_ROWS,
    TableModel,
    append_round,
    chi_square_pvalue,
)

from specdec.core.params import SamplingParams
from specdec.core.processed import ProcessorParams
from specdec.core.proposal import propose_step
from specdec.core.rng import seed_tensor
from specdec.core.sampling import probs_from_logits
from specdec.core.verify import DraftBlock, verify_logits

VOCAB = 6
K = 3  # q̃ covers half the vocabulary: tokens outside it are only ever recovered/bonus
LENGTH = 3
GAMMA = 2
TRIALS = 20_000


class Table(TableModel):
    """The tests' table 'language model' over 6 tokens, float32 as a model emits logits."""

    def __init__(self, generator: torch.Generator, base: torch.Tensor | None = None, noise=1.0):
        table = torch.randn(TABLE_ROWS, VOCAB, generator=generator) * 1.5
        self.table = table if base is None else base + noise * table


@pytest.fixture(scope="module")
def pair():
    generator = torch.Generator().manual_seed(77)
    target = Table(generator)
    return Table(generator, base=target.table, noise=0.8), target


def exact_joint(target: Table, params: SamplingParams) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        code, prob = torch.zeros(1, dtype=torch.int64), 1.0
        for token in seq:
            prob *= float(probs_from_logits(target.logits(code).double(), params)[0, token])
            code = Table.extend(code, torch.tensor([token]))
        joint[seq] = prob
    return joint


def run_rounds(draft, target, params, seed, wrong_bonus=False) -> torch.Tensor:
    seeds = seed_tensor(range(seed, seed + TRIALS))
    out = torch.full((TRIALS, LENGTH + GAMMA + 1), -1, dtype=torch.int64)
    length = torch.zeros(TRIALS, dtype=torch.int64)
    code = torch.zeros(TRIALS, dtype=torch.int64)
    rounds_with_bonus = 0
    while bool((length < LENGTH).any()):
        active = (length < LENGTH).nonzero().squeeze(1)
        n = len(active)
        codes = [code[active]]
        candidates = torch.zeros(n, GAMMA, dtype=torch.int64)
        ids = torch.zeros(n, GAMMA, K, dtype=torch.int64)
        weights = torch.zeros(n, GAMMA, K, dtype=torch.float64)
        for i in range(GAMMA):
            step = propose_step(
                draft.logits(codes[i]),
                [params] * n,
                seeds[active],
                length[active] + i,
                K,
                [False] * n,
            )
            candidates[:, i], ids[:, i], weights[:, i] = (
                step.tokens,
                step.dist_ids,
                step.dist_weights,
            )
            codes.append(Table.extend(codes[i], step.tokens))
        logits = torch.stack([target.logits(c) for c in codes], dim=1)  # [n, γ+1, vocab]
        if wrong_bonus:  # negative control: the bonus from p_γ instead of p_{γ+1}
            logits[:, GAMMA] = logits[:, GAMMA - 1]
        result = verify_logits(
            logits,
            torch.zeros(n, dtype=torch.bool),
            ProcessorParams.of([params] * n),
            DraftBlock(candidates, torch.full((n,), GAMMA), ids, weights),
            seeds[active],
            length[active],
        )
        rounds_with_bonus += int((result.num_accepted == GAMMA).sum())
        append_round(out, length, code, active, result)
    assert rounds_with_bonus > TRIALS // 10  # the bonus path is well exercised
    return out[:, :LENGTH]


PARAMS = {
    "raw": SamplingParams(temperature=1.0),
    "top_p": SamplingParams(temperature=0.9, top_p=0.85),
    "top_k_min_p": SamplingParams(temperature=1.2, top_k=4, min_p=0.1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARAMS))
def test_hot_path_joint_distribution_matches_target(pair, name):
    draft, target = pair
    samples = run_rounds(draft, target, PARAMS[name], seed=5_000)
    assert chi_square_pvalue(samples, exact_joint(target, PARAMS[name])) > P_PASS


@pytest.mark.slow
@pytest.mark.parametrize("name", ["raw", "top_p"])
def test_negative_control_wrong_bonus_row_is_rejected(pair, name):
    draft, target = pair
    samples = run_rounds(draft, target, PARAMS[name], seed=5_000, wrong_bonus=True)
    assert chi_square_pvalue(samples, exact_joint(target, PARAMS[name])) < P_FAIL
