"""Load shedding at admission: while the target tier is past its capacity, new sessions are
refused with RESOURCE_EXHAUSTED instead of joining a queue whose wait would run past the
workers' deadline (and end as UNAVAILABLE for everyone queued behind them).

The signal is what every running session measures anyway: how long its verify step took
(a chunked prefill included) — queueing for a batch plus the forward pass plus the network.
Its mean over a sliding window is compared with `--shed-verify-s`. Sessions already running
are never refused; as they finish, the window drops below the bound and admission reopens.
With no session running the window is empty and nothing is refused.
"""

from __future__ import annotations

import collections
import time


class LoadShedder:
    def __init__(self, bound_s: float, window_s: float = 5.0, clock=time.monotonic):
        self.bound_s = bound_s
        self.window_s = window_s
        self.clock = clock
        self._steps: collections.deque[tuple[float, float]] = collections.deque()
        self._sum = 0.0

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._sum -= self._steps.popleft()[1]

    def observe(self, verify_s: float) -> None:
        now = self.clock()
        self._steps.append((now, verify_s))
        self._sum += verify_s
        self._trim(now)

    def saturated(self) -> float | None:
        """The window's mean verify step when it is past the bound, else None (0 = off)."""
        if self.bound_s <= 0:
            return None
        self._trim(self.clock())
        if not self._steps:
            return None
        mean = self._sum / len(self._steps)
        return mean if mean > self.bound_s else None
