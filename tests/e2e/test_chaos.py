"""The short chaos run (bench/chaos.py --short): every fault kind once — kill -9 and SIGSTOP of
a draft, a target and a coordinator, a Redis restart and pause, a slowed and a cut link to a
target in its own network namespace — while sessions stream; every finished session equals
its fault-free run token for token (greedy and seeded sampling at a fixed γ)."""

from __future__ import annotations

import os

import pytest

from bench.chaos import FAULTS, Outcome, Request, parse, run
from bench.chaos_faults import Link
from bench.chaos_report import compare, markdown, passed

pytestmark = pytest.mark.slow


def test_every_fault_kind_once_and_every_session_exact(model_dirs, tmp_path):
    assert os.geteuid() == 0, "the chaos run needs root: network namespaces and tc"
    args = parse(
        [
            "--short",
            "--sessions",
            "16",
            "--concurrency",
            "8",
            "--max-new-tokens",
            "24",
            "--fault-gap-s",
            "1.0",
            "--max-minutes",
            "8",
            "--target-model",
            model_dirs["target"],
            "--draft-model",
            model_dirs["draft"],
            "--out",
            str(tmp_path),
        ]
    )
    report = run(args, Link("specdec-chaos-test", subnet=78))
    summary = markdown(report)
    assert report["faults"] == dict.fromkeys(FAULTS, 1), summary
    assert report["chaos"]["resumes"] > 0, summary  # the faults were felt by the clients
    assert passed(report), summary + f"\n{report['chaos']['mismatches']}"


def test_the_comparison_catches_lost_repeated_diverged_and_unfinished_sessions():
    """Negative controls of the check above: each way a session can go wrong is counted."""
    reqs = [Request(i, "x", 0.0, 1, 2, 4) for i in range(4)]
    ref = {i: Outcome(tokens=[1, 2, 3, 4], finished=True) for i in range(4)}
    wave = {
        0: Outcome(tokens=[1, 2, 3, 4], finished=True),  # exact
        1: Outcome(tokens=[1, 2, 4], finished=True),  # a token lost
        2: Outcome(tokens=[1, 2, 2, 3, 4], finished=True, repeated=1),  # one repeated
        3: Outcome(tokens=[1, 2], finished=False, error="NOT_FOUND"),
    }
    result = compare([ref], [wave], reqs)
    assert (result["sessions"], result["finished"], result["exact"]) == (4, 3, 1)
    assert (result["tokens_lost"], result["tokens_repeated"]) == (1, 1)
    assert result["diverged"] == {"greedy": 2, "sampled": 0}
    assert [m["request"] for m in result["mismatches"]] == [1, 2, 3]
    # equal to either fault-free run counts as exact (batching can flip a near-tie)
    other = {i: Outcome(tokens=[1, 2, 4, 3], finished=True) for i in range(4)}
    either = compare([ref, other], [{**ref, 1: other[1]}], reqs)
    assert either["exact"] == 4 and either["diverged"] == {"greedy": 0, "sampled": 0}

    clean = compare([ref], [ref], reqs)
    report = {
        "reference": clean,
        "chaos": clean,
        "faults": dict.fromkeys(FAULTS, 1),
        "faults_planned": len(FAULTS),
        "injector_failure": "",
    }
    assert passed(report)
    assert not passed({**report, "chaos": result})
    assert not passed({**report, "faults_planned": len(FAULTS) + 1})
    # sampled sessions may diverge only about as often as the fault-free runs do
    sampled = [Request(i, "x", 0.8, 1, 2, 4) for i in range(4)]
    drifted = compare([ref], [{**ref, 0: other[0]}], sampled)
    assert drifted["diverged"] == {"greedy": 0, "sampled": 1}
    assert passed({**report, "chaos": drifted})  # one in four: within 3 × 1/5 × 4 + 3
    many = {**drifted, "sessions": 40, "diverged": {"greedy": 0, "sampled": 30}}
    assert not passed({**report, "chaos": many})
    # a greedy divergence passes only as a near-tie of the target's own logits
    one = {**clean, "diverged": {"greedy": 1, "sampled": 0}}
    tie = {"near_tie": True, "logit_gap": 2e-6}
    assert passed({**report, "chaos": {**one, "greedy_divergences": [tie]}})
    wrong = {**tie, "near_tie": False, "logit_gap": 3.5}
    assert not passed({**report, "chaos": {**one, "greedy_divergences": [wrong]}})
    assert not passed({**report, "chaos": one})  # not explained at all
