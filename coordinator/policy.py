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
the same workers and network, so a new session starts informed), one set per load level like the
batch plans (back at a load, its sessions plan with what was measured there); α̂ is per session:
α̂ = (a + α₀·w) / (a + r + w), a = accepted candidates, r = rounds that ended in a rejection
(the one estimator, `specdec.core.acceptance`), both decayed by `alpha_decay` per speculative round, with a Beta-style
prior of weight w = `prior_weight` centred on α₀ = `prior_alpha`. All estimates forget
exponentially, so the policy follows load and text as they change. Before any timing arrives,
costs are relative to one verify forward: a draft step costs `prior_draft_ratio` of it and
everything else is free, so the first rounds use a moderate γ.
"""

from __future__ import annotations

from coordinator.batch_plan import BatchPlan
from coordinator.cost_model import CostModel, RoundTiming
from specdec.core.acceptance import AcceptanceEstimate
from specdec.core.perf_model import expected_tokens

FIRST_ROUNDS = 2  # a session's first rounds, which the batch plan does not measure


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
        # the batch plan that chose the next round's γ, and its ticket for the round
        self._ticket: tuple[BatchPlan, int, bool] | None = None
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
            plan = self.costs.plan
            window, settled = plan.ticket(self.costs.passes)
            # a session's first rounds (its prompt's prefill, joining a batch) do not count,
            # nor its first round at a new γ: from γ = 0 the draft first catches up on every
            # token committed meanwhile (and pads its pass with them), a cost of the switch —
            # paid by every probe up from 0 and by none down to it — not of the γ
            same = self._planned == gamma
            self._planned = gamma
            self._ticket = plan, window, settled and same and self._calls > FIRST_ROUNDS
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
            + (
                f"; level {c.level} {c.plan.describe(self.planning_alpha())}"
                if self.batched()
                else ""
            )
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
            plan, window, settled = self._ticket
            plan.observe((window, settled), chosen, timing.round_s)
            self._ticket = None
        if gamma > 0:
            self._acceptance.observe(accepted, rejected)
            self.costs.acceptance.observe(accepted, rejected)
        self._probe_again = self._probing_from_zero and gamma > 0 and not rejected
        if self._probing_from_zero and gamma > 0 and accepted > 0:
            self._zero_period = self.explore_every  # some acceptance: keep looking as often
        self._probing_from_zero = False
