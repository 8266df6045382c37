"""The compiled sampling kernel (`specdec.core.row_kernel`, `specdec/core/csrc/sampling_rows.cpp`): the
rows past the window get the torch path's τ bit for bit and its log Z to rounding, their next
token is the dense reference's draw (`draw_next` over dense float64 rows), whole-row log-sums
agree with `full_lse` within its float32 rounding, the draft's step gives the torch path's
candidates and q̃ up to the order of tied tokens, the window (`top`) is torch.topk's with
tied tokens by id, and a row's result does not depend on the
rows beside it — on the stress set of tests/unit/test_small_batch_math.py (flat rows with
nuclei of thousands, ties, plateaus, top-k past the window, min-p, 8k and 49k vocabularies).
Through the eager hot path the first token and the bonus token of γ = 1 rounds follow Hugging
Face's warpers (chi-square), and redrawing from p after a rejection fails the same test; the
processors' window and cuts (`window`) give the torch path's τ, `fits` and window bit for bit
and its log Z to 1e-12, and rounds over 4,096-token rows cut by it follow the warpers too
(a window cutting at less top-p fails).
`--sampling-kernel` chooses it; the toolchain is part of the set-up (`make tools`), so these
tests build the kernel and fail, not skip, where it cannot be built."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from test_fixed_math import first_round, gamma_one_rounds, hf_probs, pvalue
from test_small_batch_math import KINDS as SMALL_BATCH_KINDS
from test_small_batch_math import VOCABS, bits, draft_round, stress_logits, stress_params

from specdec.core import logsum, nucleus, row_kernel
from specdec.core import processed as processed_mod
from specdec.core.next_token import draw_next
from specdec.core.params import SamplingParams
from specdec.core.processed import WINDOW, ProcessorParams, process
from specdec.core.proposal import dense_q, propose_step

KINDS = ("flat", "flat", "ties", "plateau", "peaked")


@pytest.fixture(scope="module")
def module():
    found = row_kernel.EXTENSION.get()
    assert not isinstance(found, str), found
    return found


@pytest.fixture
def compiled(module, monkeypatch):
    monkeypatch.setattr(row_kernel, "_chosen", [module])
    return module


def wide_inputs(gen: torch.Generator, count: int):
    """(logits, temperature, z, z_max, top_p, log_norm) of `count` stress rows, as
    `wide_rows` gets them (z = logits / T, the torch path's input)."""
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    vocab = rng.choice((8192, 8192, 49152))
    logits = stress_logits(gen, count, vocab, rng.choice(KINDS))
    temperature = torch.tensor([rng.choice((0.3, 0.8, 1.0, 1.7)) for _ in range(count)])
    top_p = torch.tensor([rng.choice((0.5, 0.9, 0.95, 0.999)) for _ in range(count)]).double()
    z = logits / temperature[:, None]
    z_max = z.max(dim=1).values
    log_norm = logsum.full_lse(logits, temperature, None, z_max, scaled=True)
    return logits, temperature, z, z_max, top_p, log_norm


def drawn(module, processed, rows, q_ids, q_weights, rejected, u) -> list[int]:
    """The kernel's draws from the processed rows `rows` (tensors as lists)."""
    lists = [[] if x is None else x.tolist() for x in (q_ids, q_weights)]
    p = processed
    args = (p.logits, rows.tolist(), p.temperature, p.tau, p.log_z, *lists)
    return module.draw(*args, rejected.tolist(), u.tolist())


def test_nucleus_cuts_are_the_torch_paths(module, monkeypatch):
    monkeypatch.setattr(row_kernel, "_chosen", [None])  # the torch path's log-masses
    gen = torch.Generator().manual_seed(3)
    rows = 0
    for _ in range(150):
        logits, temperature, z, z_max, top_p, log_norm = wide_inputs(gen, 4)
        tau, log_z = nucleus.nucleus_cuts(z, z_max, top_p, log_norm)
        got_tau, got_log_z = module.nucleus(logits, temperature, z_max, top_p, log_norm)
        assert torch.equal(got_tau, tau)
        # the kept masses add in another order (~1e-16 relative)
        assert torch.allclose(got_log_z, log_z, rtol=0, atol=1e-12)
        rows += len(z)
    assert rows == 600


def test_draws_are_the_dense_references(compiled):
    """Recovered tokens (rejected: the residual of q̃ — in the window, past it, ids repeated)
    and bonus tokens of processed stress rows whose kept set runs past the window, against
    `draw_next` over dense float64 p and q̃."""
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    draws = wide = 0
    for _ in range(120):
        vocab = rng.choice((8192, 49152))
        logits = stress_logits(gen, 4, vocab, rng.choice(KINDS))
        params = [
            SamplingParams(
                temperature=rng.choice((0.3, 0.8, 1.3)),
                top_p=rng.choice((0.9, 0.999, 1.0)),
                min_p=rng.choice((0.0, 0.0, 0.01)),
            )
            for _ in range(4)
        ]
        processed = process(logits, ProcessorParams.of(params))
        rows = torch.tensor([3, 0, 2, 1])
        in_window = processed.top_ids[rows, :16]
        anywhere = torch.randint(0, vocab, (4, 16), generator=gen)
        q_ids = torch.cat([in_window, anywhere, anywhere[:, :4]], dim=1)  # some ids twice
        q_weights = torch.randint(0, 65536, q_ids.shape, generator=gen)
        rejected = torch.rand(4, generator=gen) < 0.7
        u = torch.rand(4, generator=gen, dtype=torch.float64)
        got = drawn(compiled, processed, rows, q_ids, q_weights, rejected, u)
        p = processed.dense(rows)
        want = draw_next(p, dense_q(q_ids, q_weights, vocab), rejected, u)
        assert got == want.tolist()
        no = torch.zeros(4, dtype=torch.bool)
        assert (
            drawn(compiled, processed, rows, None, None, no, u) == draw_next(p, p, no, u).tolist()
        )
        draws += 8
        wide += int((~processed.inside(rows)).sum())
    assert draws == 960 and wide > 200  # most rows keep tokens past their window


def test_whole_row_log_sums_are_full_lses(module, monkeypatch):
    """`full_lse` through the kernel against its torch path: cuts and none, the scaled sum of
    top-p's normaliser and the divided one, within the torch path's float32 chunk sums."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(60):
        logits, temperature, z, z_max, _, _ = wide_inputs(gen, 4)
        tau = torch.tensor([float("-inf"), float(z[1].median()), float("-inf"), float(z[3, 7])])
        for cut in (None, tau):
            for scaled in (False, True):
                monkeypatch.setattr(row_kernel, "_chosen", [None])
                want = logsum.full_lse(logits, temperature, cut, z_max, scaled)
                monkeypatch.setattr(row_kernel, "_chosen", [module])
                got = logsum.full_lse(logits, temperature, cut, z_max, scaled)
                assert torch.allclose(got, want, rtol=2e-7, atol=0)


def test_a_row_alone_is_the_row_in_a_batch(module):
    gen = torch.Generator().manual_seed(6)
    logits, temperature, _, z_max, top_p, log_norm = wide_inputs(gen, 6)
    tau, log_z = module.nucleus(logits, temperature, z_max, top_p, log_norm)
    none = torch.zeros(6, dtype=torch.bool)
    sums = module.lse(logits, temperature, tau, z_max, none)
    u = torch.rand(6, generator=gen, dtype=torch.float64).tolist()
    q_ids = torch.randint(0, logits.shape[1], (6, 8), generator=gen).tolist()
    q_weights = [[1000.0] * 8] * 6
    rejected = [True, False] * 3
    tokens = module.draw(
        logits, list(range(6)), temperature, tau, log_z, q_ids, q_weights, rejected, u
    )
    for r in range(6):
        one = slice(r, r + 1)
        row = (logits[one], temperature[one])
        t, lz = module.nucleus(*row, z_max[one], top_p[one], log_norm[one])
        assert torch.equal(t, tau[one]) and torch.equal(lz, log_z[one])
        assert torch.equal(module.lse(*row, tau[one], z_max[one], none[one]), sums[one])
        args = (logits[one], [0], temperature[one], t, lz, q_ids[one], q_weights[one])
        alone = module.draw(*args, rejected[one], u[one])
        assert alone == tokens[one]


def window_faults(x: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> list[str]:
    """How a window (values, ids) of rows x differs from `torch.topk`'s: its values must be
    topk's (NaN first), its ids must hold them, each once, and equal values go by id."""
    faults = []
    expected = torch.topk(x, values.shape[1], dim=-1).values
    if not torch.equal(values.nan_to_num(nan=1e30), expected.nan_to_num(nan=1e30)):
        faults.append("values")
    if not torch.equal(x.gather(1, ids).nan_to_num(nan=1e30), values.nan_to_num(nan=1e30)):
        faults.append("ids")
    for r in range(x.shape[0]):
        row_ids, row_values = ids[r].tolist(), values[r].nan_to_num(nan=1e30).tolist()
        if len(set(row_ids)) != len(row_ids):
            faults.append(f"row {r}: an id twice")
        ties = [j for j in range(1, len(row_ids)) if row_values[j] == row_values[j - 1]]
        if any(row_ids[j] < row_ids[j - 1] for j in ties):
            faults.append(f"row {r}: ties not by id")
    return faults


@pytest.mark.parametrize("kind", ["flat", "ties", "plateau", "peaked"])
@pytest.mark.parametrize("vocab", [100, 8192, 49152])
def test_top_is_torchs_topk_with_ties_by_id(module, kind, vocab):
    """The window (`top`): torch.topk's values, each id once and holding its value, tokens of
    equal logit by id — at the processors' window (64, 65), a large top-k's (200, 1001: smaller
    blocks, then every value keyed) and the whole row; rows of −inf, ±0, NaN, all equal."""
    gen = torch.Generator().manual_seed(vocab + len(kind))
    x = stress_logits(gen, 8, vocab, kind)
    x[1, vocab // 3 :] = float("-inf")
    x[2] = float("-inf")
    x[3, 5], x[3, vocab - 1] = float("nan"), float("nan")
    x[4] = 1.0
    x[5, : vocab // 2], x[5, vocab // 2 :] = -0.0, 0.0
    for width in sorted({min(w, vocab) for w in (1, 64, 65, 200, 1001, vocab)}):
        values, ids = module.top(x, width)
        assert window_faults(x, values, ids) == [], (kind, vocab, width)


def test_negative_control_a_window_off_by_one_is_caught(module):
    """The comparison sees a window missing its largest value, and ties out of id order."""
    gen = torch.Generator().manual_seed(11)
    x = stress_logits(gen, 4, 8192, "ties")
    values, ids = module.top(x, 65)
    assert window_faults(x, values[:, 1:], ids[:, 1:]) != []
    swapped = ids.clone()
    r, j = next((r, j) for r in range(4) for j in range(1, 65) if values[r, j] == values[r, j - 1])
    swapped[r, j - 1], swapped[r, j] = ids[r, j], ids[r, j - 1]
    assert window_faults(x, values, swapped) == [f"row {r}: ties not by id"]


def test_negative_control_a_top_p_one_step_off_is_caught(module):
    gen = torch.Generator().manual_seed(3)
    caught = 0
    for _ in range(20):
        logits, temperature, z, z_max, top_p, log_norm = wide_inputs(gen, 4)
        tau, _ = nucleus.nucleus_cuts(z, z_max, top_p, log_norm)
        got, _ = module.nucleus(logits, temperature, z_max, top_p * (1 + 1e-4), log_norm)
        caught += not torch.equal(got, tau)
    assert caught >= 15


def test_negative_control_a_draw_from_p_after_a_rejection_is_caught(compiled):
    gen = torch.Generator().manual_seed(7)
    logits = stress_logits(gen, 4, 8192, "flat")
    params = ProcessorParams.of([SamplingParams(temperature=0.8, top_p=0.95)] * 4)
    processed = process(logits, params)
    rows = torch.arange(4)
    q_ids = processed.top_ids[:, :32]
    q_weights = torch.full((4, 32), 1000)
    dense = processed.dense(rows)
    rejected, no = torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)
    mismatches = 0
    for _ in range(50):
        u = torch.rand(4, generator=gen, dtype=torch.float64)
        wrong = drawn(compiled, processed, rows, q_ids, q_weights, no, u)
        want = draw_next(dense, dense_q(q_ids, q_weights, 8192), rejected, u)
        mismatches += sum(a != b for a, b in zip(wrong, want.tolist()))
    assert mismatches > 50


# --- the processors' window and cuts (`window`) ----------------------------------------------


def window_cases(seed: int, calls: int):
    """(logits, ProcessorParams, width, with_log_z) of `calls` random batches of 1–8 stress rows
    (tests/unit/test_small_batch_math.py's set: top-k at and past the 64-value window, nuclei
    inside it and past it, min-p, ties at the cut, 8k and 49k vocabularies)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for call in range(calls):
        count = rng.randint(1, 8)
        logits = stress_logits(gen, count, VOCABS[call % 3], rng.choice(SMALL_BATCH_KINDS))
        pp = ProcessorParams.of([stress_params(rng) for _ in range(count)])
        width = min(logits.shape[1], max(WINDOW, int(pp.top_k.max()) + 1))
        yield logits, pp, width, rng.random() < 0.7


def window_differences(got, logits, pp, width, with_log_z) -> dict[str, int]:
    """Rows where the kernel's `window` differs from the torch path (`top_window`, then
    `cuts`, whose whole-row sums go through the kernel's `lse` here as on a serving CPU): the
    window and its z, τ and `fits` in any bit; log Z (and top-p's log-mass, where top-p is on)
    beyond 1e-12 — the window's float64 sums add the same terms with another exp and order."""
    values, ids = processed_mod.top_window(logits, width)
    z = values / pp.temperature[:, None]
    tau, log_z, fits, log_k, _ = processed_mod.cuts(logits, pp, z, with_log_z)
    g_tau, g_log_z, g_fits, g_log_k, g_z, g_ids = got
    on = pp.top_p < 1.0
    if log_k is None:  # no row uses top-p
        log_k = torch.full_like(g_log_k, float("nan"))

    def far(a, b):  # NaN: far
        return ~((a - b).abs() <= 1e-12)

    return {
        "window": int((~((bits(g_z) == bits(z)).all(1) & (g_ids == ids).all(1))).sum()),
        "tau": int((bits(g_tau) != bits(tau)).sum()),
        "fits": int((g_fits != fits).sum()),
        "log_z": int(far(g_log_z, log_z).sum()) if with_log_z else int((~g_log_z.isnan()).sum()),
        "log_k": int((far(g_log_k, log_k) & on).sum()) + int((~g_log_k.isnan() & ~on).sum()),
    }


def test_windows_are_the_torch_paths_cuts(compiled):
    """The window and cuts of 6,000+ stress rows: the same window, τ and `fits` bit for bit,
    log Z and log_k to 1e-12; covering rows whose nucleus runs past the window, whose top-p
    log-mass is summed over the whole row (the top-k set runs past the window), and whose log Z
    is (kept tokens past the window)."""
    rows, total = 0, dict.fromkeys(("window", "tau", "fits", "log_z", "log_k"), 0)
    unfit = past_k = whole = 0
    for logits, pp, width, with_log_z in window_cases(seed=21, calls=1500):
        got = compiled.window(
            logits, pp.temperature, pp.top_k, pp.top_p, pp.min_p, width, with_log_z
        )
        for key, count in window_differences(got, logits, pp, width, with_log_z).items():
            total[key] += count
        rows += logits.shape[0]
        tau, _, fits, _, z, _ = got
        unfit += int((~fits).sum())
        k = pp.top_k.clamp(1, width) - 1
        tau_k = torch.where(pp.top_k > 0, z.gather(1, k[:, None]).squeeze(1), -torch.inf)
        past_k += int(((pp.top_p < 1.0) & (z[:, -1] >= tau_k)).sum())
        whole += int((fits & (z[:, -1] >= tau)).sum()) if with_log_z else 0
    assert total == dict.fromkeys(total, 0), total
    assert rows >= 6_000 and unfit > 500 and past_k > 1_000 and whole > 300


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.3, top_p=0.999),
    ],
)
def test_windows_of_rows_with_minus_infinity(compiled, params):
    """Rows a processor upstream masked (−inf): 100 finite values, fewer than the window, a
    single one, every other one; and a row of equal values — as the torch path cuts them."""
    x = stress_logits(torch.Generator().manual_seed(0), 6, 8192, "peaked")
    x[0, 100:] = x[1, 10:] = x[2] = float("-inf")
    x[2, 7], x[3], x[4, ::2] = 3.0, 0.0, float("-inf")
    pp = ProcessorParams.of([params] * 6)
    width = max(WINDOW, params.top_k + 1)
    got = compiled.window(x, pp.temperature, pp.top_k, pp.top_p, pp.min_p, width, True)
    assert set(window_differences(got, x, pp, width, True).values()) == {0}


def test_a_top_k_past_the_window_is_found_in_the_whole_row(compiled):
    """`_thresholds` widens the window past every top-k, but a narrower one still cuts top-k
    right: its τ is the k-th largest z of the whole row (as the wider window has it)."""
    x = stress_logits(torch.Generator().manual_seed(1), 4, 8192, "flat")
    pp = ProcessorParams.of([SamplingParams(temperature=0.8, top_k=k) for k in (0, 65, 100, 500)])
    rows = (pp.temperature, pp.top_k, pp.top_p, pp.min_p)
    narrow = compiled.window(x, *rows, 64, True)[0]
    wide = compiled.window(x, *rows, 501, True)[0]
    kth = (x / 0.8).sort(dim=1, descending=True).values[torch.arange(4), (pp.top_k - 1).clamp(0)]
    assert torch.equal(narrow, wide) and torch.equal(narrow[1:], kth[1:])
    assert narrow[0] == -torch.inf


def test_negative_control_a_window_cut_slightly_off_is_caught(compiled):
    """The comparison sees a kernel cutting at 0.1 % less top-p (τ), and at 1 % more min-p."""
    caught = {"tau_p": 0, "tau_m": 0}
    for logits, pp, width, with_log_z in window_cases(seed=22, calls=200):
        top_p = torch.where(pp.top_p < 1.0, pp.top_p * (1 - 1e-3), pp.top_p)
        got = compiled.window(logits, pp.temperature, pp.top_k, top_p, pp.min_p, width, with_log_z)
        caught["tau_p"] += window_differences(got, logits, pp, width, with_log_z)["tau"]
        min_p = pp.min_p * 1.01
        got = compiled.window(logits, pp.temperature, pp.top_k, pp.top_p, min_p, width, with_log_z)
        caught["tau_m"] += window_differences(got, logits, pp, width, with_log_z)["tau"]
    assert caught["tau_p"] > 20 and caught["tau_m"] > 20, caught


def test_a_window_row_alone_is_the_row_in_a_batch(compiled):
    def exactly(x):  # floats by their bits (NaN equal to NaN)
        return bits(x) if x.is_floating_point() else x

    for logits, pp, width, with_log_z in window_cases(seed=23, calls=40):
        rows = (pp.temperature, pp.top_k, pp.top_p, pp.min_p)
        batch = compiled.window(logits, *rows, width, with_log_z)
        for r in range(logits.shape[0]):
            one = slice(r, r + 1)
            alone = compiled.window(logits[one], *(x[one] for x in rows), width, with_log_z)
            assert all(torch.equal(exactly(a), exactly(b[one])) for a, b in zip(alone, batch))


# --- the draft's step ----------------------------------------------------------------------


def differing_up_to_ties(got, reference, logits, params, token_only) -> int:
    """Rows of two `propose_step` results that differ in anything but the order of tokens of
    equal z: q̃'s weights, the z of its ids rank by rank, the candidate's z (torch's topk
    orders tied values as it likes; the kernel puts lower ids first)."""
    differ = 0
    for r, p in enumerate(params):
        if token_only[r]:
            differ += int(got.tokens[r] != reference.tokens[r])
            continue
        z = logits[r] / p.temperature
        same = torch.equal(got.dist_weights[r], reference.dist_weights[r])
        same &= torch.equal(z[got.dist_ids[r]], z[reference.dist_ids[r]])
        differ += int(not (same and bool(z[got.tokens[r]] == z[reference.tokens[r]])))
    return differ


def draft_rounds(module, monkeypatch, calls: int, kernel=None) -> tuple[int, int]:
    """(rows, rows differing up to tie order) of `propose_step` through the kernel (or
    `kernel`, standing in for it) against its torch path, on the stress set's draft rounds."""
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    rows = differ = 0
    for call in range(calls):
        args = draft_round(rng, gen, call)
        monkeypatch.setattr(row_kernel, "_chosen", [kernel or module])
        got = propose_step(*args)
        monkeypatch.setattr(row_kernel, "_chosen", [None])
        reference = propose_step(*args)
        logits, params, *_, token_only = args
        rows += len(params)
        differ += differing_up_to_ties(got, reference, logits, params, token_only)
    return rows, differ


def test_draft_steps_are_the_torch_paths_up_to_tie_order(module, monkeypatch):
    """Candidates and q̃ (ids, integer weights) of 1–8 rows, token-only rows mixed in, top-k
    around and past the window, nuclei inside and past it, min-p, ties, 8k and 49k."""
    rows, differ = draft_rounds(module, monkeypatch, 900)
    assert rows >= 3_500 and differ == 0


def test_negative_control_a_draft_top_p_one_step_off_is_caught(module, monkeypatch):
    class Shifted:  # the kernel with every top-p a little larger
        def __getattr__(self, name):
            return getattr(module, name)

        def draft(self, rows, temperature, top_k, top_p, *rest):
            return module.draft(rows, temperature, top_k, [p * 1.01 for p in top_p], *rest)

    _, differ = draft_rounds(module, monkeypatch, 200, Shifted())
    assert differ > 10


def test_a_draft_row_alone_is_the_row_in_a_batch(module):
    gen = torch.Generator().manual_seed(8)
    logits = torch.cat([stress_logits(gen, 2, 8192, kind) for kind in ("flat", "peaked", "ties")])
    params = ([0.8, 1.0, 0.3, 1.7, 0.9, 1.2], [0, 0, 5, 100, 0, 64])
    params += ([0.95, 1.0, 0.9, 0.999, 0.5, 0.9], [0.0, 0.05, 0.0, 0.0, 0.2, 0.0])
    u = torch.rand(6, generator=gen, dtype=torch.float64).tolist()
    together = module.draft(logits, *params, 32, u)
    for r in range(6):
        alone = module.draft(logits[r : r + 1], *([x[r]] for x in params), 32, [u[r]])
        assert all(torch.equal(a[0], b[r]) for a, b in zip(alone, together))


# --- lossless through the eager hot path with the kernel -------------------------------------


@pytest.fixture(scope="module")
def eager_rounds(module):
    chosen = row_kernel._chosen[:]
    row_kernel._chosen[:] = [module]
    try:
        yield first_round(None)
    finally:
        row_kernel._chosen[:] = chosen


@pytest.mark.slow
def test_first_token_and_bonus_are_the_targets(eager_rounds):
    """γ = 1 rounds of 2,000 sessions at once (the batched path), nuclei of ~200 tokens past
    the 64-value window: cut and drawn by the kernel."""
    first, bonus, target, params = eager_rounds
    p0 = hf_probs(target[0], params.temperature, params.top_p)
    p1 = hf_probs(target[1], params.temperature, params.top_p)
    assert int((p0 > 0).sum()) > 3 * 64
    accepted = bonus[bonus >= 0]
    assert len(accepted) > len(first) // 10
    assert pvalue(first, p0) > 1e-3
    assert pvalue(accepted, p1) > 1e-3


@pytest.mark.slow
def test_negative_control_redrawing_from_p_after_a_rejection_fails(module, monkeypatch):
    class FromP:  # the kernel, but every recovered token drawn from p instead of the residual
        def __getattr__(self, name):
            return getattr(module, name)

        def draw(self, *args):
            *rest, rejected, u = args
            return module.draw(*rest, [False] * len(rejected), u)

    monkeypatch.setattr(row_kernel, "_chosen", [FromP()])
    first, _, target, params = first_round(None)
    assert pvalue(first, hf_probs(target[0], params.temperature, params.top_p)) < 1e-6


def window_round(rows: int = 20_000, vocab: int = 4_096):
    """γ = 1 rounds of `rows` sessions over rows of more than `WIDE` values, which the kernel's
    `window` cuts: the target's first row peaked (a nucleus of ~30 tokens inside the 64-value
    window: τ and log Z from the window, top-p's mass from the whole row), its second flat (a
    nucleus of thousands, finished past the window); the draft proposes from the first row plus
    noise. (first tokens, bonus tokens — −1 where rejected, target rows, params)."""
    gen = torch.Generator().manual_seed(31)
    target = torch.randn(2, vocab, generator=gen) * torch.tensor([[1.0], [0.7]])
    target[0, torch.randperm(vocab, generator=gen)[:40]] += 6.0
    draft = target[0] + 0.5 * torch.randn(vocab, generator=gen)
    params = SamplingParams(temperature=0.9, top_p=0.9)
    return (*gamma_one_rounds(target, draft, params, rows), target, params)


@pytest.mark.slow
def test_first_token_and_bonus_through_the_window_are_the_targets(compiled):
    """Against Hugging Face's warpers (chi-square), with every row cut by `window`: the first
    token (accepted candidate or recovered token) from the peaked row, the bonus token from
    the flat row whose nucleus runs past the window."""
    calls = []

    class Counted:  # the kernel, counting the rows its `window` cuts
        def __getattr__(self, name):
            return getattr(compiled, name)

        def window(self, logits, *rest):
            calls.append(logits.shape[0])
            return compiled.window(logits, *rest)

    row_kernel._chosen[:] = [Counted()]
    first, bonus, target, params = window_round()
    p0 = hf_probs(target[0], params.temperature, params.top_p)
    p1 = hf_probs(target[1], params.temperature, params.top_p)
    assert 20 < int((p0 > 0).sum()) < 64 < 3 * 64 < int((p1 > 0).sum())
    accepted = bonus[bonus >= 0]
    assert sum(calls) == len(first) + len(accepted) and len(accepted) > len(first) // 3
    assert pvalue(first, p0) > 1e-3
    assert pvalue(accepted, p1) > 1e-3


@pytest.mark.slow
def test_negative_control_a_window_cutting_at_less_top_p_fails(compiled):
    """The kernel's `window` cutting every row at top-p 0.8 instead of 0.9: the first tokens
    no longer follow the target's distribution."""

    class LessTopP:
        def __getattr__(self, name):
            return getattr(compiled, name)

        def window(self, logits, temperature, top_k, top_p, *rest):
            return compiled.window(logits, temperature, top_k, top_p - 0.1, *rest)

    row_kernel._chosen[:] = [LessTopP()]
    first, _, target, params = window_round(rows=10_000)
    assert pvalue(first, hf_probs(target[0], params.temperature, params.top_p)) < 1e-6


# --- the flag -----------------------------------------------------------------------------------


def test_select(module, monkeypatch):
    monkeypatch.setattr(row_kernel, "_chosen", [])
    assert row_kernel.select("torch") is False
    assert row_kernel.for_device(torch.device("cpu")) is None
    assert row_kernel.select("compiled") is True
    assert row_kernel.for_device(torch.device("cpu")) is module
    assert row_kernel.for_device(torch.device("meta")) is None  # CPU rows only
    with pytest.raises(ValueError, match="--sampling-kernel: expected one of"):
        row_kernel.select("fast")


def test_without_a_toolchain_auto_uses_torch_and_compiled_says_why(monkeypatch, caplog):
    def no_compiler(name):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(row_kernel.EXTENSION, "_loaded", {})
    monkeypatch.setattr(row_kernel.EXTENSION, "build", no_compiler)
    monkeypatch.setattr(row_kernel, "_chosen", [])
    with caplog.at_level(logging.WARNING, "specdec.core.compiled"):
        assert row_kernel.for_device(torch.device("cpu")) is None  # first use: auto
        assert row_kernel.select("auto") is False
    assert "compiled sampling kernel unavailable, torch's ops instead" in caplog.text
    with pytest.raises(ValueError, match="--sampling-kernel: compiled is not available"):
        row_kernel.select("compiled")
