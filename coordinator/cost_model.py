"""The timing estimates the adaptive γ policy plans with (`coordinator.policy`, whose module
docstring gives the round-time formula they fit): what one round measured (`RoundTiming`) and
the cost model every session of a coordinator shares (`CostModel`)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.batch_plan import BatchPlan
from specdec.core.acceptance import AcceptanceEstimate


class _Ewma:
    """Exponentially weighted mean; the first sample initialises it."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class _AffineFit:
    """Exponentially weighted least-squares fit t ≈ intercept + slope·x with slope ≥ 0.

    Until x has varied, the fit is flat (slope 0 at the mean): a forward pass is taken to cost
    the same for a few more positions, which is true while the model is memory-bound."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.wx = self.wxx = self.wt = self.wxt = 0.0

    def add(self, x: float, t: float) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self.wx = d * self.wx + x
        self.wxx = d * self.wxx + x * x
        self.wt = d * self.wt + t
        self.wxt = d * self.wxt + x * t

    @property
    def empty(self) -> bool:
        return self.w == 0.0

    def coefficients(self) -> tuple[float, float]:
        """(intercept, slope) with slope ≥ 0 and intercept ≥ 0."""
        mx, mt = self.wx / self.w, self.wt / self.w
        var = self.wxx / self.w - mx * mx
        slope = 0.0 if var <= 1e-6 * max(1.0, mx * mx) else (self.wxt / self.w - mx * mt) / var
        slope = max(slope, 0.0)
        intercept = mt - slope * mx
        if intercept < 0.0:  # keep the line through the mean, but never predict < 0 at x = 0
            intercept, slope = 0.0, mt / mx if mx > 0 else 0.0
        return intercept, slope


@dataclass
class RoundTiming:
    """What one round measured (seconds). Worker-reported fields are optional: without them
    the whole call counts as forward time and a verify is taken to compute γ+1 positions."""

    round_s: float
    draft_s: float = 0.0  # wall time of the Propose call (0 when γ = 0)
    verify_s: float = 0.0  # wall time of the Verify call (a Prefill before it included)
    prefill_s: float = 0.0  # of verify_s: a chunked Prefill of a long prefix (a prompt)
    draft_forward_s: float | None = None  # the draft worker's forward time for the γ steps
    draft_queue_s: float = 0.0
    verify_forward_s: float | None = None  # the target's batched forward time
    verify_queue_s: float = 0.0
    batch_size: int = 1  # sessions in that verify pass
    batch_positions: int | None = None  # positions it computed, left padding included
    batch_seq: int | None = None  # that pass's number on its worker: fit each pass once
    worker: str = ""  # the target worker's address
    draft_overlapped: bool = False  # the candidates were drafted ahead (draft_s: waiting only)
    ahead_wait_s: float = 0.0  # after the commit, waiting for the next block drafted ahead
    draft_batch_size: int = 1  # sessions in the draft's pass
    draft_batch_positions: int | None = None  # its first step's positions, padding included

    def check(self) -> None:
        values = [self.round_s, self.draft_s, self.verify_s, self.draft_queue_s]
        values += [self.verify_queue_s, self.draft_forward_s or 0.0, self.verify_forward_s or 0.0]
        values += [self.ahead_wait_s, self.prefill_s]
        if min(values) < 0:
            raise ValueError(f"negative time in {self}")
        if self.prefill_s > self.verify_s:
            raise ValueError(f"prefill_s exceeds verify_s in {self}")
        if self.batch_size < 1 or (self.batch_positions is not None and self.batch_positions < 1):
            raise ValueError(f"batch_size and batch_positions must be >= 1 in {self}")
        if self.draft_batch_size < 1 or (
            self.draft_batch_positions is not None and self.draft_batch_positions < 1
        ):
            raise ValueError(f"draft_batch_size and draft_batch_positions must be >= 1 in {self}")


class _LoadTimings:
    """The estimates that move with the load: one set per load level (`CostModel`)."""

    def __init__(self, decay: float, fit_decay: float) -> None:
        # target forward seconds against positions: passes that verify candidates, and plain
        # decoding passes (one position per session) apart — a one-token step is often
        # cheaper than the line through the longer passes predicts (a CPU's decode path)
        self.verify_fit = _AffineFit(fit_decay)
        self.plain_fit = _AffineFit(fit_decay)
        self.draft_step = _Ewma(decay)  # draft forward seconds per step
        self.batch_size = _Ewma(decay)  # N
        self.draft_queue = _Ewma(decay)  # q_d
        self.verify_queue = _Ewma(decay)  # q_v
        self.draft_net = _Ewma(decay)  # n_d
        self.verify_net = _Ewma(decay)  # n_v
        self.rest = _Ewma(decay)  # r


def _of_the_level(name: str) -> property:
    return property(lambda self: getattr(self.timings[self.level], name))


class CostModel:
    """Timing estimates shared by every session of one coordinator (see `coordinator.policy`).

    What a round costs moves with the load — under load a pass holds more sessions, waits
    longer and competes for the CPUs — so the timing estimates, like the batch plan, are kept
    per load level (`timings`; the attributes below are the current level's): back at a load,
    the sessions plan with what was measured there, not with the last load's figures (a lone
    session after a burst of 16 on the code pair took the burst's costs and decoded at γ = 0,
    probing too rarely to learn otherwise: 0.81× of γ = 4, docs/benchmarks.md). A level seen for
    the first time starts from a copy of the level it comes from. α̂ is shared by all levels.

    Only decoding measures what γ costs, so a prompt's prefill is kept out of the estimates:
    the chunked Prefill a verify call sends first (`RoundTiming.prefill_s`) is not counted as
    its network time (at 16 sessions arriving together each waited ~370 ms for the others'
    prefills on the code pair, and the smoothed network time of the new load level jumped
    above 100 ms — a constant that made candidates look cheap, and the first plan there ran
    at γ = 4–6 where 2 is best: docs/benchmarks.md); a pass whose rows are longer than a
    round's block (`max_gamma` + 2 tokens: γ candidates, the last committed token and a guess
    drafted ahead) holds a short prompt or a taken-over prefix, padding every row to it, and is
    counted (`passes`) but not fitted, nor its queue and network times; a draft call is not
    taken as γ draft steps when a session in its draft pass (itself or another; the pass's
    positions tell, `ProposeResponse.batch_positions`) first caught up on more committed
    tokens than a block (a prompt — the draft computes it in its first Propose, padding the
    pass's first step — or what was committed while the session ran at γ = 0). One rule for
    both tiers' passes: `_decoding`."""

    verify_fit = _of_the_level("verify_fit")
    plain_fit = _of_the_level("plain_fit")
    draft_step = _of_the_level("draft_step")
    batch_size = _of_the_level("batch_size")
    draft_queue = _of_the_level("draft_queue")
    verify_queue = _of_the_level("verify_queue")
    draft_net = _of_the_level("draft_net")
    verify_net = _of_the_level("verify_net")
    rest = _of_the_level("rest")

    def __init__(self, decay: float = 0.9, fit_decay: float = 0.98, max_gamma: int = 8) -> None:
        if not (0.0 < decay <= 1.0 and 0.0 < fit_decay <= 1.0):
            raise ValueError("decay and fit_decay must be in (0, 1]")
        if max_gamma < 0:
            raise ValueError("max_gamma must be >= 0")
        self.max_block = max_gamma + 2  # the longest row a decoding round gives a worker
        self.timings: dict[int, _LoadTimings] = {0: _LoadTimings(decay, fit_decay)}
        self.acceptance = AcceptanceEstimate(0.99)  # over all sessions: a session's prior
        self._last_pass: dict[str, int] = {}  # target worker -> last verify pass fitted
        self.passes = 0  # verify passes fitted so far
        # The γ every batched session uses: one batch plan per load level (`running`, the
        # coordinator's running sessions, when it tells; else one plan for every load)
        self.running: Callable[[], int] | None = None
        self.plans: dict[int, BatchPlan] = {0: BatchPlan()}
        self.level = 0  # the plan in use: log2 of the running sessions, smoothed and rounded
        self._running = _Ewma(decay)

    @property
    def plan(self) -> BatchPlan:
        """The batch plan of the current load level. What the best γ is moves with the load
        (on the code pair on 2 CPU cores γ = 2 at 16 sessions, 5–7 as the last few finish), and measurements
        at one load say nothing against another's: a plan per level — about 2 sessions
        (1.5–2.8), 4 (2.9–5.6), 8, 16, … (the powers of 2 deployments are sized in sit
        mid-level) — keeps what it found there for the next time the load is there, where one
        plan would start every burst from whatever the tail of the last one found."""
        return self.plans[self.level]

    def _track_load(self) -> None:
        """Follow the running sessions' level, smoothed (a session ending as the next begins
        does not switch plans mid-pass) and with a margin of 1/8 past either boundary."""
        if self.running is None:
            return
        self._running.add(max(self.running(), 1))
        load = math.log2(self._running.get(1.0))
        if abs(load - self.level) < 0.5 + 0.17:
            return  # within the level or within 1/8 past its boundaries: no change
        level = max(0, round(load))
        if level not in self.timings:  # a new load: from what the last one measured
            self.timings[level] = copy.deepcopy(self.timings[self.level])
        plan = self.plans.setdefault(level, BatchPlan())
        plan.resume(self.passes)
        self.level = level

    def alpha(self, prior: float, weight: float = 4.0) -> float:
        """α̂ over every session's recent speculative rounds, shrunk towards `prior`."""
        return self.acceptance.value(prior, weight)

    def verify_forward_s(self, positions: float, plain: bool = False) -> float:
        """Predicted target forward time for `positions` positions (prior: 1.0, flat); with
        `plain`, of a plain decoding pass (one position per session). Each fit stands in for
        the other until it has data."""
        fits = (self.plain_fit, self.verify_fit) if plain else (self.verify_fit, self.plain_fit)
        fit = next((f for f in fits if not f.empty), None)
        if fit is None:
            return 1.0
        intercept, slope = fit.coefficients()
        return intercept + slope * positions

    def _decoding(self, positions: int | None, sessions: int) -> bool:
        """Whether a worker's pass of `sessions` rows that computed `positions` (padding
        included; None: not reported) held decoding rounds only: a row longer than a round's
        block (a prompt, a catch-up) pads every row to it."""
        return positions is None or positions <= self.max_block * sessions

    def observe(self, gamma: int, t: RoundTiming) -> None:
        t.check()
        self._track_load()  # first: the round's figures go to the load they were measured at
        v_fwd = t.verify_s - t.prefill_s if t.verify_forward_s is None else t.verify_forward_s
        positions = t.batch_positions or (gamma + 1) * t.batch_size
        # every session of a pass reports it, one after another: fit each pass once (`!=`, not
        # `>`: a restarted worker numbers its passes from 1 again)
        decoding = self._decoding(positions, t.batch_size)
        if t.batch_seq is None or t.batch_seq != self._last_pass.get(t.worker):
            if t.batch_seq is not None:
                self._last_pass[t.worker] = t.batch_seq
            if decoding:
                plain = positions <= t.batch_size
                (self.plain_fit if plain else self.verify_fit).add(positions, v_fwd)
            self.passes += 1
        self.batch_size.add(t.batch_size)
        if decoding:
            if v_fwd > 0:
                self.verify_queue.add(t.verify_queue_s / v_fwd)
            self.verify_net.add(max(t.verify_s - t.prefill_s - t.verify_queue_s - v_fwd, 0.0))
        if gamma > 0 and self._decoding(t.draft_batch_positions, t.draft_batch_size):
            d_fwd = t.draft_s if t.draft_forward_s is None else t.draft_forward_s
            self.draft_step.add(d_fwd / gamma)
            if d_fwd > 0:
                self.draft_queue.add(t.draft_queue_s / d_fwd)
            if not t.draft_overlapped:  # drafted ahead, the call's time hid behind a verify
                self.draft_net.add(max(t.draft_s - t.draft_queue_s - d_fwd, 0.0))
        self.rest.add(max(t.round_s - t.draft_s - t.verify_s - t.ahead_wait_s, 0.0))
