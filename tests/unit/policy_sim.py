"""A simulated session for the adaptive γ policy's tests: known acceptance and affine costs."""

import random

from coordinator.cost_model import RoundTiming
from coordinator.policy import AdaptiveGamma
from specdec.core.perf_model import expected_tokens


class Sim:
    """A session with per-token acceptance α and affine draft/verify costs (seconds).

    The verify pass holds `batch` sessions that all choose the same γ: it computes
    batch·(γ+1) positions at `verify_per_token` seconds each."""

    def __init__(
        self,
        alpha,
        draft_per_token,
        verify_base,
        verify_per_token,
        overhead,
        seed=0,
        batch=1,
        draft_fixed=0.0,
    ):
        self.alpha = alpha
        self.draft_per_token = draft_per_token
        self.draft_fixed = draft_fixed
        self.verify_base = verify_base
        self.verify_per_token = verify_per_token
        self.overhead = overhead
        self.batch = batch
        self.rng = random.Random(seed)

    def round(self, policy: AdaptiveGamma, gamma: int) -> None:
        accepted = 0
        while accepted < gamma and self.rng.random() < self.alpha:
            accepted += 1
        policy.observe(gamma, accepted, accepted < gamma, self.timing(gamma))

    def timing(self, gamma: int) -> RoundTiming:
        draft_fwd = gamma * self.draft_per_token
        draft = self.draft_fixed + draft_fwd if gamma else 0.0
        positions = self.batch * (gamma + 1)
        verify = self.verify_base + self.verify_per_token * positions
        return RoundTiming(
            round_s=draft + verify + self.overhead,
            draft_s=draft,
            verify_s=verify,
            draft_forward_s=draft_fwd if gamma else None,
            verify_forward_s=verify,
            batch_size=self.batch,
            batch_positions=positions,
        )

    def rate(self, gamma: int) -> float:
        """True expected tokens per second of the batch at this γ."""
        return expected_tokens(self.alpha, gamma) / self.timing(gamma).round_s

    def run(self, policy: AdaptiveGamma, rounds: int) -> list[int]:
        chosen = []
        for _ in range(rounds):
            gamma = policy.choose()
            assert 0 <= gamma <= policy.max_gamma
            self.round(policy, gamma)
            chosen.append(gamma)
        return chosen
