"""The target's padded draft block (`target_worker.engine.draft_block`): every item's
candidates and sparse q̃ in place, whatever mix of token-only items, q̃ of different widths
and blocks shorter than the batch's γ it is given."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.core.params import SamplingParams
from target_worker.engine import VerifyItem, draft_block


def item(candidates, dist_ids=None, dist_weights=None) -> VerifyItem:
    return VerifyItem(None, 0, candidates, dist_ids, dist_weights, SamplingParams(), 0, False)


def reference(items, gamma):
    """The block entry by entry: (candidates, count, {(b, i): {token: weight}})."""
    q = {}
    for b, it in enumerate(items):
        for i, c in enumerate(it.candidates):
            if it.dist_ids is None:
                q[b, i] = {c: 1.0}
            else:
                q[b, i] = dict(zip(it.dist_ids[i], map(float, it.dist_weights[i])))
    return [it.candidates for it in items], [len(it.candidates) for it in items], q


def read(block):
    """The same view of a DraftBlock, padding dropped (weight 0 entries are padding)."""
    counts = block.num_candidates.tolist()
    cands = [row[:n] for row, n in zip(block.candidates.tolist(), counts)]
    q = {}
    for b, n in enumerate(counts):
        for i in range(n):
            ids, weights = block.q_ids[b, i].tolist(), block.q_weights[b, i].tolist()
            q[b, i] = {t: w for t, w in zip(ids, weights) if w != 0.0}
    return cands, counts, q


def random_items(rng: random.Random, gamma: int) -> list[VerifyItem]:
    out = []
    for _ in range(rng.randint(1, 6)):
        g = rng.randint(0, gamma)
        cands = [rng.randrange(50_000) for _ in range(g)]
        if rng.random() < 0.3:
            out.append(item(cands))
            continue
        ids, weights = [], []
        for c in cands:
            others = rng.sample(range(50_000), rng.randint(0, 9))
            row = list(dict.fromkeys([c, *others]))
            ids.append(row)
            weights.append([rng.randint(1, 2**20) for _ in row])
        out.append(item(cands, ids, weights))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_block_holds_every_items_candidates_and_weights(seed):
    rng = random.Random(seed)
    gamma = rng.randint(0, 6)
    items = random_items(rng, gamma)
    gamma = max([len(it.candidates) for it in items] + [0])
    block = draft_block(items, gamma, torch.device("cpu"))
    k = max([len(ids) for it in items for ids in (it.dist_ids or [])] + [1])
    assert block.candidates.shape == (len(items), gamma)
    assert block.q_ids.shape == block.q_weights.shape == (len(items), gamma, k)
    assert block.q_ids.dtype == torch.int64 and block.q_weights.dtype == torch.float64
    assert read(block) == reference(items, gamma)


def test_a_shifted_weight_is_caught():
    """Negative control: the comparison sees one weight moved to the next candidate's row."""
    items = [item([5, 6], [[5, 9], [6]], [[3, 1], [2]])]
    block = draft_block(items, 2, torch.device("cpu"))
    assert read(block) == reference(items, 2)
    block.q_weights[0, 1, 1], block.q_ids[0, 1, 1] = 1.0, 9
    block.q_weights[0, 0, 1] = 0.0
    assert read(block) != reference(items, 2)
