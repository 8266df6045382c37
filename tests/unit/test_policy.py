"""The adaptive γ policy of one session against simulated rounds with known costs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_sim import Sim

from coordinator.cost_model import RoundTiming
from coordinator.policy import AdaptiveGamma


def test_fresh_policy_starts_with_a_moderate_gamma():
    policy = AdaptiveGamma(max_gamma=8)
    assert policy.alpha == 0.6
    assert 2 <= policy.best_gamma() <= 4
    assert AdaptiveGamma(max_gamma=0).choose() == 0


def test_picks_zero_for_low_alpha_and_expensive_draft():
    policy = AdaptiveGamma(max_gamma=8)
    Sim(0.05, draft_per_token=0.006, verify_base=0.01, verify_per_token=0.0, overhead=0.001).run(
        policy, 200
    )
    assert policy.alpha < 0.15  # from the prior 0.6, with the few probes a losing γ gets
    assert policy.best_gamma() == 0


def test_picks_large_gamma_for_high_alpha_cheap_draft_flat_verify():
    policy = AdaptiveGamma(max_gamma=8)
    chosen = Sim(0.95, 0.0002, 0.02, 0.0, 0.001).run(policy, 200)
    assert policy.alpha > 0.85
    assert policy.best_gamma() >= 7
    assert sum(g >= 7 for g in chosen[-50:]) >= 40


def test_backs_off_when_verify_grows_steeply_with_gamma():
    flat = AdaptiveGamma(max_gamma=8)
    Sim(0.8, 0.001, 0.02, 0.0, 0.002, seed=1).run(flat, 200)
    loaded = AdaptiveGamma(max_gamma=8)
    chosen = Sim(0.8, 0.001, 0.01, 0.01, 0.002, seed=1).run(loaded, 200)
    assert flat.best_gamma() >= 6
    assert loaded.best_gamma() <= 3
    assert loaded.verify_s(4) - loaded.verify_s(3) == pytest.approx(0.01)  # slope was learned
    assert sum(chosen[-50:]) / 50 <= 3.5


def test_backs_off_when_load_arrives_mid_session():
    policy = AdaptiveGamma(max_gamma=8)
    Sim(0.8, 0.001, 0.02, 0.0, 0.002).run(policy, 100)
    before = policy.best_gamma()
    Sim(0.8, 0.001, 0.01, 0.01, 0.002).run(policy, 200)
    assert before >= 6 and policy.best_gamma() <= 3


def test_recovers_from_zero_via_exploration():
    policy = AdaptiveGamma(max_gamma=8)
    bad = Sim(0.02, 0.003, 0.01, 0.0, 0.001)
    assert bad.run(policy, 300)[-20:].count(0) >= 18
    good = Sim(0.95, 0.003, 0.01, 0.0, 0.001, seed=2)
    chosen = good.run(policy, 150)
    assert chosen[-30:].count(0) <= 1  # at most the probe that re-measures plain decoding
    assert policy.best_gamma() >= 3
    assert policy.alpha > 0.8


def test_exploration_at_zero_backs_off_while_probes_are_rejected():
    policy = AdaptiveGamma(max_gamma=8, explore_every=10)
    sim = Sim(0.0, 0.01, 0.01, 0.0, 0.001)
    chosen = sim.run(policy, 1200)
    start = chosen.index(0)
    probes = [i for i, g in enumerate(chosen) if g and i > start]
    # every probe's first candidate is rejected: each wait doubles (20, 40, then 80 = 8 × 10)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [20, 40, 80, 80] and set(gaps[4:]) == {80}
    # where a probe accepts some, the wait is back to 10 rounds at once
    lucky = Sim(0.5, 0.01, 0.01, 0.0, 0.001, seed=3)
    again = lucky.run(policy, 400)
    zeros = [i for i, g in enumerate(again) if g == 0]
    assert zeros and min(b - a for a, b in zip(zeros, zeros[1:]) if b - a > 1) <= 11
    no_explore = AdaptiveGamma(max_gamma=8, explore_every=0)
    Sim(0.0, 0.01, 0.01, 0.0, 0.001).run(no_explore, 100)
    assert set(no_explore.choose() for _ in range(50)) == {0}


def test_gamma_zero_rounds_do_not_move_alpha():
    policy = AdaptiveGamma(max_gamma=4)
    before = policy.alpha
    for _ in range(10):
        policy.observe(0, 0, False, RoundTiming(round_s=0.011, verify_s=0.01))
    assert policy.alpha == before
    policy.observe(4, 1, True, RoundTiming(round_s=0.015, draft_s=0.004, verify_s=0.01))
    # 1 accepted of 4, then a rejection; the prior is the coordinator-wide α̂ (same round,
    # shrunk towards 0.6 with weight 4)
    shared = (1 + 0.6 * 4) / (2 + 4)
    assert policy.costs.alpha(0.6) == pytest.approx(shared)
    assert policy.alpha == pytest.approx((1 + shared * 4) / (2 + 4))


@pytest.mark.parametrize(
    ("gamma", "accepted", "rejected"), [(3, 4, False), (3, 3, True), (3, 1, False), (0, 0, True)]
)
def test_observe_rejects_inconsistent_rounds(gamma, accepted, rejected):
    with pytest.raises(ValueError, match="inconsistent"):
        AdaptiveGamma(max_gamma=4).observe(
            gamma, accepted, rejected, RoundTiming(round_s=0.01, verify_s=0.01)
        )


@pytest.mark.parametrize(
    "timing",
    [
        RoundTiming(round_s=-0.01),
        RoundTiming(round_s=0.01, verify_forward_s=-1.0),
        RoundTiming(round_s=0.01, batch_size=0),
        RoundTiming(round_s=0.01, batch_positions=0),
    ],
)
def test_observe_rejects_impossible_timings(timing):
    with pytest.raises(ValueError):
        AdaptiveGamma(max_gamma=4).observe(1, 1, False, timing)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    max_gamma=st.integers(0, 10),
    alpha=st.floats(0.0, 1.0),
    draft_fixed=st.floats(0.0, 0.01),
    draft_per_token=st.floats(0.0, 0.02),
    verify_base=st.floats(0.001, 0.05),
    verify_per_token=st.floats(0.0, 0.02),
    overhead=st.floats(0.0, 0.01),
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 32),
)
def test_choice_is_the_argmax_of_the_model(
    max_gamma,
    alpha,
    draft_fixed,
    draft_per_token,
    verify_base,
    verify_per_token,
    overhead,
    seed,
    batch,
):
    """Noise-free affine timings at several γ: the fits are exact and best_gamma is the argmax
    of the batch's true tokens per second."""
    policy = AdaptiveGamma(max_gamma=max_gamma, explore_every=0)
    sim = Sim(
        alpha, draft_per_token, verify_base, verify_per_token, overhead, seed, batch, draft_fixed
    )
    for i in range(30):
        sim.round(policy, i % (max_gamma + 1))
    sim.alpha = policy.planning_alpha()  # compare the cost model at the α̂ the policy plans with
    rates = [sim.rate(g) for g in range(max_gamma + 1)]
    for g in range(max_gamma + 1):
        assert policy.expected_rate(g) == pytest.approx(rates[g], rel=1e-6)
    choice = policy.choose()
    assert choice == policy.best_gamma()
    assert 0 <= choice <= max_gamma
    assert rates[choice] >= max(rates) * (1 - 1e-6)


def test_probe_that_accepts_everything_is_repeated():
    policy = AdaptiveGamma(max_gamma=8, explore_every=10)
    Sim(0.0, 0.003, 0.01, 0.0, 0.001).run(policy, 200)
    chosen = Sim(1.0, 0.003, 0.01, 0.0, 0.001).run(policy, 100)
    first = next(i for i, g in enumerate(chosen) if g)
    assert chosen[first] >= 1  # the probe: best_gamma alone would still say 0
    assert chosen[first + 1] >= 1 and chosen[first + 2] >= 1  # repeated, each accepted


def test_backs_off_when_the_batch_grows_at_the_same_cost_per_position():
    """One more candidate costs a batch of N sessions N positions: the slope the policy sees."""
    costs = dict(draft_per_token=0.002, verify_base=0.02, verify_per_token=0.001, overhead=0.003)
    alone = AdaptiveGamma(max_gamma=8)
    Sim(0.75, **costs, seed=3).run(alone, 200)
    crowded = AdaptiveGamma(max_gamma=8)
    sim = Sim(0.75, **costs, seed=3, batch=24)
    chosen = sim.run(crowded, 200)
    assert alone.best_gamma() >= 4
    assert crowded.best_gamma() <= 2
    rates = [sim.rate(g) for g in range(9)]  # the choice is (near) the true optimum
    assert sum(sim.rate(g) for g in chosen[-50:]) / 50 >= 0.9 * max(rates)
