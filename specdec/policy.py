"""Adaptive speculation length: the coordinator's γ when a request leaves it unset.

Policy. Each round `AdaptiveGamma` picks the γ in [0, max_gamma] that maximises the
expected committed tokens per second, E(α̂, γ) / (t_draft(γ) + t_verify(γ) + t_overhead(γ)),
from running per-session estimates (ARCHITECTURE.md's performance model in seconds);
γ = 0 means plain decoding: one verify of one token, one committed token, no draft call.
Every `explore_every`-th round it instead probes a neighbour of that choice (γ±1, or
`explore_gamma` from γ = 0, repeated while probes from 0 accept every candidate), so it keeps
its cost model current and recovers speculation after backing off to 0.

Estimates (all exponentially forgetting, so the policy follows load and text changes):
- α̂ = (a + α₀·w) / (a + r + w): a = accepted candidates, r = rounds that ended in a
  rejection (ARCHITECTURE.md's α̂), both decayed by `alpha_decay` per speculative round, and a
  Beta-style prior of weight w = `prior_weight` centred on α₀ = `prior_alpha`.
- t_draft(γ) = d₀ + d₁·γ and t_verify(γ) = a₀ + a₁·(γ+1): exponentially weighted least
  squares over observed (γ, seconds), slopes clamped at ≥ 0. Until two different γ were seen,
  drafting is assumed proportional to γ (autoregressive) and verify flat in γ (one parallel
  pass, memory-bound). Under load the verify slope grows and the policy backs off.
- t_overhead: round time minus draft and verify time, an EWMA kept separately for γ = 0
  (no Propose call) and γ > 0 rounds; each falls back to the other until observed.
Before any timing arrives, costs are relative to one verify: drafting a token costs
`prior_draft_ratio` of it and overhead is 0, so the first rounds use a moderate γ.
"""

from __future__ import annotations

from specdec.perf_model import expected_tokens


class _Ewma:
    """Exponentially weighted mean; the first sample initialises it."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x


class _AffineFit:
    """Exponentially weighted least-squares fit t ≈ intercept + slope·x with slope ≥ 0."""

    def __init__(self, decay: float, proportional_fallback: bool) -> None:
        self.decay = decay
        self.proportional_fallback = proportional_fallback  # else: flat fallback
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

    def predict(self, x: float) -> float:
        mx, mt = self.wx / self.w, self.wt / self.w
        var = self.wxx / self.w - mx * mx
        if var <= 1e-6:  # a single x seen so far: fall back to the physical prior
            return mt / mx * x if self.proportional_fallback else mt
        slope = max((self.wxt / self.w - mx * mt) / var, 0.0)
        return max(mt + slope * (x - mx), 0.0)


class AdaptiveGamma:
    """Per-session γ policy maximising expected tokens per second (see module docstring)."""

    def __init__(
        self,
        max_gamma: int,
        prior_alpha: float = 0.6,
        prior_weight: float = 2.0,
        *,
        alpha_decay: float = 0.98,
        time_decay: float = 0.9,
        explore_every: int = 16,
        explore_gamma: int = 2,
        prior_draft_ratio: float = 0.1,
    ) -> None:
        if max_gamma < 0 or explore_every < 0 or explore_gamma < 0:
            raise ValueError("max_gamma, explore_every and explore_gamma must be >= 0")
        if not 0.0 <= prior_alpha <= 1.0 or prior_weight < 0:
            raise ValueError("prior_alpha must be in [0, 1] and prior_weight >= 0")
        if not (0.0 < alpha_decay <= 1.0 and 0.0 < time_decay <= 1.0):
            raise ValueError("alpha_decay and time_decay must be in (0, 1]")
        self.max_gamma = max_gamma
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.alpha_decay = alpha_decay
        self.explore_every = explore_every
        self.explore_gamma = explore_gamma
        self.prior_draft_ratio = prior_draft_ratio
        self._accepted = 0.0  # decayed accepted candidates
        self._rejections = 0.0  # decayed rounds that ended in a rejection
        self._draft = _AffineFit(time_decay, proportional_fallback=True)  # x = γ
        self._verify = _AffineFit(time_decay, proportional_fallback=False)  # x = γ + 1
        self._overhead = {False: _Ewma(time_decay), True: _Ewma(time_decay)}  # by γ > 0
        self._calls = 0
        self._probes = 0
        self._probing_from_zero = False
        self._probe_again = False

    @property
    def alpha(self) -> float:
        """α̂: acceptance estimate with its prior."""
        num = self._accepted + self.prior_alpha * self.prior_weight
        den = self._accepted + self._rejections + self.prior_weight
        return self.prior_alpha if den == 0 else num / den

    def verify_s(self, gamma: int) -> float:
        """Predicted verify time of γ+1 tokens (prior: 1.0 per verify)."""
        return 1.0 if self._verify.empty else self._verify.predict(gamma + 1)

    def draft_s(self, gamma: int) -> float:
        """Predicted time to draft γ candidates; 0 for γ = 0 (no draft call)."""
        if gamma == 0:
            return 0.0
        if self._draft.empty:
            return self.prior_draft_ratio * gamma * self.verify_s(0)
        return self._draft.predict(gamma)

    def overhead_s(self, gamma: int) -> float:
        """Predicted round time outside draft and verify (network, commit)."""
        own, other = self._overhead[gamma > 0].value, self._overhead[gamma == 0].value
        return own if own is not None else (other if other is not None else 0.0)

    def round_s(self, gamma: int) -> float:
        """Predicted wall time of one round with γ candidates."""
        return self.draft_s(gamma) + self.verify_s(gamma) + self.overhead_s(gamma)

    def expected_rate(self, gamma: int) -> float:
        """Expected committed tokens per second with γ candidates."""
        return expected_tokens(self.alpha, gamma) / max(self.round_s(gamma), 1e-12)

    def best_gamma(self) -> int:
        """The γ in [0, max_gamma] maximising `expected_rate`; ties go to the smaller γ."""
        best, best_rate = 0, self.expected_rate(0)
        for gamma in range(1, self.max_gamma + 1):
            rate = self.expected_rate(gamma)
            if rate > best_rate * (1 + 1e-12):
                best, best_rate = gamma, rate
        return best

    def choose(self) -> int:
        """γ for the next round: `best_gamma`, or on exploration rounds a probe next to it."""
        best = self.best_gamma()
        self._calls += 1
        probe_again, self._probe_again = self._probe_again, False
        self._probing_from_zero = False
        if best == 0 and (probe_again or self._explore_now()):
            self._probing_from_zero = True
            return min(self.explore_gamma, self.max_gamma)
        if best > 0 and self._explore_now():
            self._probes += 1
            up, down = min(best + 1, self.max_gamma), best - 1
            return up if self._probes % 2 == 1 and up != best else down
        return best

    def _explore_now(self) -> bool:
        return self.explore_every > 0 and self._calls % self.explore_every == 0

    def observe(
        self,
        gamma: int,
        accepted: int,
        rejected: bool,
        draft_s: float,
        verify_s: float,
        round_s: float,
    ) -> None:
        """Record one finished round: candidates accepted, whether one was rejected, timings.

        `draft_s`: drafting the γ candidates (0 when γ = 0); `verify_s`: verifying γ+1 tokens;
        `round_s`: the whole round's wall time, including network and commit.
        """
        if gamma < 0 or not 0 <= accepted <= gamma or rejected != (accepted < gamma):
            raise ValueError(
                f"inconsistent round: gamma={gamma}, accepted={accepted}, rejected={rejected}"
            )
        if min(draft_s, verify_s, round_s) < 0:
            raise ValueError(f"negative time: {draft_s=}, {verify_s=}, {round_s=}")
        if gamma > 0:
            d = self.alpha_decay
            self._accepted = d * self._accepted + accepted
            self._rejections = d * self._rejections + float(rejected)
            self._draft.add(gamma, draft_s)
        self._verify.add(gamma + 1, verify_s)
        self._overhead[gamma > 0].add(max(round_s - draft_s - verify_s, 0.0))
        self._probe_again = self._probing_from_zero and gamma > 0 and not rejected
        self._probing_from_zero = False
