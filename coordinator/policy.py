"""Adaptive speculation length: the coordinator's γ when a request leaves it unset.

Policy. Sessions that share verify passes use one γ, the batch plan (`BatchPlan`: measured
rates per γ, held for windows of passes, with probes); a session alone, each round,
`AdaptiveGamma` picks the γ in [0, max_gamma] that maximises the expected
committed tokens per second of the WHOLE batch it shares, E(α̂, γ) / round(γ) - the synchronous
form of the performance model (docs/architecture.md), S = E / (γ·c + v + ρ), in seconds. γ = 0 means plain
decoding: one verify of one token, one committed token, no draft call. Every `explore_every`-th
round it instead probes a neighbour of that choice (γ±1; γ = 0 while plain decoding has not
been measured and on every 8th probe, so its cost is measured rather than extrapolated), so the
cost fits see several γ. From γ = 0 it probes the best γ > 0 (`explore_gamma` until the
costs are measured), first after `explore_every`
rounds, then after twice as many each time a probe's first candidate is rejected (up to 8
times: where speculation does not pay, probing costs little; a probe that accepts some resets
it), repeated at once while probes from 0 accept every candidate, so the policy recovers
speculation when the text gets predictable.

Round time, from what each round measures and what the workers report (forward and queue time
of their batched passes, and how many positions the verify pass computed):

    round(γ) = r + [γ > 0]·(n_d + (1 + q_d)·γ·s)  +  n_v + (1 + q_v)·(a + b·N·(γ + 1))

- s: the draft's time per step (its forward time / γ) - c·(target step) in the model;
- a + b·P: the target's forward time for P positions (a weighted least-squares fit over the
  verify passes with candidates the coordinator saw — plain decoding passes, one position per
  session, have a fit of their own: a one-token step often costs less than that line says — each counted once however many of its sessions report it;
  batches of many sizes and the probes make it well conditioned);
- N: sessions per verify batch. With N sessions choosing alike, one more candidate costs the
  batch N positions, so the verify slope a session sees is b·N, not b: this is what makes γ back
  off under load, when the target is compute-bound and the batch is big;
- q_d, q_v: time queued for a batch relative to the forward (the previous batch's forward, which
  scales with γ like this one's); n_d, n_v: the rest of each call (network, (de)serialisation,
  KV sync); r: the rest of the round (commit to Redis, streaming).

The timing estimates live in a `CostModel` shared by all sessions of a coordinator (they measure
the same workers and network, so a new session starts informed); α̂ is per session:
α̂ = (a + α₀·w) / (a + r + w), a = accepted candidates, r = rounds that ended in a rejection
(the one estimator, `specdec.core.acceptance`), both decayed by `alpha_decay` per speculative round, with a Beta-style
prior of weight w = `prior_weight` centred on α₀ = `prior_alpha`. All estimates forget
exponentially, so the policy follows load and text as they change. Before any timing arrives,
costs are relative to one verify forward: a draft step costs `prior_draft_ratio` of it and
everything else is free, so the first rounds use a moderate γ.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.batch_plan import BatchPlan
from specdec.core.acceptance import AcceptanceEstimate
from specdec.core.perf_model import expected_tokens

FIRST_ROUNDS = 2  # a session's first rounds, which the batch plan does not measure


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
    verify_s: float = 0.0  # wall time of the Verify call
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

    def check(self) -> None:
        values = [self.round_s, self.draft_s, self.verify_s, self.draft_queue_s]
        values += [self.verify_queue_s, self.draft_forward_s or 0.0, self.verify_forward_s or 0.0]
        values.append(self.ahead_wait_s)
        if min(values) < 0:
            raise ValueError(f"negative time in {self}")
        if self.batch_size < 1 or (self.batch_positions is not None and self.batch_positions < 1):
            raise ValueError(f"batch_size and batch_positions must be >= 1 in {self}")


class CostModel:
    """Timing estimates shared by every session of one coordinator (see the module docstring)."""

    def __init__(self, decay: float = 0.9, fit_decay: float = 0.98) -> None:
        if not (0.0 < decay <= 1.0 and 0.0 < fit_decay <= 1.0):
            raise ValueError("decay and fit_decay must be in (0, 1]")
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
        self.acceptance = AcceptanceEstimate(0.99)  # over all sessions: a session's prior
        self._last_pass: dict[str, int] = {}  # target worker -> last verify pass fitted
        self.passes = 0  # verify passes fitted so far
        self.plan = BatchPlan()  # the γ every batched session uses

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

    def observe(self, gamma: int, t: RoundTiming) -> None:
        t.check()
        v_fwd = t.verify_s if t.verify_forward_s is None else t.verify_forward_s
        positions = t.batch_positions or (gamma + 1) * t.batch_size
        # every session of a pass reports it, one after another: fit each pass once (`!=`, not
        # `>`: a restarted worker numbers its passes from 1 again)
        if t.batch_seq is None or t.batch_seq != self._last_pass.get(t.worker):
            if t.batch_seq is not None:
                self._last_pass[t.worker] = t.batch_seq
            plain = positions <= t.batch_size
            (self.plain_fit if plain else self.verify_fit).add(positions, v_fwd)
            self.passes += 1
        self.batch_size.add(t.batch_size)
        if v_fwd > 0:
            self.verify_queue.add(t.verify_queue_s / v_fwd)
        self.verify_net.add(max(t.verify_s - t.verify_queue_s - v_fwd, 0.0))
        if gamma > 0:
            d_fwd = t.draft_s if t.draft_forward_s is None else t.draft_forward_s
            self.draft_step.add(d_fwd / gamma)
            if d_fwd > 0:
                self.draft_queue.add(t.draft_queue_s / d_fwd)
            if not t.draft_overlapped:  # drafted ahead, the call's time hid behind a verify
                self.draft_net.add(max(t.draft_s - t.draft_queue_s - d_fwd, 0.0))
        self.rest.add(max(t.round_s - t.draft_s - t.verify_s - t.ahead_wait_s, 0.0))


class AdaptiveGamma:
    """Per-session γ policy maximising expected tokens per second (see module docstring)."""

    def __init__(
        self,
        max_gamma: int,
        costs: CostModel | None = None,
        prior_alpha: float = 0.6,
        prior_weight: float = 4.0,
        *,
        alpha_decay: float = 0.98,
        explore_every: int = 8,
        explore_gamma: int = 2,
        prior_draft_ratio: float = 0.1,
    ) -> None:
        if max_gamma < 0 or explore_every < 0 or explore_gamma < 0:
            raise ValueError("max_gamma, explore_every and explore_gamma must be >= 0")
        if not 0.0 <= prior_alpha <= 1.0 or prior_weight < 0:
            raise ValueError("prior_alpha must be in [0, 1] and prior_weight >= 0")
        self.max_gamma = max_gamma
        self.costs = costs if costs is not None else CostModel()
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.explore_every = explore_every
        self.explore_gamma = explore_gamma
        self.prior_draft_ratio = prior_draft_ratio
        self._acceptance = AcceptanceEstimate(alpha_decay)  # this session's rounds
        self._calls = 0
        self._probes = 0
        self._probing_from_zero = False
        self._probe_again = False
        self._zero_rounds = 0  # rounds at γ = 0 since the last probe from 0
        self._zero_period = explore_every  # rounds between probes from 0 (doubling, capped)
        self.pipeline = "off"  # on | auto | off: rounds draft the next block during a verify
        self._ticket: tuple[int, bool] | None = None  # the batch plan's, for the next round
        self._planned: int | None = None  # the plan's γ this session's last round used

    @property
    def alpha(self) -> float:
        """α̂: this session's acceptance, shrunk towards the coordinator-wide α̂ (the prior)."""
        return self._acceptance.value(self.costs.alpha(self.prior_alpha), self.prior_weight)

    def verify_s(self, gamma: int) -> float:
        """Predicted wall time of this session's Verify call with γ candidates, load included."""
        c = self.costs
        n = c.batch_size.get(1.0)
        forward = c.verify_forward_s(n * (gamma + 1), plain=gamma == 0)
        return c.verify_net.get(0.0) + (1.0 + c.verify_queue.get(0.0)) * forward

    def draft_s(self, gamma: int) -> float:
        """Predicted wall time to draft γ candidates; 0 for γ = 0 (no draft call)."""
        if gamma == 0:
            return 0.0
        c = self.costs
        prior = self.prior_draft_ratio * c.verify_forward_s(c.batch_size.get(1.0), plain=True)
        step = c.draft_step.get(prior)
        return c.draft_net.get(0.0) + (1.0 + c.draft_queue.get(0.0)) * gamma * step

    def round_s(self, gamma: int) -> float:
        """Predicted wall time of one round with γ candidates.

        Pipelined (`self.pipeline` on; auto: where it pays, `pipelining_pays`), each round with candidates also drafts the next block
        (the guess of the bonus token and γ candidates after it) while the target verifies:
        that leg, A = draft_s(γ + 1), overlaps the verify and the commit, B = verify_s(γ) + r,
        and the next round skips its own draft when this one accepted every candidate and
        the guess was right — probability α^(γ+1), taking the guess as likely as one more
        accepted candidate. Expected: (1 − α^(γ+1))·draft_s(γ) + max(A, B)
        (`specdec.core.perf_model.speedup_draft_ahead` in target steps)."""
        sync = self.sync_round_s(gamma)
        if self.pipeline == "off" or gamma == 0:
            return sync
        pipelined = self.pipelined_round_s(gamma)
        return pipelined if self.pipeline == "on" else min(sync, pipelined)

    def sync_round_s(self, gamma: int) -> float:
        """`round_s` of a round that drafts, then verifies, then commits."""
        return self.draft_s(gamma) + self.verify_s(gamma) + self.costs.rest.get(0.0)

    def pipelined_round_s(self, gamma: int) -> float:
        """`round_s` of a round that drafts the next block during its verify (see there)."""
        hit = self.planning_alpha() ** (gamma + 1)
        ahead = max(self.draft_s(gamma + 1), self.verify_s(gamma) + self.costs.rest.get(0.0))
        return (1.0 - hit) * self.draft_s(gamma) + ahead

    def pipelining_pays(self, gamma: int) -> bool:
        """Whether drafting ahead is predicted to shorten rounds of γ candidates: only while
        the next block's draft hides behind the verify and the commit, or nearly so."""
        return gamma > 0 and self.pipelined_round_s(gamma) < self.sync_round_s(gamma)

    def planning_alpha(self) -> float:
        """The α̂ γ is planned with: the session's own when it verifies alone; in batches (N ≥
        1.5) the coordinator-wide α̂, so that the sessions sharing a pass choose the same γ (a
        pass computes N x the LONGEST block: mixed γ would pad every session to the largest)."""
        if self.batched():
            return self.costs.alpha(self.prior_alpha)
        return self.alpha

    def expected_rate(self, gamma: int) -> float:
        """Expected committed tokens per second with γ candidates."""
        return expected_tokens(self.planning_alpha(), gamma) / max(self.round_s(gamma), 1e-12)

    def batched(self) -> bool:
        return self.costs.batch_size.get(1.0) >= 1.5

    def best_gamma(self) -> int:
        """The γ in [0, max_gamma] maximising `expected_rate`; ties go to the smaller γ.

        In batches, the batch plan's best measured γ instead (`BatchPlan`), one for every
        session: the cost model's forecast of a whole batch misses how sessions fall into
        passes, and per-session choices would mix γ within one pass."""
        if not self.batched():
            return self._argmax()
        self._plan()
        return min(self.costs.plan.best, self.max_gamma)

    def _plan(self) -> int:
        """The batch plan's γ for this window (`BatchPlan`)."""
        c = self.costs
        return c.plan.current(c.passes, self.planning_alpha(), self.max_gamma, self._argmax)

    def _argmax(self, low: int = 0) -> int:
        """The γ in [low, max_gamma] with the largest `expected_rate` (ties: the smaller)."""
        low = min(low, self.max_gamma)
        best, best_rate = low, self.expected_rate(low)
        for gamma in range(low + 1, self.max_gamma + 1):
            rate = self.expected_rate(gamma)
            if rate > best_rate * (1 + 1e-12):
                best, best_rate = gamma, rate
        return best

    def choose(self) -> int:
        """γ for the next round: `best_gamma`, or on exploration rounds a probe next to it;
        in batches the plan's γ for this window (which is the plan's probe in some)."""
        self._calls += 1
        self._ticket = None
        if self.batched():
            gamma = self._plan()
            window, settled = self.costs.plan.ticket(self.costs.passes)
            # a session's first rounds (its prompt's prefill, joining a batch) do not count,
            # nor its first round at a new γ: from γ = 0 the draft first catches up on every
            # token committed meanwhile (and pads its pass with them), a cost of the switch —
            # paid by every probe up from 0 and by none down to it — not of the γ
            same = self._planned == gamma
            self._planned = gamma
            self._ticket = window, settled and same and self._calls > FIRST_ROUNDS
            return gamma
        self._planned = None
        best = self._argmax()
        probe_again, self._probe_again = self._probe_again, False
        self._probing_from_zero = False
        if best == 0:
            self._zero_rounds += 1
            if probe_again or self._probe_from_zero_now():
                self._probing_from_zero = True
                return self._probe_gamma()
            return 0
        self._zero_rounds, self._zero_period = 0, self.explore_every
        if self._explore_now():
            self._probes += 1
            if self.costs.plain_fit.empty or self._probes % 8 == 0:
                return 0  # what plain decoding costs, measured (every 8th probe keeps it current)
            up, down = min(best + 1, self.max_gamma), best - 1
            return up if self._probes % 2 == 1 and up != best else down
        return best

    def _probe_gamma(self) -> int:
        """γ of a probe from 0: the best γ > 0 once draft and candidate verify passes have
        been measured (the probe then tests the γ that would be chosen, with as many
        candidates as it would verify), else `explore_gamma`."""
        if self.costs.verify_fit.empty or self.costs.draft_step.value is None:
            return min(self.explore_gamma, self.max_gamma)
        return self._argmax(low=1)

    def _probe_from_zero_now(self) -> bool:
        """At γ = 0 the first probe comes after `explore_every` rounds (N times more in
        batches of N), and each probe whose first candidate is rejected doubles the wait, up
        to 8 times (one that accepts some resets it): where speculation does not pay, probing
        must not cost more than a few per cent, and where it does a probe soon accepts."""
        if self.explore_every == 0:
            return False
        period = self._zero_period * max(1, round(self.costs.batch_size.get(1.0)))
        if self._zero_rounds < period:
            return False
        self._zero_rounds = 0
        self._zero_period = min(2 * self._zero_period, 8 * self.explore_every)
        return True

    def _explore_now(self) -> bool:
        """Every `explore_every`-th round alone; N times rarer in batches of N sessions (the
        fits are shared, and a probe's longer block pads the whole batch's verify pass)."""
        if self.explore_every == 0:
            return False
        period = self.explore_every * max(1, round(self.costs.batch_size.get(1.0)))
        return self._calls % period == 0

    def describe(self) -> str:
        """The estimates behind the choice, for a debug log line."""
        c = self.costs
        a, b = c.verify_fit.coefficients() if not c.verify_fit.empty else (1.0, 0.0)
        ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
        rates = " ".join(f"{g}:{self.expected_rate(g):.1f}" for g in range(self.max_gamma + 1))
        return (
            f"α̂={self.alpha:.3f} verify={ms(a)}+{ms(b)}·P ms N={c.batch_size.get(1.0):.1f} "
            f"draft step={ms(c.draft_step.get(0.0))} ms queue d/v={c.draft_queue.get(0.0):.2f}/"
            f"{c.verify_queue.get(0.0):.2f} net d/v={ms(c.draft_net.get(0.0))}/"
            f"{ms(c.verify_net.get(0.0))} ms rest={ms(c.rest.get(0.0))} ms; tokens/s by γ {rates}"
            + (f"; {c.plan.describe(self.planning_alpha())}" if self.batched() else "")
        )

    def observe(
        self,
        gamma: int,
        accepted: int,
        rejected: bool,
        timing: RoundTiming,
        asked: int | None = None,
    ) -> None:
        """Record one finished round: candidates accepted, whether one was rejected, timings.
        `gamma` counts the candidates verified; `asked`, the γ chosen for the round (more when
        the draft stopped early, --draft-confidence): the batch plan measures the γ it chose."""
        if gamma < 0 or not 0 <= accepted <= gamma or rejected != (accepted < gamma):
            raise ValueError(
                f"inconsistent round: gamma={gamma}, accepted={accepted}, rejected={rejected}"
            )
        self.costs.observe(gamma, timing)
        if self._ticket is not None:
            chosen = gamma if asked is None else asked
            self.costs.plan.observe(self._ticket, chosen, timing.round_s)
            self._ticket = None
        if gamma > 0:
            self._acceptance.observe(accepted, rejected)
            self.costs.acceptance.observe(accepted, rejected)
        self._probe_again = self._probing_from_zero and gamma > 0 and not rejected
        if self._probing_from_zero and gamma > 0 and accepted > 0:
            self._zero_period = self.explore_every  # some acceptance: keep looking as often
        self._probing_from_zero = False
