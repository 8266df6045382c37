"""`specdec up` on one host: the target gets every core, and pipelined rounds are off where the
workers' threads exceed the cores (a block drafted during a verify would take a core from the
target's pass) unless SPECDEC_PIPELINE says otherwise."""

from __future__ import annotations

from types import SimpleNamespace

from specdec.launcher.up import pipeline_args


def settings(target=2, draft=1, target_workers=1, draft_workers=1, proposer="model"):
    return SimpleNamespace(
        target_threads=target,
        draft_threads=draft,
        target_workers=target_workers,
        draft_workers=draft_workers,
        proposer=proposer,
    )


def test_pipelining_is_off_where_the_workers_share_the_cores():
    assert pipeline_args(settings(2, 1), cores=2, environ={}) == ["--pipeline", "off"]
    assert pipeline_args(settings(8, 1), cores=8, environ={}) == ["--pipeline", "off"]


def test_the_coordinator_keeps_its_default_where_the_draft_has_a_core_of_its_own():
    assert pipeline_args(settings(1, 1), cores=2, environ={}) == []
    assert pipeline_args(settings(6, 1, 1, 2), cores=8, environ={}) == []


def test_an_explicit_setting_or_no_draft_model_keeps_the_coordinators_own():
    assert pipeline_args(settings(2, 1), cores=2, environ={"SPECDEC_PIPELINE": "on"}) == []
    assert pipeline_args(settings(2, 1, proposer="ngram"), cores=2, environ={}) == []
