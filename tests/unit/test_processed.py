"""The hot-path processed distribution equals the dense reference processors, row by row, for
every combination of processors, in the cases that take the window, the wider window and the
whole row; greedy and sampling verification from logits equal the dense verifier exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec.core import few_rows as few_rows_mod
from specdec.core import logsum as logsum_mod
from specdec.core import nucleus as nucleus_mod
from specdec.core import processed as processed_mod
from specdec.core import row_kernel
from specdec.core.params import SamplingParams
from specdec.core.processed import ProcessorParams, process
from specdec.core.proposal import dense_q, propose_step
from specdec.core.rng import seed_tensor
from specdec.core.sampling import probs_from_logits
from specdec.core.verify import DraftBlock, verify_block, verify_logits

COMBOS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in itertools.product(
        (0.7, 1.0, 1.6), (0, 5, 300), (1.0, 0.5, 0.95, 0.999), (0.0, 0.05)
    )
]


def logits_of(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "peaked":  # an LLM-like row: a few strong tokens over a long flat tail
        x = torch.randn(rows, vocab, generator=gen) * 2.0
        top = torch.randint(0, vocab, (rows, 8), generator=gen)
        return x.scatter_add(1, top, 6.0 + 4.0 * torch.rand(rows, 8, generator=gen))
    return torch.randn(rows, vocab, generator=gen) * 0.3  # flat: nuclei far past the window


@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_processed_rows_equal_the_dense_reference(kind):
    vocab = 5000
    logits = logits_of(kind, len(COMBOS), vocab, seed=1)
    got = process(logits, ProcessorParams.of(COMBOS))
    dense = got.dense(torch.arange(len(COMBOS)))
    for row, params in enumerate(COMBOS):
        expected = probs_from_logits(logits[row : row + 1], params)[0]
        assert torch.equal(dense[row] > 0, expected > 0), (row, params)  # the same kept set
        assert torch.allclose(dense[row], expected, rtol=1e-6, atol=1e-12), (row, params)
        assert float(dense[row].sum()) == pytest.approx(
            1.0, abs=1e-7
        )  # exp in float32 over whole rows
        tokens = torch.randint(0, vocab, (50,))
        probs = got.prob(torch.full((50,), row), tokens)
        assert torch.allclose(probs, expected[tokens], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("kernel", ["torch", "compiled"])
def test_a_large_nucleus_is_cut_from_its_histogram_not_a_sort(monkeypatch, kernel):
    """A flat row with top-p 0.3 (a nucleus of ~1,000 of 5,000 tokens) cannot be cut inside
    the 64-value window: it is finished from its histogram (torch's ops, or the compiled
    kernel's), the other rows are not, and the result is still exactly the dense
    reference's."""
    windows, cuts = [], []
    real_thresholds = processed_mod._thresholds
    monkeypatch.setattr(
        processed_mod,
        "_thresholds",
        lambda logits, pp, width, **kw: (
            windows.append((len(logits), width)) or real_thresholds(logits, pp, width, **kw)
        ),
    )
    if kernel == "torch":
        monkeypatch.setattr(row_kernel, "_chosen", [None])
        real_cut = nucleus_mod.nucleus_cuts
        monkeypatch.setattr(
            nucleus_mod, "nucleus_cuts", lambda z, *a: cuts.append(len(z)) or real_cut(z, *a)
        )
    else:
        module = row_kernel.EXTENSION.get()
        assert not isinstance(module, str), module

        class Counted:  # the kernel, counting the rows it cuts
            def __getattr__(self, name):
                return getattr(module, name)

            def nucleus(self, z, *a):
                return cuts.append(len(z)) or module.nucleus(z, *a)

        monkeypatch.setattr(row_kernel, "_chosen", [Counted()])
    params = [
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.5, top_p=0.6, min_p=0.02),
    ]
    logits = logits_of("flat", 3, 5000, seed=2)
    got = process(logits, ProcessorParams.of(params))
    assert windows == [(3, 64)] and cuts == [2]  # no wider window, no sort of a row; together
    for row, p in enumerate(params):
        dense = got.dense(torch.tensor([row]))[0]
        expected = probs_from_logits(logits[row : row + 1], p)[0]
        assert torch.equal(dense > 0, expected > 0)
        assert torch.allclose(dense, expected, rtol=1e-6, atol=1e-12)
    assert int((got.dense(torch.tensor([0]))[0] > 0).sum()) > 500


def test_verify_from_logits_equals_the_dense_verifier():
    """Same seeds, same candidates: the hot path and the dense reference agree token for token,
    greedy and sampling rows mixed in one batch, sparse q̃ with K < vocab, token-only rows."""
    batch, gamma, vocab, k = 24, 4, 3000, 8
    gen = torch.Generator().manual_seed(5)
    target = logits_of("peaked", batch * (gamma + 1), vocab, seed=3).reshape(
        batch, gamma + 1, vocab
    )
    draft = target + 0.7 * torch.randn(target.shape, generator=gen)
    params = [COMBOS[i % len(COMBOS)] if i % 4 else SamplingParams() for i in range(batch)]
    token_only = [p.greedy or i % 5 == 1 for i, p in enumerate(params)]
    seeds, base = (
        seed_tensor(range(100, 100 + batch)),
        torch.randint(0, 50, (batch,), generator=gen),
    )
    num = torch.randint(0, gamma + 1, (batch,), generator=gen)
    candidates = torch.zeros(batch, gamma, dtype=torch.int64)
    ids = torch.zeros(batch, gamma, k, dtype=torch.int64)
    weights = torch.zeros(batch, gamma, k, dtype=torch.float64)
    q = torch.zeros(batch, gamma, vocab, dtype=torch.float64)
    for i in range(gamma):
        step = propose_step(draft[:, i], params, seeds, base + i, k, token_only)
        candidates[:, i] = step.tokens
        for b in range(batch):
            if token_only[b]:
                ids[b, i, 0], weights[b, i, 0] = step.tokens[b], 1.0
            else:
                ids[b, i], weights[b, i] = step.dist_ids[b], step.dist_weights[b].double()
            q[b, i] = dense_q(ids[b, i], weights[b, i], vocab)
    p = torch.stack(
        [probs_from_logits(target[b], params[b]) for b in range(batch)]
    )  # [B, γ+1, vocab] dense reference
    expected = verify_block(p, q, candidates, num, seeds, base)
    greedy = torch.tensor([x.greedy for x in params])
    sampling = ProcessorParams.of([x for x in params if not x.greedy])
    got = verify_logits(
        target, greedy, sampling, DraftBlock(candidates, num, ids, weights), seeds, base
    )
    assert got.num_accepted.tolist() == expected.num_accepted.tolist()
    assert got.output_tokens.tolist() == expected.output_tokens.tolist()
    assert 0 < int((got.num_accepted < num).sum()) < batch  # both paths were exercised


def test_wide_rows_are_finished_in_blocks_as_one_at_a_time(monkeypatch):
    """Rows whose nucleus runs past the window are finished together, a block of rows at a
    time (`WIDE_BLOCK` values): every row's τ and log Z are what it gets processed alone, and
    its distribution is the dense reference's (min-p raising the cut on some rows).
    Negative control: a cut one token lower fails the same kept-set check."""
    vocab = 3000
    monkeypatch.setattr(row_kernel, "_chosen", [None])  # torch's blocks (the kernel: row by row)
    monkeypatch.setattr(nucleus_mod, "WIDE_BLOCK", 2 * vocab)  # blocks of 2 rows
    params = [
        SamplingParams(temperature=t, top_p=p, min_p=m)
        for t, p, m in itertools.product((0.3, 1.0), (0.5, 0.95), (0.0, 0.2))
    ]
    logits = logits_of("flat", len(params), vocab, seed=7)
    cuts, real_cut = [], nucleus_mod.nucleus_cuts
    monkeypatch.setattr(
        nucleus_mod, "nucleus_cuts", lambda z, *a: cuts.append(len(z)) or real_cut(z, *a)
    )
    together = process(logits, ProcessorParams.of(params))
    assert cuts == [2, 2, 2, 2]  # every row's nucleus is past the window: blocks of 2 rows
    raised = together.top_z[:, -1] < together.tau  # min-p cut inside the window after all
    assert 0 < int(raised.sum()) < len(params)
    for row, p in enumerate(params):
        alone = process(logits[row : row + 1], ProcessorParams.of([p]))
        assert float(alone.tau[0]) == float(together.tau[row])
        assert float(alone.log_z[0]) == pytest.approx(float(together.log_z[row]), rel=0, abs=1e-12)
        dense = together.dense(torch.tensor([row]))[0]
        expected = probs_from_logits(logits[row : row + 1], p)[0]
        assert torch.equal(dense > 0, expected > 0), (row, p)
        assert torch.allclose(dense, expected, rtol=1e-6, atol=1e-12), (row, p)
        # log Z from the histogram's float64 masses; min-p's cut sums float32 exps of the row
        assert float(dense.sum()) == pytest.approx(1.0, abs=1e-7 if raised[row] else 1e-12)
        z = logits[row] / p.temperature
        lower = z[z < together.tau[row]].max()  # the next value down: one token more kept
        assert not torch.equal(z >= lower, expected > 0)


@pytest.mark.parametrize("scaled", [False, True])
def test_whole_row_normalisers_in_blocks_equal_each_row_alone(monkeypatch, scaled):
    """`full_lse` takes the rows a block at a time (`WIDE_BLOCK` values) on a CPU: every row's
    log-mass is bit for bit what it gets alone, and the float64 logsumexp of its kept z
    within the documented rounding. Rows with a threshold and rows without share a call (the
    threshold then applies per row; `scaled` only where no row has one)."""
    vocab = 3000
    monkeypatch.setattr(row_kernel, "_chosen", [None])  # torch's blocks (the kernel: row by row)
    monkeypatch.setattr(logsum_mod, "WIDE_BLOCK", 2 * vocab)  # blocks of 2 rows
    blocks, real_block = [], logsum_mod.row_lse
    monkeypatch.setattr(
        logsum_mod, "row_lse", lambda x, *a: blocks.append(len(x)) or real_block(x, *a)
    )
    logits = logits_of("peaked", 7, vocab, seed=11)
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.3, 0.9, 1.6, 0.5])
    z = logits / temperature[:, None]
    z_max = z.amax(dim=1)
    tau = None if scaled else torch.tensor([float("-inf"), 1.0, 0.5, -1.0, 2.0, 0.0, 3.0])
    together = logsum_mod.full_lse(logits, temperature, tau, z_max, scaled=scaled)
    assert blocks == [2, 2, 2, 1]
    for row in range(len(logits)):
        t = None if tau is None else tau[row : row + 1]
        one = (logits[row : row + 1], temperature[row : row + 1], t, z_max[row : row + 1])
        assert float(logsum_mod.full_lse(*one, scaled=scaled)[0]) == float(together[row])
        kept = z[row].double() if tau is None else z[row][z[row] >= tau[row]].double()
        assert float(together[row]) == pytest.approx(
            float(torch.logsumexp(kept, dim=0)), rel=0, abs=1e-6 if scaled else 3e-7
        )


def test_ties_at_a_wide_cut_are_all_kept_and_normalised():
    """Logits on a coarse grid put many tokens at top-p's cut: all of them are kept (the dense
    reference keeps whichever its sort puts first), so the kept set contains the reference's
    and differs only at z = τ, and p still sums to 1."""
    vocab = 4000
    logits = torch.round(logits_of("flat", 4, vocab, seed=9) * 16) / 16
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.3, 0.6, 0.9, 0.97)]
    got = process(logits, ProcessorParams.of(params))
    assert bool((got.top_z[:, -1] >= got.tau).all())  # every cut past the window
    tied = 0
    for row, p in enumerate(params):
        dense = got.dense(torch.tensor([row]))[0]
        expected = probs_from_logits(logits[row : row + 1], p)[0]
        extra = (dense > 0) & ~(expected > 0)
        tied += int(extra.sum())
        assert not bool(((expected > 0) & ~(dense > 0)).any())
        assert bool((logits[row][extra] == got.tau[row]).all())
        assert int(extra.sum()) < int((logits[row] == got.tau[row]).sum())
        assert float(dense.sum()) == pytest.approx(1.0, abs=1e-12)
    assert tied > 0  # the grid did put tokens at the cut that the reference dropped


@pytest.mark.parametrize("rows", [1, 12])  # Python floats for a few rows, tensor ops beyond
@pytest.mark.parametrize("skip", [True, False])  # False: the negative control
def test_the_draft_step_makes_no_whole_row_pass_for_temperature_alone(monkeypatch, rows, skip):
    """At temperature alone every token is kept, so a whole-row log Z would take a pass over
    the row; the draft's q̃ needs only τ and the window, so it takes none, and its candidates
    and q̃ are those of a step that computes log Z, bit for bit."""
    monkeypatch.setattr(row_kernel, "_chosen", [None])  # torch's path (the kernel sums no row
    # without top-p: its draft step reads the window only)
    logits = logits_of("peaked", rows, 20_000, seed=5)
    params = [SamplingParams(temperature=0.9)] * rows
    args = (logits, params, seed_tensor(range(rows)), torch.arange(rows) + 3, 32, [False] * rows)
    real_thresholds, real_full = processed_mod._thresholds, processed_mod.full_lse
    monkeypatch.setattr(  # the step as it was: log Z computed, then dropped
        processed_mod, "_thresholds", lambda *a, with_log_z=True: real_thresholds(*a, True)
    )
    reference = propose_step(*args)
    if skip:
        monkeypatch.setattr(processed_mod, "_thresholds", real_thresholds)
    passes = []
    for module in (processed_mod, few_rows_mod):  # the tensor path and the small-batch path
        monkeypatch.setattr(
            module, "full_lse", lambda x, *a, **kw: passes.append(len(x)) or real_full(x, *a, **kw)
        )
    step = propose_step(*args)
    assert torch.equal(step.tokens, reference.tokens)
    assert torch.equal(step.dist_ids, reference.dist_ids)
    assert torch.equal(step.dist_weights, reference.dist_weights)
    if skip:
        assert passes == []
    else:
        assert passes, "the negative control: log Z at temperature alone is a whole-row pass"
