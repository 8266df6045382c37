"""The small-batch path (a few rows on a CPU: `FEW_ROWS`) gives exactly what the torch path
gives: the same τ, log Z and top window bit for bit, the same draft candidates and q̃
weights, accepted counts and output tokens, on a stress set of random rows (11k processed
rows, 4k draft rows, 420 verify rounds over 8k rows of target logits) — temperatures 0.3 to
1.7, top-k at and around the window width and past it, nuclei inside the window and past
it, min-p, ties at the cut, peaked and flat rows, vocabularies of 8k and 49k, γ = 0..6,
candidates accepted and rejected. Negative controls show that the comparison catches a
slightly different top-p, a window one ulp off and a slightly different acceptance test.
With the compiled sampling kernel both paths take its `window` for the cuts of rows of more
than `WIDE` values (tests/unit/test_sampling_kernel.py compares it with the torch path's)."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.core import few_rows as few_rows_mod
from specdec.core import processed as processed_mod
from specdec.core import row_kernel
from specdec.core import verify as verify_mod
from specdec.core.params import SamplingParams
from specdec.core.processed import Processed, ProcessorParams, process
from specdec.core.proposal import propose_step
from specdec.core.rng import seed_tensor
from specdec.core.sampling import inverse_cdf_index, sample_inverse_cdf
from specdec.core.verify import DraftBlock, verify_logits

VOCABS = (8192, 8192, 49152)
KINDS = ("peaked", "peaked", "flat", "ties", "plateau")
TEMPERATURES = (0.3, 0.8, 1.0, 1.7)
TOP_K = (0, 0, 0, 1, 5, 63, 64, 65, 100)  # the window: 64 values, k + 1 when k ≥ 64
TOP_P = (1.0, 1.0, 0.5, 0.9, 0.95, 0.999)  # 0.999 on a flat row: a nucleus past the window
MIN_P = (0.0, 0.0, 0.05, 0.2)
FAST, TORCH = 10**9, 0  # FEW_ROWS forcing each path
PROCESS_CALLS, DRAFT_CALLS, VERIFY_CALLS = 2500, 900, 420  # > 20,000 rows in all


def stress_logits(gen: torch.Generator, rows: int, vocab: int, kind: str) -> torch.Tensor:
    """Logits [rows, vocab] of one kind: peaked (a few strong tokens over a Gaussian tail),
    flat (nuclei of thousands), ties (values on a 0.5 grid: equal logits at every cut) or
    plateau (100 equal largest logits: ties at top-k 64 and at the window's edge)."""
    x = torch.randn(rows, vocab, generator=gen) * (0.3 if kind == "flat" else 2.0)
    if kind in ("peaked", "ties"):
        top = torch.randint(0, vocab, (rows, 8), generator=gen)
        x = x.scatter_add(1, top, 6.0 + 10.0 * torch.rand(rows, 8, generator=gen))
    if kind == "ties":
        x = (x * 2).round() / 2
    if kind == "plateau":
        x[:, torch.randperm(vocab, generator=gen)[:100]] = 8.0
    return x


def stress_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice(TEMPERATURES),
        top_k=rng.choice(TOP_K),
        top_p=rng.choice(TOP_P),
        min_p=rng.choice(MIN_P),
    )


@pytest.fixture(autouse=True, params=["compiled", "torch"])
def sampling_kernel(request, monkeypatch):
    """Each comparison with the compiled sampling kernel (`specdec.core.row_kernel`: rows past
    the window, on both paths) and with torch's ops alone (a machine without a compiler)."""
    module = None
    if request.param == "compiled":
        module = row_kernel.EXTENSION.get()
        assert not isinstance(module, str), module
    monkeypatch.setattr(row_kernel, "_chosen", [module])


def on_both_paths(monkeypatch, fn, *args):
    """(fn(*args) on the small-batch path, fn(*args) on the torch path)."""
    results = []
    for few in (FAST, TORCH):
        monkeypatch.setattr(few_rows_mod, "FEW_ROWS", few)
        results.append(fn(*args))
    return results


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int64)


def differing_rows(a: Processed, b: Processed) -> int:
    """Rows whose τ, log Z or top window differ in any bit (NaN: log Z not computed)."""
    same = (bits(a.tau) == bits(b.tau)) & (bits(a.log_z) == bits(b.log_z))
    same &= (bits(a.top_z) == bits(b.top_z)).all(dim=1) & (a.top_ids == b.top_ids).all(dim=1)
    return int((~same).sum())


def compare_process(monkeypatch, calls: int, seed: int) -> tuple[int, int]:
    """(rows, rows that differ) of `process` over random batches of 1–8 rows."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = differ = 0
    for call in range(calls):
        count = rng.randint(1, 8)
        logits = stress_logits(gen, count, VOCABS[call % 3], rng.choice(KINDS))
        pp = ProcessorParams.of([stress_params(rng) for _ in range(count)])
        window_only = rng.random() < 0.3
        fast, reference = on_both_paths(monkeypatch, process, logits, pp, 64, window_only)
        rows, differ = rows + count, differ + differing_rows(fast, reference)
    return rows, differ


def test_processed_rows_are_the_torch_paths(monkeypatch):
    rows, differ = compare_process(monkeypatch, PROCESS_CALLS, seed=1)
    assert rows >= 11_000 and differ == 0


def draft_round(rng: random.Random, gen: torch.Generator, call: int) -> tuple:
    """The arguments of `propose_step` for 1–8 rows, token-only rows mixed in."""
    batch = rng.randint(1, 8)
    logits = stress_logits(gen, batch, VOCABS[call % 3], rng.choice(KINDS))
    params = [stress_params(rng) for _ in range(batch)]
    token_only = [rng.random() < 0.15 for _ in range(batch)]
    seeds = seed_tensor([rng.getrandbits(64) for _ in range(batch)])
    positions = torch.tensor([rng.randrange(4096) for _ in range(batch)])
    k = rng.choice((1, 8, 32, 32, 64, 100))
    return logits, params, seeds, positions, k, token_only


def differing_proposals(got, reference, token_only: list[bool]) -> int:
    """Rows whose candidate, q̃ ids or integer weights differ (all token-only: the call)."""
    if all(token_only):
        return int(not torch.equal(got.tokens, reference.tokens))
    same = (got.tokens == reference.tokens) & (got.dist_ids == reference.dist_ids).all(1)
    return int((~(same & (got.dist_weights == reference.dist_weights).all(1))).sum())


def test_draft_steps_are_the_torch_paths(monkeypatch):
    """Candidates, q̃ ids and integer weights of `propose_step`, token-only rows mixed in."""
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    rows = differ = 0
    for call in range(DRAFT_CALLS):
        args = draft_round(rng, gen, call)
        fast, reference = on_both_paths(monkeypatch, propose_step, *args)
        rows += args[0].shape[0]
        differ += differing_proposals(fast, reference, args[-1])
    assert rows >= 3_500 and differ == 0


def verify_round(rng: random.Random, gen: torch.Generator, call: int):
    """The arguments of `verify_logits` for 1–8 sessions (some greedy) with γ = call % 7:
    candidates and sparse q̃ drawn by the draft from the target's logits plus noise, so
    that rounds both accept and reject."""
    batch, gamma = rng.randint(1, 8), call % 7
    vocab, kind = VOCABS[call % 3], rng.choice(KINDS)
    target = stress_logits(gen, batch * (gamma + 1), vocab, kind).reshape(batch, gamma + 1, -1)
    draft = target + rng.choice((0.0, 0.3, 1.0)) * torch.randn(target.shape, generator=gen)
    params = [stress_params(rng) if rng.random() < 0.85 else SamplingParams() for _ in range(batch)]
    token_only = [p.greedy or rng.random() < 0.15 for p in params]
    seeds = seed_tensor([rng.getrandbits(64) for _ in range(batch)])
    base = torch.tensor([rng.randrange(4096) for _ in range(batch)])
    k = rng.choice((1, 8, 32, 64))
    candidates = torch.zeros(batch, gamma, dtype=torch.int64)
    q_ids = torch.zeros(batch, gamma, k, dtype=torch.int64)
    q_weights = torch.zeros(batch, gamma, k, dtype=torch.float64)
    for i in range(gamma):
        step = propose_step(draft[:, i], params, seeds, base + i, k, token_only)
        candidates[:, i] = step.tokens
        if step.dist_ids is not None:
            q_ids[:, i], q_weights[:, i] = step.dist_ids, step.dist_weights.double()
    alone = torch.tensor(token_only)  # a token-only draft's q̃ is its candidate alone
    q_weights[alone] = 0.0
    q_ids[alone, :, 0], q_weights[alone, :, 0] = candidates[alone], 1.0
    num = torch.tensor([rng.randint(0, gamma) if rng.random() < 0.2 else gamma for _ in params])
    greedy = torch.tensor([p.greedy for p in params])
    sampling = ProcessorParams.of([p for p in params if not p.greedy])
    return target, greedy, sampling, DraftBlock(candidates, num, q_ids, q_weights), seeds, base


def compare_verify(monkeypatch, calls: int, seed: int) -> tuple[int, int, int, int]:
    """(rows of target logits, sessions and processed rows that differ, candidates
    accepted, sessions that rejected one) of `verify_logits` over random rounds."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = differ = accepted = rejected = 0
    for call in range(calls):
        args = verify_round(rng, gen, call)
        fast, reference = on_both_paths(monkeypatch, verify_logits, *args)
        same = (fast.num_accepted == reference.num_accepted) & (
            fast.output_tokens == reference.output_tokens
        ).all(1)
        differ += int((~same).sum())
        if reference.processed is not None:
            differ += differing_rows(fast.processed, reference.processed)
        rows += args[0].shape[0] * args[0].shape[1]
        accepted += int(reference.num_accepted.sum())
        rejected += int((reference.num_accepted < args[3].num_candidates).sum())
    return rows, differ, accepted, rejected


def test_verify_rounds_are_the_torch_paths(monkeypatch):
    """Accepted counts, output tokens and the processed rows (τ, log Z, window) of
    `verify_logits`, greedy and sampling sessions mixed, γ = 0..6."""
    rows, differ, accepted, rejected = compare_verify(monkeypatch, VERIFY_CALLS, seed=3)
    assert rows >= 7_500 and accepted > 2_000 and rejected > 500
    assert differ == 0


def test_prob_of_is_prob():
    """p(token) on Python lists equals `prob` bit for bit, inside and outside the window."""
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    for kind in KINDS:
        logits = stress_logits(gen, 8, 8192, kind)
        processed = process(logits, ProcessorParams.of([stress_params(rng) for _ in range(8)]))
        rows = torch.randint(0, 8, (400,), generator=gen)
        tokens = torch.randint(0, 8192, (400,), generator=gen)
        tokens[:100] = processed.top_ids[rows[:100], torch.randint(0, 64, (100,), generator=gen)]
        expected = processed.prob(rows, tokens)
        got = torch.tensor(processed.prob_of(rows.tolist(), tokens.tolist()), dtype=torch.float64)
        assert torch.equal(bits(got), bits(expected))
        assert bool((expected > 0).any()) and bool((expected == 0).any())  # kept and cut


def test_inverse_cdf_index_is_sample_inverse_cdf():
    gen = torch.Generator().manual_seed(5)
    weights = torch.rand(2000, 40, generator=gen, dtype=torch.float64) ** 6
    weights[torch.rand(weights.shape, generator=gen) < 0.3] = 0.0  # zeros, inside and last
    weights[::7] = torch.round(weights[::7] * 65535)  # integer wire weights
    u = torch.rand(2000, generator=gen, dtype=torch.float64)
    u[::5] = 1.0 - 2.0**-53  # u · total rounding up to the total
    expected = sample_inverse_cdf(weights, u).tolist()
    got = [inverse_cdf_index(w, x) for w, x in zip(weights.tolist(), u.tolist())]
    assert got == expected


# `cuts_few` is the torch path's: with the compiled kernel both paths cut rows past WIDE values in
# its `window` (tests/unit/test_sampling_kernel.py compares it with the torch path's `cuts`)
@pytest.mark.parametrize("sampling_kernel", ["torch"], indirect=True)
def test_negative_control_a_slightly_different_top_p_is_caught(monkeypatch):
    """The small-batch path cutting at 0.1 % less top-p: some τ differ."""
    real = processed_mod.cuts_few

    def nudged(logits, pp, z, *rest):
        top_p = torch.where(pp.top_p < 1.0, pp.top_p * (1 - 1e-3), pp.top_p)
        return real(logits, ProcessorParams(pp.temperature, pp.top_k, top_p, pp.min_p), z, *rest)

    monkeypatch.setattr(processed_mod, "cuts_few", nudged)
    assert compare_process(monkeypatch, 300, seed=6)[1] > 0


@pytest.mark.parametrize("sampling_kernel", ["torch"], indirect=True)
def test_negative_control_a_window_one_ulp_off_is_caught(monkeypatch):
    """The small-batch path deciding on window values one ulp up: the bitwise comparison
    sees it (as it would see an exp or a sum that rounds differently from torch's)."""
    real = processed_mod.cuts_few
    monkeypatch.setattr(
        processed_mod,
        "cuts_few",
        lambda logits, pp, z, *rest: real(
            logits, pp, torch.nextafter(z, torch.tensor(float("inf"))), *rest
        ),
    )
    assert compare_process(monkeypatch, 100, seed=7)[1] > 0


def test_negative_control_a_slightly_different_acceptance_is_caught(monkeypatch):
    """The small-batch verify accepting with 3 % less probability: some rounds differ."""
    real = verify_mod._acceptance
    monkeypatch.setattr(verify_mod, "_acceptance", lambda p, q: 0.97 * real(p, q))
    assert compare_verify(monkeypatch, 60, seed=8)[1] > 0
