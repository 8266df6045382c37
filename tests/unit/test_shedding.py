"""LoadShedder: the admission signal over a sliding window of verify steps."""

from __future__ import annotations

from coordinator.shedding import LoadShedder


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_saturated_only_while_the_window_mean_exceeds_the_bound():
    clock = Clock()
    shedder = LoadShedder(bound_s=2.0, window_s=5.0, clock=clock)
    assert shedder.saturated() is None  # nothing running: never refuse
    shedder.observe(1.0)
    shedder.observe(2.5)
    assert shedder.saturated() is None  # mean 1.75
    shedder.observe(4.0)
    assert shedder.saturated() == 2.5  # mean of 1, 2.5, 4
    clock.now += 4.0
    shedder.observe(1.0)
    assert shedder.saturated() == 2.125
    clock.now += 2.0  # the first three left the window
    assert shedder.saturated() is None
    clock.now += 10.0
    assert shedder.saturated() is None and not shedder._steps


def test_a_zero_bound_never_refuses():
    shedder = LoadShedder(bound_s=0.0, clock=Clock())
    shedder.observe(1e9)
    assert shedder.saturated() is None
