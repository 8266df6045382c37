"""α̂, the acceptance estimate: accepted / (accepted + rounds that ended in a rejection).

One estimator for every place that needs it (docs/architecture.md, "Vocabulary"): a request's
statistics (no decay), a session's adaptive-γ estimate and the coordinator-wide prior (both
decayed per speculative round, so they follow the text as it changes). With a prior of weight
w centred on α₀ the estimate is (a + α₀·w) / (a + r + w), a Beta-style shrinkage.
"""

from __future__ import annotations


def alpha_hat(accepted: float, rejections: float, prior: float = 0.0, weight: float = 0.0) -> float:
    """(accepted + prior·weight) / (accepted + rejections + weight); `prior` when undefined."""
    den = accepted + rejections + weight
    return prior if den == 0 else (accepted + prior * weight) / den


class AcceptanceEstimate:
    """Decayed counts of accepted candidates and of rounds that ended in a rejection."""

    def __init__(self, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self.accepted = 0.0
        self.rejections = 0.0

    def observe(self, accepted: int, rejected: bool) -> None:
        """One speculative round: `accepted` candidates, and whether one was rejected."""
        self.accepted = self.decay * self.accepted + accepted
        self.rejections = self.decay * self.rejections + float(rejected)

    def value(self, prior: float = 0.0, weight: float = 0.0) -> float:
        return alpha_hat(self.accepted, self.rejections, prior, weight)
