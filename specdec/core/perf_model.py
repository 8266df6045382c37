"""The performance model of speculative decoding (docs/architecture.md, "Performance model").

All costs are in units of one target step: the time the target takes to decode ONE token
on its own, in-process. With that unit:

- α: per-token acceptance probability; γ: candidates per round (`num_speculative_tokens`).
- c = draft step / target step.
- v = verify of γ+1 tokens / target step. **v is a function of γ**: v(0) = 1 by definition
  (verifying one token is a plain target step); while the target is memory-bound v(γ) ≈ 1
  for small γ, and once it is compute-bound (large γ, large batches, load) v grows about
  linearly, v(γ) ≈ 1 + m·γ (`verify_cost`). Callers pass the v of the γ they ask about.
- ρ = network + coordination time per round / target step (ρ_d, ρ_v: the draft and verify
  legs separately, for the pipelined model).

Speedups are relative to the target decoding alone in-process (1 token per target step).
γ = 0 means speculation off: one target step plus the round's overhead, S = 1 / (1 + ρ),
so a served plain decode is slightly slower than the in-process baseline.
"""

from __future__ import annotations

import math


def _check(alpha: float, gamma: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per round, E = (1 − α^(γ+1)) / (1 − α): accepted + recovered/bonus.

    Equals γ + 1 at α = 1 and 1 at α = 0 (or γ = 0).
    """
    _check(alpha, gamma)
    if 1.0 - alpha < 1e-6:  # the closed form cancels badly near α = 1: sum the series
        return math.fsum(alpha**i for i in range(gamma + 1))
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def verify_cost(gamma: int, marginal: float = 0.0) -> float:
    """Affine verify cost v(γ) = 1 + marginal·γ, so that v(0) = 1 (a plain target step)."""
    if gamma < 0 or marginal < 0:
        raise ValueError(f"gamma and marginal must be >= 0, got {gamma}, {marginal}")
    return 1.0 + marginal * gamma


def speedup_sync(alpha: float, gamma: int, c: float, v: float, rho: float) -> float:
    """Synchronous speedup S = E / (γ·c + v + ρ); speculation pays only while S > 1.

    `v` is the verify cost at this γ; at γ = 0 it is 1 by definition and the argument is
    ignored, so S(γ=0) = 1 / (1 + ρ).
    """
    _check(alpha, gamma)
    if gamma == 0:
        return 1.0 / (1.0 + rho)
    return expected_tokens(alpha, gamma) / (gamma * c + v + rho)


def speedup_pipelined(
    alpha: float, gamma: int, c: float, v: float, rho_d: float, rho_v: float
) -> float:
    """Pipelined speedup (draft the next block while the target verifies this one).

    With A = γ·c + ρ_d (draft leg) and B = v + ρ_v (verify leg), the legs overlap only when
    all γ candidates are accepted (probability α^γ), otherwise the next block is redrafted:
    S ≈ E / (α^γ·max(A, B) + (1 − α^γ)·(A + B)). At γ = 0 there is no draft leg:
    S = 1 / (1 + ρ_v).
    """
    _check(alpha, gamma)
    if gamma == 0:
        return 1.0 / (1.0 + rho_v)
    draft_leg = gamma * c + rho_d
    verify_leg = v + rho_v
    p_all = alpha**gamma
    round_cost = p_all * max(draft_leg, verify_leg) + (1.0 - p_all) * (draft_leg + verify_leg)
    return expected_tokens(alpha, gamma) / round_cost


def speedup_draft_ahead(
    alpha: float, gamma: int, c: float, v: float, rho_d: float, rho_v: float
) -> float:
    """Speedup of specdec's pipelined rounds (coordinator `--pipeline`), in target steps.

    Each round with candidates also drafts the next block while the target verifies: the
    draft's guess of the bonus token, then γ candidates after it — a leg of
    A' = (γ+1)·c + ρ_d that overlaps B = v + ρ_v. The next round skips its own draft leg
    A = γ·c + ρ_d when this one accepted all γ candidates and the guess equals the bonus
    token, taken as likely as one more accepted candidate: p = α^(γ+1). A discarded block is
    waited for (not cancelled), so a round costs (1 − p)·A + max(A', B) on average:
    S = E / ((1 − p)·A + max(A', B)). Unlike `speedup_pipelined` (the architecture's
    idealised form) a round always pays the longer of the two overlapped legs, and the
    guess makes a hit one acceptance rarer. At γ = 0 nothing is drafted: S = 1 / (1 + ρ_v).
    """
    _check(alpha, gamma)
    if gamma == 0:
        return 1.0 / (1.0 + rho_v)
    hit = alpha ** (gamma + 1)
    draft_leg = gamma * c + rho_d
    ahead_leg = (gamma + 1) * c + rho_d
    round_cost = (1.0 - hit) * draft_leg + max(ahead_leg, v + rho_v)
    return expected_tokens(alpha, gamma) / round_cost


def estimate_alpha(accepted: int, rejected_rounds: int, default: float = 0.0) -> float:
    """α̂ = accepted / (accepted + rounds that ended in a rejection); `default` without data.

    The maximum-likelihood estimate of a per-token acceptance probability when each round
    stops at its first rejection (rounds that accept every candidate are censored).
    """
    if accepted < 0 or rejected_rounds < 0:
        raise ValueError(
            f"accepted and rejected_rounds must be >= 0, got {accepted}, {rejected_rounds}"
        )
    total = accepted + rejected_rounds
    return default if total == 0 else accepted / total


def optimal_gamma_sync(
    alpha: float, c: float, rho: float, max_gamma: int, marginal_verify: float = 0.0
) -> int:
    """The γ in [0, max_gamma] with the largest `speedup_sync`, v(γ) from `verify_cost`.

    Ties go to the smaller γ.
    """
    speedups = [
        speedup_sync(alpha, g, c, verify_cost(g, marginal_verify), rho)
        for g in range(max_gamma + 1)
    ]
    return max(range(max_gamma + 1), key=lambda g: (speedups[g], -g))
