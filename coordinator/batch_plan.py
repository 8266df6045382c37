"""The batch plan: the γ every session that shares verify passes uses, chosen from what
rounds at each γ measured (windows of passes, probes compared side by side). The policy of
`coordinator.policy` defers to it in batches; its class docstring is the whole design."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

from specdec.core.perf_model import expected_tokens

log = logging.getLogger(__name__)


def typical_round_s(times: list[float]) -> float:
    """The mean of a window's rounds without its slowest eighth (at least one): a new
    session's prefill makes a few rounds many times longer, and nothing else should be
    left out — under load a speculating round's time has a longer tail than a plain one's
    (its median fell 10 % short of its mean at 16 sessions, γ = 0's 4 %), which a median
    would not charge it."""
    kept = sorted(times)[: len(times) - max(1, len(times) // 8)] or times
    return statistics.fmean(kept)


@dataclass
class BatchPlan:
    """The γ every batched session uses, chosen from what rounds at each γ measured.

    Sessions sharing verify passes must choose alike (a pass pads every block to the longest),
    and the cost model's forecast of a whole batch is least reliable where it matters most:
    under load the round time hangs on how sessions fall into passes (two groups alternating on
    the target while the other drafts, a queue), which no affine fit of one pass sees. So in
    batches γ is held for a window of `window_passes` verify passes, and each window's rounds at
    that γ measure its round time: the mean without the slowest eighth (`typical_round_s`: a new
    session's prefill makes a few rounds many times longer) of the rounds chosen `settle_passes`
    after the window began, when every session has switched, leaving out each session's first
    rounds; its rate is E(α̂, γ) / that time.

    The load itself moves meanwhile (sessions arrive and finish), and a rate measured at 16
    sessions cannot be compared with one measured at 4. So γs are only ever compared side by
    side: every `probe_every`-th window tries another γ, and the window at the plan's γ after it
    confirms — the probe replaces the plan only when its rate beats the mean of the plan's
    windows just before and just after it (A/B/A: a steady drift of the load cancels) by
    `margin`. Probes go in turn to half the plan's γ, a neighbour of the plan, the cost model's
    choice among γ ≥ 1, a neighbour, γ = 0 (speculation off), a neighbour again (half first: a
    plan far too high — under load the forecast said γ = 7 or 8 where 2 was best, in part
    because a wave's prefills were booked as network time, and it still starts from a few
    windows' figures — comes down in a few probes, not one step per probe; where the forecast is
    right the first probe loses one window); where a kind's γ is the plan's own or was probed
    lately, a neighbour instead: γ ± 1, the one probed longest ago (towards the cost model's
    choice on a tie). A probe that wins becomes the plan and is followed at once by one more
    step the same way (unless that γ lost a probe lately), so the plan climbs a step per probe.
    Neighbours let the plan climb to the best γ; the others are there because the rate need not
    be unimodal in γ: every γ > 0 pays the draft call's fixed costs, so γ = 1 can be worse than
    both γ = 0 and γ = 3. A window closes only after `min_rounds` measured rounds (or three
    windows' passes, at a very low load). At γ = 0 each probe lost in a row doubles the wait for
    the next (up to `backoff` times): where speculation does not pay, a probe's window runs at a
    lower rate. The plan starts from the forecast; when its γ has measured nothing for `max_age`
    windows' passes — after a pause, or back at its load level after that long at others with α̂
    moved by `alpha_moved` or more (another mode or text: its γ may no longer be best; its first
    window back is then not measured, as the sessions' first rounds there run slow) — it starts
    again from that γ, not the forecast (under load the forecast ran high: γ = 4 where the
    windows had found 2, in part with a wave's prefills booked as network time,
    docs/benchmarks.md), with a probe after each of its first 3 windows, the first at half its
    γ, then a neighbour and the forecast's choice, so a load unlike the last one moves it either
    way. A γ not measured since the last start (a load too light for a window to measure) gives
    way to the forecast, as at the start. A probe cut short by a switch to another load level's
    plan (`resume`), while it measured or after it measured ahead of the plan but before the
    confirming window, is the first probe when the level is back; so is a probe whose own
    window, or whose confirming window after it measured ahead, closed with too few rounds to
    tell (the passes went to sessions of a fixed γ)."""

    PROBES = ("off", "neighbour", "half", "neighbour", "model", "neighbour")
    RESTART_PROBE = "half"  # the first probe after the plan starts again

    window_passes: int = 4
    settle_passes: int = 1
    probe_every: int = 6
    max_age: int = 12
    min_rounds: int = 4
    margin: float = 0.02
    backoff: int = 2  # at γ = 0, lost probes double the wait, up to 2^backoff × probe_every
    alpha_moved: float = 0.05  # back at its level, a plan starts again if α̂ moved this much

    def __post_init__(self) -> None:
        if self.window_passes < 1 or not 0 <= self.settle_passes < self.window_passes:
            raise ValueError("window_passes must be >= 1 and 0 <= settle_passes < window_passes")
        if self.probe_every < 0 or self.max_age < 1 or self.min_rounds < 1 or self.margin < 0:
            raise ValueError("probe_every and margin must be >= 0, max_age and min_rounds >= 1")
        if self.backoff < 0 or self.alpha_moved < 0:
            raise ValueError("backoff and alpha_moved must be >= 0")
        self.gamma: int | None = None  # this window's γ
        self.best: int | None = None  # the plan's γ (what probes return to)
        self.window = 0  # this window's number
        self.start = 0  # the verify pass it began at
        self.times: list[float] = []  # its measured rounds' times
        self.measured: dict[int, tuple[float, int]] = {}  # γ -> (typical round s, at pass)
        self.ratios: dict[int, tuple[float, int]] = {}  # γ -> (its last probe / the plan, pass)
        self.passes = 0  # the latest verify pass number seen
        self._since_probe = self.probe_every - 1  # the first probe after the first window
        # the first probe halves the forecast's γ (under load it runs high; where it is
        # right, the probe loses one window); then the rotation on from there
        self._probes = self.PROBES.index("half") if "half" in self.PROBES else 0
        self._retry: int | None = None  # a probe to go again first (cut short, or unmeasured)
        self._probe_from: int | None = None  # the plan's γ when this window is a probe
        self._before: float | None = None  # the plan's rate in the window before the probe
        self._pending: tuple[int, float, float, int] | None = None  # a probe awaiting its
        # confirming window: (γ, its rate, the plan's rate before it, the plan's γ)
        self._started = 1  # the window the plan last started afresh in
        self._stale = False  # this window resumed a plan whose γ had measured nothing lately
        self._lost = 0  # probes from γ = 0 lost in a row since the plan went there or restarted
        self._alpha: float | None = None  # α̂ when the plan last measured a window
        self._restarted = -1  # the pass it last started again at, after a pause

    def current(self, passes: int, alpha: float, max_gamma: int, model_best) -> int:
        """This window's γ (a new window's when the current one is complete).
        `model_best(low)` is the cost model's choice among γ ≥ low: the first plan, and
        where probes look."""
        self.passes = passes
        if self.gamma is None:
            self.best = model_best(0)
            self._begin(passes, self.best)
        elif passes >= self.start + self.window_passes and (
            len(self.times) >= self.min_rounds or passes >= self.start + 3 * self.window_passes
        ):
            self._close(passes, alpha, max_gamma, model_best)
        return min(self.gamma, max_gamma)

    def resume(self, passes: int) -> None:
        """In use again after other plans (other loads) held the passes since its last call: a
        window left open then is dropped, a probe's with it — its rounds and the ones to come
        would not be side by side — and a new one begins at the plan's γ."""
        if self.gamma is None or passes - self.passes <= self.window_passes:
            return
        if self._probe_from is not None:  # a probe still measuring: it goes again
            self._retry = self.gamma
        elif self._pending is not None and self._pending[1] > self._pending[2]:
            self._retry = self._pending[0]  # a probe ahead, unconfirmed: it goes again
        self._probe_from = self._pending = None
        self.passes = passes
        # its γ measured nothing for max_age windows' passes: the first window starts the plan
        # again, as after a pause (`_close`) — the load now may be unlike the last one there
        self._stale = not self._fresh(self.measured.get(self.best))
        self._begin(passes, self.best)

    def ticket(self, passes: int) -> tuple[int, bool]:
        """What a session choosing now records, to report its round with: (window, whether
        its round counts towards the window's measurement)."""
        return self.window, passes >= self.start + self.settle_passes

    def observe(self, ticket: tuple[int, bool], gamma: int, round_s: float) -> None:
        window, settled = ticket
        if settled and window == self.window and gamma == self.gamma:
            self.times.append(round_s)

    def _fresh(self, entry: tuple[float, int] | None) -> bool:
        return entry is not None and self.passes - entry[1] <= self.max_age * self.window_passes

    def rate(self, gamma: int, alpha: float) -> float | None:
        """The rate a session measured at γ in its last window; None if not measured lately
        (an absolute figure, at the load of that window: decisions compare side by side)."""
        entry = self.measured.get(gamma)
        if not self._fresh(entry):
            return None
        return expected_tokens(alpha, gamma) / max(entry[0], 1e-12)

    def _begin(self, passes: int, gamma: int) -> None:
        self.window += 1
        self.gamma, self.start, self.times = gamma, passes, []

    def _close(self, passes: int, alpha: float, max_gamma: int, model_best) -> None:
        stale, self._stale = self._stale, False
        if stale and self._alpha is not None and abs(alpha - self._alpha) < self.alpha_moved:
            stale = False  # back at its level with the acceptance as it was: its γ stands
        if stale:  # its first window back after long elsewhere: the sessions' first rounds
            self.times = []  # there ran slow (a γ = 1 probe after it won on that, falsely)
        rate = None
        if len(self.times) >= self.min_rounds:
            self.measured[self.gamma] = (typical_round_s(self.times), passes)
            rate = self.rate(self.gamma, alpha)
            self._alpha = alpha
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "batch plan: window %d (passes %d-%d) γ=%d %s, %d rounds measured, "
                "%s tok/s a session (α̂ %.2f) median %.1f mean %.1f ms",
                self.window,
                self.start,
                passes,
                self.gamma,
                "probe" if self._probe_from is not None else "plan",
                len(self.times),
                "?" if rate is None else f"{rate:.1f}",
                alpha,
                1000 * statistics.median(self.times) if self.times else 0.0,
                1000 * statistics.fmean(self.times) if self.times else 0.0,
            )
        if self._probe_from is not None:  # a probe: the plan's γ again, to confirm
            if rate is not None and self._before is not None:
                self._pending = (self.gamma, rate, self._before, self._probe_from)
            elif rate is None:  # it measured too few rounds to tell: it goes again
                self._retry = self.gamma
            self._probe_from = None
            self._begin(passes, self.best)
            return
        pending, self._pending = self._pending, None
        if pending is not None and rate is None and pending[1] > pending[2]:
            # ahead of the plan, but this window measured too few rounds to confirm it (the
            # passes went to sessions of a fixed γ): it goes again, first
            self._retry = pending[0]
        if pending is not None and rate is not None and pending[3] == self.best:
            gamma, probed, before, _ = pending
            reference = (before + rate) / 2  # the plan's rate around the probe (A/B/A)
            self.ratios[gamma] = (probed / reference, passes)
            won = probed > reference * (1 + self.margin) and gamma <= max_gamma
            self._lost = 0 if won or self.best != 0 else min(self._lost + 1, self.backoff)
            if won:  # the probe is the plan; on one more step the same way at once
                step = 1 if gamma > self.best else -1
                self.best, further = gamma, gamma + step
                lost = self.ratios.get(further)
                if 0 <= further <= max_gamma and not (self._fresh(lost) and lost[0] <= 1):
                    self._before = probed
                    self._since_probe = 0
                    self._probe(passes, further, gamma)
                    return
                self._begin(passes, gamma)
                return
        if self.gamma == self.best and (
            stale or (rate is None and not self._fresh(self.measured.get(self.best)))
        ):  # nothing measured lately (a new load after a pause, or back at this level after
            # max_age windows' passes elsewhere): start again — from this γ if its windows
            # measured it since the last start, else (a load too light to measure) from the
            # forecast
            entry = self.measured.get(self.best)
            if entry is None or entry[1] <= self._restarted:
                self.best = model_best(0)
            # (after a stale resume the restart counts from the next window: this one's
            # rounds were not measured)
            self._started, self._restarted = self.window + stale, passes
            self._lost = 0
            self._probes = self.PROBES.index(self.RESTART_PROBE)  # half, neighbour, forecast
        best = min(self.best, max_gamma)
        self._since_probe += 1
        # in the first 3 windows of a (re)start every window probes; later every
        # probe_every-th — at γ = 0 twice as rarely after each probe lost in a row, up to
        # `backoff` times: where speculation does not pay, each probe costs a window at a
        # lower rate (SmolLM2 sampling at 4 sessions: ~0.75 of speculation off's)
        every = self.probe_every if self.window - self._started >= 3 else 1
        if self.best == 0:
            every <<= self._lost
        # a probe to go again (`_retry`) is due at the close of the plan's next window
        due = self._retry is not None or self._since_probe >= every
        if self.probe_every == 0 or not due or max_gamma == 0 or rate is None:
            self._begin(passes, best)
            return
        self._since_probe = 0
        probe, self._retry = self._retry, None
        if probe is None or probe == best or probe > max_gamma:
            kind = self.PROBES[self._probes % len(self.PROBES)]
            self._probes += 1
            probe = {"off": 0, "half": best // 2, "model": model_best(1)}.get(kind, best)
        if probe == best or self._fresh(self.ratios.get(probe)):
            # the plan's own or probed lately: a neighbour instead, the one probed longest
            # ago (towards the cost model's choice on a tie)
            towards = model_best(0)
            sides = [g for g in (best - 1, best + 1) if 0 <= g <= max_gamma]
            probe = min(
                sides,
                key=lambda g: (self.ratios.get(g, (0.0, -1))[1], (g > best) != (towards > best)),
            )
        self._before = rate
        self._probe(passes, probe, best)

    def _probe(self, passes: int, gamma: int, best: int) -> None:
        self._begin(passes, gamma)
        self._probe_from = best

    def describe(self, alpha: float) -> str:
        ratios = " ".join(
            f"{g}:{entry[0]:.2f}" for g, entry in sorted(self.ratios.items()) if self._fresh(entry)
        )
        rate = self.rate(self.best, alpha) if self.best is not None else None
        now = f"{rate:.1f}" if rate is not None else "?"
        return (
            f"plan γ={self.gamma} best={self.best} ({now} tok/s a session) window={self.window} "
            f"probes against it {ratios}"
        )
