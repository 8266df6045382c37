"""coordinator.stats: a session's counters survive a takeover through what each commit stores."""

from __future__ import annotations

import dataclasses
import json

import pytest

from coordinator.stats import Stats


def test_stored_counters_restore_the_same_stats_and_do_not_move_with_later_rounds():
    stats = Stats()
    stats.count_round(4, 2, 0.008, 0.010)
    stats.first_token(0.25)  # the prompt's round ends with the first token
    stats.count_round(3, 3, 0.006, 0.009)
    stored = json.loads(json.dumps(stats.as_dict(10, 7, 1.0)))  # as a commit writes it
    before = dataclasses.asdict(stats)
    raw = stats.as_dict(10, 7, 1.0)["_raw"]
    stats.count_round(4, 4)  # the next round, while that commit may still be in flight
    assert raw == before  # a snapshot: the list was copied, not shared
    restored = Stats.restore(stored)
    assert dataclasses.asdict(restored) == before
    assert restored.accepted_per_position == [2, 2, 1, 0]
    assert restored.rounds_per_gamma == [0, 0, 0, 1, 1]  # one round at γ = 3, one at 4
    assert stored["draft_forward_ms"] == pytest.approx(14.0)  # the workers' pass times, summed
    assert stored["verify_forward_ms"] == pytest.approx(19.0)
    assert stored["first_token_forward_ms"] == pytest.approx(18.0)  # the first round's passes
    assert stored["time_to_first_token_ms"] == pytest.approx(250.0)
    assert Stats.restore(stored).as_dict(10, 7, 1.0)["verify_forward_ms"] == pytest.approx(19.0)
    assert raw["rounds_per_gamma"] == [0, 0, 0, 1, 1] and stats.rounds_per_gamma[4] == 2
    stats.count_round(0, 0)
    assert stats.rounds_per_gamma == [1, 0, 0, 1, 2]
    assert sum(stats.rounds_per_gamma) == stats.rounds
