"""The fixed-shape sampling path (`specdec.core.fixed`, run by `specdec.core.graphs`; one CUDA
graph a call on a GPU, the same padded calls eagerly here) gives what the eager hot path gives,
on the small-batch stress set (tests/unit/test_small_batch_math.py: temperatures 0.3–1.7,
top-k around and past the window, nuclei inside and far past it, min-p, ties, plateaus, γ =
0..6, 8k and 49k vocabularies): the same accepted counts and tokens, the same draft
candidates and integer q̃ weights, and processed rows with the same τ and window bit for bit
(tied values' tokens in any order)
and log Z within 1e-6 (`LOG_Z_TOL`).
One `SamplingGraphs` serves every round, so batches of 1–8 sessions reuse each other's
padded buffers (rows past the live batch stale from a larger call). Negative controls: a cut
one token later in a wide nucleus, and draft weights rounded down, are caught."""

from __future__ import annotations

import random

import pytest
import torch
from test_small_batch_math import (
    differing_proposals,
    draft_round,
    stress_logits,
    verify_round,
)

from specdec.core import few_rows as few_rows_mod
from specdec.core import fixed, row_kernel
from specdec.core import graphs as graphs_mod
from specdec.core.graphs import SamplingGraphs, _bucket
from specdec.core.params import SamplingParams
from specdec.core.processed import ProcessorParams
from specdec.core.proposal import propose_step
from specdec.core.rng import seed_tensor
from specdec.core.verify import verify_logits


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """The eager reference on its tensor path of torch ops, as the fixed shapes compute it (the
    small-batch path is compared with it in tests/unit/test_small_batch_math.py, the compiled
    rows in tests/unit/test_sampling_kernel.py)."""
    monkeypatch.setattr(few_rows_mod, "FEW_ROWS", 0)
    monkeypatch.setattr(row_kernel, "_chosen", [None])


# log Z: rows the fixed path finishes from the histogram add float64 masses in another order
# (~1e-16); a top-k row whose kept ties run past the window the reference sums over its
# sorted whole row in float32 chunks (~1e-7), this path over the row in float64
LOG_Z_TOL = 1e-6


def live_rows(result) -> torch.Tensor:
    """[rows] bool: the processed rows a verify used (each session's up to its draw)."""
    slots = result.output_tokens.shape[1]
    upto = torch.arange(slots)[None, :] <= result.num_accepted[:, None]
    return upto.reshape(-1)


def compare_verify(calls: int, seed: int) -> dict[str, int]:
    graphs = SamplingGraphs("cpu")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    out = dict(sessions=0, differ=0, rows=0, rows_differ=0, wide=0, accepted=0, rejected=0)
    for call in range(calls):
        args = verify_round(rng, gen, call)
        logits, greedy = args[0], args[1]
        reference = verify_logits(*args)
        got = verify_logits(*args, graphs=graphs)
        same = (got.num_accepted == reference.num_accepted) & (
            got.output_tokens == reference.output_tokens
        ).all(dim=1)
        out["sessions"] += len(same)
        out["differ"] += int((~same).sum())
        out["accepted"] += int(reference.num_accepted.sum())
        out["rejected"] += int((reference.num_accepted < args[3].num_candidates).sum())
        if reference.processed is None:
            continue
        sampling = ~greedy
        used = live_rows(reference)[
            sampling.repeat_interleave(logits.shape[1])
        ]  # the sampling sessions' rows
        a, b = got.processed, reference.processed
        # the reference pads a row from a narrower window with −inf; among equal values a
        # top-k of another width may list the tokens in another order
        tied = torch.zeros_like(b.top_z, dtype=torch.bool)
        tied[:, 1:] |= b.top_z[:, 1:] == b.top_z[:, :-1]
        tied[:, :-1] |= (b.top_z[:, :-1] == b.top_z[:, 1:]) | (b.top_z[:, :-1] == a.top_z[:, 1:])
        window = (a.top_z == b.top_z) & ((a.top_ids == b.top_ids) | tied)
        window |= torch.isneginf(b.top_z)
        close = torch.isclose(a.log_z, b.log_z, rtol=0.0, atol=LOG_Z_TOL)
        same_rows = (a.tau == b.tau) & window.all(dim=1)
        out["rows"] += int(used.sum())
        out["rows_differ"] += int((used & ~(same_rows & close)).sum())
        top_p = args[2].repeat_rows(logits.shape[1]).top_p < 1.0  # nucleus past the window:
        out["wide"] += int((used & top_p & (a.tau < a.top_z[:, -1])).sum())  # `_nucleus`'s
    out["eager_calls"] = graphs.counts["eager"]
    out["calls"] = graphs.counts["calls"]
    return out


def test_verify_rounds_are_the_eager_path():
    got = compare_verify(300, seed=13)
    assert got["sessions"] >= 1_000 and got["accepted"] > 1_000 and got["rejected"] > 300
    assert got["rows"] >= 2_000 and got["wide"] >= 100  # nuclei past the window, finished
    assert got["differ"] == 0 and got["rows_differ"] == 0
    assert got["eager_calls"] <= got["calls"] // 10  # flagged rounds stay rare


def compare_draft(calls: int, seed: int) -> tuple[int, int]:
    graphs = SamplingGraphs("cpu")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = differ = 0
    for call in range(calls):
        args = draft_round(rng, gen, call)
        reference, got = propose_step(*args), propose_step(*args, graphs=graphs)
        rows += args[0].shape[0]
        differ += differing_proposals(got, reference, args[-1])
    return rows, differ


def test_draft_steps_are_the_eager_path():
    rows, differ = compare_draft(400, seed=14)
    assert rows >= 1_500 and differ == 0


def test_negative_control_a_cut_one_token_later_is_caught(monkeypatch):
    real = fixed._nucleus

    def later(*args):
        tau, log_z, redo = real(*args)
        return torch.nextafter(tau, torch.tensor(float("-inf"))), log_z, redo

    monkeypatch.setattr(fixed, "_nucleus", later)
    got = compare_verify(80, seed=15)
    assert got["rows_differ"] > 0


def test_negative_control_draft_weights_one_step_off_are_caught(monkeypatch):
    monkeypatch.setattr(fixed, "WIRE_WEIGHT_MAX", fixed.WIRE_WEIGHT_MAX - 1)
    assert compare_draft(100, seed=16)[1] > 0


def test_buckets():
    assert [_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


# --- lossless through the fixed path, with nuclei far past the window ----------------------

VOCAB, TRIALS, Q_ENTRIES = 300, 20_000, 32


def hf_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The target's distribution by Hugging Face's own warpers (the independent reference)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, logits[None].float())
    scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.double().softmax(dim=-1)[0]


def first_round(graphs: SamplingGraphs) -> tuple[torch.Tensor, torch.Tensor]:
    """One round of γ = 1 for `TRIALS` sessions through the fixed path: the draft proposes
    from its own rows (K = 32 of 300 tokens in q̃), the target verifies; (first tokens, bonus
    tokens of the sessions that accepted — −1 elsewhere). The target's rows are flat enough
    that top-p 0.9 keeps ~200 tokens: every nucleus is finished past the window."""
    gen = torch.Generator().manual_seed(21)
    target = torch.randn(2, VOCAB, generator=gen) * 0.7
    draft = target[0] + 0.5 * torch.randn(VOCAB, generator=gen)
    params = SamplingParams(temperature=0.9, top_p=0.9)
    return (*gamma_one_rounds(target, draft, params, TRIALS, graphs), target, params)


def gamma_one_rounds(target, draft, params, trials: int, graphs=None):
    """γ = 1 rounds of `trials` sessions, 2,000 at once: the draft proposes from its row
    (K = `Q_ENTRIES` in q̃), the target verifies against its two rows; (first tokens, bonus
    tokens of the sessions that accepted — −1 elsewhere)."""
    out_first, out_bonus = [], []
    for start in range(0, trials, 2_000):
        n = 2_000
        seeds = seed_tensor(range(start, start + n))
        base = torch.zeros(n, dtype=torch.int64)
        step = propose_step(
            draft.expand(n, -1), [params] * n, seeds, base, Q_ENTRIES, [False] * n, graphs=graphs
        )
        block = fixed.DraftBlock(
            step.tokens[:, None],
            torch.ones(n, dtype=torch.int64),
            step.dist_ids[:, None],
            step.dist_weights[:, None].double(),
        )
        result = verify_logits(
            target.expand(n, -1, -1),
            torch.zeros(n, dtype=torch.bool),
            ProcessorParams.of([params] * n),
            block,
            seeds,
            base,
            graphs=graphs,
        )
        out_first.append(result.output_tokens[:, 0])
        out_bonus.append(torch.where(result.num_accepted == 1, result.output_tokens[:, 1], -1))
    return torch.cat(out_first), torch.cat(out_bonus)


def pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of tokens against probs (cells expecting < 5 merged)."""
    from scipy.stats import chisquare

    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs * len(tokens)
    assert float(counts[expected == 0].sum()) == 0  # nothing drawn outside the kept set
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = wanted > 0
    return float(
        chisquare(
            observed[keep].numpy(),
            wanted[keep].numpy() * observed.sum().item() / wanted[keep].sum().item(),
        ).pvalue
    )


@pytest.fixture(scope="module")
def rounds():
    return first_round(SamplingGraphs("cpu"))


@pytest.mark.slow
def test_fixed_path_first_token_and_bonus_are_the_targets(rounds):
    first, bonus, target, params = rounds
    p0 = hf_probs(target[0], params.temperature, params.top_p)
    p1 = hf_probs(target[1], params.temperature, params.top_p)
    assert int((p0 > 0).sum()) > 3 * 64  # nuclei far past the window
    accepted = bonus[bonus >= 0]
    assert len(accepted) > TRIALS // 10
    assert pvalue(first, p0) > 1e-3
    assert pvalue(accepted, p1) > 1e-3


@pytest.mark.slow
def test_negative_control_a_bonus_from_the_wrong_row_is_rejected(rounds):
    _, bonus, target, params = rounds
    p0 = hf_probs(target[0], params.temperature, params.top_p)
    with pytest.raises(AssertionError):  # drawn where row 0 keeps nothing, or far off it
        assert pvalue(bonus[bonus >= 0], p0) > 1e-3


@pytest.mark.slow
def test_negative_control_redrawing_from_p_after_a_rejection_is_rejected(monkeypatch):
    real = fixed.sample_next
    monkeypatch.setattr(
        fixed,
        "sample_next",
        lambda processed, rows, q_ids, q_weights, rejected, u: real(
            processed, rows, q_ids, q_weights, torch.zeros_like(rejected), u
        ),
    )
    first, _, target, params = first_round(SamplingGraphs("cpu"))
    assert pvalue(first, hf_probs(target[0], params.temperature, params.top_p)) < 1e-6


# --- the workers' flag and the memory budget ---------------------------------------------


def test_for_device():
    assert graphs_mod.for_device("auto", "cpu") is None  # auto: CUDA only
    assert graphs_mod.for_device("off", "cpu") is None
    assert isinstance(graphs_mod.for_device("on", "cpu"), SamplingGraphs)
    with pytest.raises(ValueError, match="sampling_graphs: expected one of auto, on, off"):
        graphs_mod.for_device("yes", "cpu")


def test_graphs_stay_within_their_memory_budget():
    """The estimate (48 bytes a padded logit) decides: graphs past the budget release the
    least recently used; a shape larger than the budget alone is refused (eager path)."""
    graphs = SamplingGraphs("cpu", capture=True, budget_mb=10)  # nothing is run here
    shapes = {"rows": ((2, 8), torch.float32)}
    logits = 4 * 2**20 // 48  # 4 MiB each
    assert graphs._graph("a", None, shapes, logits) is not None
    assert graphs._graph("b", None, shapes, logits) is not None
    assert graphs._graph("a", None, shapes, logits) is not None  # used again: b is older
    assert graphs._graph("c", None, shapes, logits) is not None  # 12 MiB > 10: b released
    assert list(graphs._graphs) == ["a", "c"] and graphs.held_mb() == pytest.approx(8.0, rel=1e-4)
    assert graphs._graph("huge", None, shapes, 11 * 2**20 // 48) is None
    assert graphs.counts["too_large"] == 1 and graphs.counts["captures"] == 3


def engines_outcomes(model_dirs, mode: str):
    """A draft block and its verify for 6 sampling sessions of the code pair, through the
    workers' engines with `--sampling-graphs mode` (on: the fixed shapes, run eagerly here)."""
    from draft_worker.engine import ModelProposer, ProposeItem
    from specdec.engine.kv import KVSession
    from specdec.engine.model import ModelRuntime, RuntimeSettings
    from target_worker.engine import TargetEngine, VerifyItem

    draft = ModelRuntime(RuntimeSettings(model_dirs["draft"], device="cpu"))
    target = ModelRuntime(RuntimeSettings(model_dirs["target"], device="cpu"))
    prompts = ["def add(a, b):\n", "import os\n", "class A:\n", "x = [", "for i in", "# a"]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.7, top_k=100, top_p=0.95),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.5, top_p=0.99),
    ]
    histories = [draft.tokenizer.encode(p) for p in prompts]
    items = []
    for i, (history, p) in enumerate(zip(histories, params)):
        session = KVSession(f"d{i}")
        session.sync(history)
        items.append(ProposeItem(session, len(history), 4, p, 100 + i, False))
    proposals = ModelProposer(draft, 32, mode).process(items)
    verify = []
    for i, (history, p, out) in enumerate(zip(histories, params, proposals)):
        session = KVSession(f"t{i}")
        session.sync(history)
        verify.append(
            VerifyItem(
                session,
                len(history),
                out.candidates,
                out.dist_ids,
                out.dist_weights,
                p,
                100 + i,
                True,
                2,
            )
        )
    outcomes = TargetEngine(target, mode).verify(verify)
    return [(o.candidates, o.dist_ids, o.dist_weights) for o in proposals], outcomes


def test_workers_engines_give_the_same_tokens_with_the_fixed_shapes(model_dirs):
    """The engines' wiring: proposals, accepted counts, outputs and log-probabilities."""
    proposals_on, on = engines_outcomes(model_dirs, "on")
    proposals_off, off = engines_outcomes(model_dirs, "off")
    assert proposals_on == proposals_off
    assert [(o.num_accepted, o.output_ids) for o in on] == [
        (o.num_accepted, o.output_ids) for o in off
    ]
    for a, b in zip(on, off):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)
        assert [ids for ids, _ in a.top_logprobs] == [ids for ids, _ in b.top_logprobs]
    assert any(o.num_accepted < 4 for o in off) and sum(len(o.output_ids) for o in off) > 6


def test_a_capture_that_fails_sends_every_call_to_the_eager_path(caplog):
    """Capturing where no CUDA is (this machine's torch) fails like an operator a GPU cannot
    capture: logged once, the verify and the draft step then run on the eager path, and
    give its results."""
    graphs = SamplingGraphs("cpu", capture=True)
    rng, gen = random.Random(17), torch.Generator().manual_seed(17)
    with caplog.at_level("WARNING", "specdec.core.graphs"):
        for call in range(1, 8):
            args = verify_round(rng, gen, call)
            reference, got = verify_logits(*args), verify_logits(*args, graphs=graphs)
            assert torch.equal(got.output_tokens, reference.output_tokens)
    assert graphs.broken and not graphs._graphs and graphs.counts["calls"] == 0
    assert sum("capture failed" in r.message for r in caplog.records) == 1
    logits = stress_logits(gen, 3, 8192, "peaked")
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * 3
    args = (logits, params, seed_tensor([1, 2, 3]), torch.tensor([5, 6, 7]), 32, [False] * 3)
    assert torch.equal(propose_step(*args, graphs=graphs).tokens, propose_step(*args).tokens)


def test_the_workers_metrics_count_calls_by_path():
    """`specdec_worker_sampling_graph_calls` from a SamplingGraphs' counts: calls served by a
    graph, sent back (redo), too large, and after a failed capture."""
    from types import SimpleNamespace

    from specdec.serving.metrics import sampling_graph_calls
    from specdec.worker.lifecycle import sampling_graphs_of

    graphs = SamplingGraphs("cpu", capture=True, budget_mb=1000)
    graphs._graph("huge", None, {"rows": ((1, 1), torch.float32)}, 1100 * 2**20 // 48)
    rng, gen = random.Random(18), torch.Generator().manual_seed(18)
    for call in range(1, 5):  # the first capture fails here (no CUDA): graphs off
        verify_logits(*verify_round(rng, gen, call), graphs=graphs)
    counts = sampling_graph_calls(graphs.counts)
    assert counts["eager_too_large"] == 1 and counts["eager_off"] >= 2 and counts["graph"] == 0
    served = SamplingGraphs("cpu")  # no capture: every call replays the fixed shapes
    for call in range(1, 5):
        verify_logits(*verify_round(rng, gen, call), graphs=served)
    counts = sampling_graph_calls(served.counts)
    assert counts["graph"] + counts["eager_redo"] == served.counts["calls"] > 0
    assert sampling_graphs_of(SimpleNamespace(engine=SimpleNamespace(graphs=served))) is served
    assert sampling_graphs_of(SimpleNamespace(proposer=SimpleNamespace(graphs=None))) is None
