"""The adaptive γ policy across sessions: the cost model a coordinator's sessions share, and
the batch plan of sessions that share verify passes, against simulated rounds."""

import dataclasses
import random
import statistics

import pytest
from policy_sim import Sim

from coordinator.batch_plan import BatchPlan, typical_round_s
from coordinator.cost_model import CostModel, RoundTiming
from coordinator.policy import AdaptiveGamma
from specdec.core.perf_model import expected_tokens


def test_sessions_share_what_the_workers_cost():
    costs = CostModel()
    first = AdaptiveGamma(max_gamma=8, costs=costs)
    Sim(0.8, 0.001, 0.01, 0.01, 0.002, seed=4).run(first, 100)
    fresh = AdaptiveGamma(max_gamma=8)
    informed = AdaptiveGamma(max_gamma=8, costs=costs)
    assert fresh.best_gamma() >= 3
    assert informed.best_gamma() <= 2  # steep verify already known: starts low, no warm-up
    assert informed.alpha == pytest.approx(costs.alpha(0.6)) and informed.alpha > 0.7


def test_an_early_rejection_does_not_switch_a_new_session_off():
    """A new session's α̂ is shrunk towards what the coordinator has seen: one unlucky first
    round does not send it to γ = 0 for many rounds (negative control: a private cost model)."""
    costs = CostModel()
    Sim(0.8, 0.001, 0.02, 0.0, 0.002, seed=5).run(AdaptiveGamma(max_gamma=8, costs=costs), 100)
    unlucky = Sim(0.8, 0.001, 0.02, 0.0, 0.002, seed=5).timing(4)
    shared, alone = AdaptiveGamma(max_gamma=8, costs=costs), AdaptiveGamma(max_gamma=8)
    for policy in (shared, alone):
        policy.observe(4, 0, True, unlucky)
    assert shared.best_gamma() >= 4
    assert alone.alpha < 0.5


def test_a_verify_pass_reported_by_many_sessions_is_fitted_once():
    def passes(costs, seq):
        for n, (positions, seconds) in enumerate([(8, 0.014), (12, 0.018), (16, 0.022)]):
            for _session in range(4):  # every session of the pass reports it
                timing = RoundTiming(
                    round_s=seconds,
                    verify_s=seconds,
                    verify_forward_s=seconds,
                    batch_size=4,
                    batch_positions=positions,
                    batch_seq=n + 1 if seq else None,
                    worker="t0",
                )
                costs.observe(0, timing)

    once, repeated = CostModel(fit_decay=0.5), CostModel(fit_decay=0.5)
    passes(once, seq=True)
    passes(repeated, seq=False)  # negative control: without batch_seq each report counts
    assert once.verify_fit.w == pytest.approx(1 + 0.5 + 0.25)
    assert repeated.verify_fit.w > once.verify_fit.w
    intercept, slope = once.verify_fit.coefficients()
    assert slope == pytest.approx(0.001) and intercept == pytest.approx(0.006)


def test_sessions_sharing_a_batch_plan_with_the_same_alpha():
    costs = CostModel()
    easy, hard = AdaptiveGamma(max_gamma=8, costs=costs), AdaptiveGamma(max_gamma=8, costs=costs)
    Sim(0.95, 0.001, 0.02, 0.0, 0.002, seed=6).run(easy, 60)
    Sim(0.2, 0.001, 0.02, 0.0, 0.002, seed=7).run(hard, 60)
    assert easy.best_gamma() != hard.best_gamma()  # alone: each plans with its own α̂
    Sim(0.6, 0.001, 0.02, 0.0005, 0.002, batch=8).run(AdaptiveGamma(8, costs=costs), 30)
    assert easy.planning_alpha() == hard.planning_alpha() == costs.alpha(0.6)
    assert easy.best_gamma() == hard.best_gamma()  # batched: one γ, no padding to the longest


def test_batched_sessions_keep_one_gamma_until_the_next_verify_pass():
    costs = CostModel()
    sessions = [AdaptiveGamma(max_gamma=8, costs=costs, explore_every=0) for _ in range(4)]
    sim = Sim(0.7, 0.002, 0.02, 0.0008, 0.003, batch=4)
    for n in range(40):
        chosen = {policy.choose() for policy in sessions}
        assert len(chosen) == 1, (n, chosen)  # one γ per pass
        gamma = chosen.pop()
        for i, policy in enumerate(sessions):
            timing = sim.timing(gamma)
            timing.batch_seq, timing.worker = n + 1, "t0"
            timing.round_s += 0.001 * i  # each session's own overheads differ a little
            policy.observe(gamma, min(gamma, 2), gamma > 2, timing)


def batched_run(costs, sim, passes, penalty, sessions=8, seed=0, load=lambda n: 1.0):
    """`sessions` adaptive sessions sharing one verify pass per step for `passes` steps; a
    round with candidates also waits `penalty` seconds that no component reports (as when
    drafting sessions fall into two groups on the target): the cost model books it as `rest`,
    the same for every γ. `load(n)` scales pass n's round times (sessions arriving and
    finishing elsewhere on the workers). Returns the plan's γ per pass."""
    policies = [AdaptiveGamma(max_gamma=8, costs=costs) for _ in range(sessions)]
    rng = random.Random(seed)
    plan = []
    for n in range(passes):
        chosen = {policy.choose() for policy in policies}
        assert len(chosen) == 1, (n, chosen)  # one γ per pass
        gamma = chosen.pop()
        plan.append(gamma)
        for policy in policies:
            timing = sim.timing(gamma)
            timing.batch_seq, timing.worker = n + 1, "t0"
            timing.round_s += penalty(gamma) * rng.uniform(0.9, 1.1)
            timing.round_s *= load(n)
            accepted = 0
            while accepted < gamma and rng.random() < sim.alpha:
                accepted += 1
            policy.observe(gamma, accepted, accepted < gamma, timing)
    return plan, policies[0]


def test_the_batch_plan_finds_the_best_gamma_the_cost_model_cannot_see():
    """The unreported wait makes γ = 0 the best under load; the cost model alone (spread
    over every γ) still says speculate. The measured plan settles on γ = 0 and keeps only
    its probes elsewhere: its rate within 5 % of the best fixed γ."""
    sim = Sim(0.6, 0.002, 0.02, 0.0005, 0.001, batch=8)
    wait = lambda gamma: 0.02 if gamma else 0.0  # noqa: E731
    true_rate = lambda g: expected_tokens(0.6, g) / (sim.timing(g).round_s + wait(g))  # noqa: E731
    best = max(range(9), key=true_rate)
    assert best == 0
    costs = CostModel()
    plan, policy = batched_run(costs, sim, 600, wait)
    model_choice = policy._argmax()
    assert true_rate(model_choice) < 0.9 * true_rate(best)  # the forecast alone loses > 10 %
    tail = plan[300:]
    assert sum(true_rate(g) for g in tail) / len(tail) >= 0.95 * true_rate(best)
    assert tail.count(0) >= 0.6 * len(tail)
    assert policy.best_gamma() == 0


@pytest.mark.parametrize("direction", ["lighter", "heavier"])
def test_the_batch_plan_holds_the_best_gamma_while_the_load_drifts(direction):
    """A hidden cost makes γ = 0 the best, by 6 %, while the load moves every round time 8×
    over the run (sessions finishing, or arriving): a rate measured later is not comparable
    with one measured earlier. Compared side by side (A/B/A), the plan still settles on
    γ = 0. (Comparing rates measured windows apart, as the plan once did, it ended at γ = 3
    or 4 under a growing load: 0.93-0.95 of the best.)"""
    sim = Sim(0.6, 0.002, 0.02, 0.0005, 0.001, batch=8, seed=1)
    wait = lambda gamma: 0.015 if gamma else 0.0  # noqa: E731
    true_rate = lambda g: expected_tokens(0.6, g) / (sim.timing(g).round_s + wait(g))  # noqa: E731
    best = max(range(9), key=true_rate)
    runner_up = max(true_rate(g) for g in range(1, 9))
    assert best == 0 and 0.9 < runner_up / true_rate(best) < 0.95
    passes = 800
    drift = 8.0 if direction == "lighter" else 1 / 8
    scale = lambda n: drift ** (0.5 - n / passes)  # noqa: E731
    # the confound is real: the runner-up late measures faster than the best early
    early, late = (0, passes) if direction == "lighter" else (passes, 0)
    assert runner_up / scale(late) > 2 * true_rate(best) / scale(early)
    plan, policy = batched_run(CostModel(), sim, passes, wait, seed=1, load=scale)
    tail = plan[passes // 2 :]
    assert sum(true_rate(g) for g in tail) / len(tail) >= 0.97 * true_rate(best)
    assert policy.best_gamma() == best


def test_the_batch_plan_climbs_to_the_best_gamma_where_the_model_is_right():
    """No hidden cost: the measured plan agrees with the forecast and stays near its best."""
    sim = Sim(0.8, 0.001, 0.02, 0.0002, 0.001, batch=8)
    true_rate = lambda g: expected_tokens(0.8, g) / sim.timing(g).round_s  # noqa: E731
    best = max(range(9), key=true_rate)
    plan, policy = batched_run(CostModel(), sim, 600, lambda gamma: 0.0)
    tail = plan[300:]
    assert sum(true_rate(g) for g in tail) / len(tail) >= 0.95 * true_rate(best)
    assert abs(policy.best_gamma() - best) <= 1


def test_batch_plan_windows_measure_and_probe():
    """Windows of 4 passes, round times by γ known, a forecast that always says γ = 4 (wrong:
    γ = 2 is best). The plan starts at the forecast, probes after each of its first 3 windows,
    then every other window - half the plan's γ, a neighbour (the one probed longest ago), the
    forecast's γ, a neighbour, γ = 0, a neighbour; a neighbour instead where that γ is the
    plan's or was probed lately - each probe followed
    by a window at the plan's γ that confirms it (A/B/A), goes on the same way after a probe
    that wins, and moves to the best γ. Rounds chosen before a window settled, at another γ
    or in another window do not count."""
    round_s = {0: 0.10, 1: 0.12, 2: 0.135, 3: 0.16, 4: 0.2}
    rate = {g: expected_tokens(0.7, g) / t for g, t in round_s.items()}
    assert max(rate, key=rate.get) == 2 and rate[3] > rate[4] > rate[0]
    plan = BatchPlan(window_passes=4, settle_passes=1, probe_every=2, max_age=100, min_rounds=2)
    windows, passes = [], 0
    for _ in range(12):
        gamma = plan.current(passes, 0.7, 4, lambda low: 4)
        windows.append(gamma)
        # each kind of round that must not count outnumbers those that do (a median)
        for _ in range(7):
            plan.observe(plan.ticket(passes), gamma, 9.0)  # chosen before the window settled
            plan.observe((plan.window - 1, True), gamma, 9.0)  # a previous window's
            plan.observe((plan.window, False), gamma, 9.0)  # a session's first rounds
        for step in range(1, 4):  # the window's settled passes, 2 rounds each
            ticket = plan.ticket(passes + step)
            for _ in range(2):
                plan.observe(ticket, gamma, round_s[gamma])
                plan.observe(ticket, gamma + 1, 9.0)  # another γ (a clamped round)
                plan.observe(ticket, gamma + 1, 9.0)
        passes += 4
    # 4; probe half of it, 2, 4 confirms it won, so on at once to 1, 2 confirms it lost: 2
    # is the plan; a window at 2, then a neighbour (1 was probed lately): 3, 2 confirms it
    # lost; a window at 2, then the forecast's 4, 2 confirms it lost
    assert windows == [4, 2, 4, 1, 2, 2, 3, 2, 2, 4, 2, 2]
    assert plan.ratios[1][0] < 1 < plan.ratios[2][0]
    assert plan.ratios[3][0] < 1 and plan.ratios[4][0] < 1
    assert plan.best == 2
    assert plan.rate(2, 0.7) == pytest.approx(rate[2])  # only the rounds that count
    plan.passes += 101 * 4  # long ago: no longer counts
    assert plan.rate(2, 0.7) is None


@pytest.mark.parametrize("report_asked", [True, False])
def test_the_batch_plan_measures_rounds_whose_draft_stopped_early(report_asked):
    """--draft-confidence: a round may verify fewer candidates than the γ the plan chose. The
    plan measures the γ it chose (`asked`); reported by the candidates alone, windows whose
    drafts stop early measure nothing (the negative control)."""
    costs = CostModel()
    sessions = [AdaptiveGamma(max_gamma=8, costs=costs, explore_every=0) for _ in range(4)]
    sim = Sim(0.7, 0.002, 0.02, 0.0008, 0.003, batch=4)
    for n in range(120):
        gamma = {policy.choose() for policy in sessions}.pop()
        offered = max(gamma - 1, 0)  # every block cut one candidate short
        for policy in sessions:
            timing = sim.timing(offered)
            timing.batch_seq, timing.worker = n + 1, "t0"
            asked = {"asked": gamma} if report_asked else {}
            policy.observe(offered, offered, False, timing, **asked)
    measured = {g for g in costs.plan.measured if g > 1}
    assert bool(measured) == report_asked, costs.plan.measured


def test_a_sessions_first_round_at_a_new_plan_gamma_is_not_measured():
    """From γ = 0 the draft first catches up on every token committed meanwhile: a cost of
    the switch (paid by every probe up from 0, by none down to it), not of the γ. So a
    batched session's first round at a new plan γ never counts towards the window — also
    for a session that comes to choose after the window settled (rounds are not in step)."""
    costs = CostModel()
    sessions = [AdaptiveGamma(max_gamma=8, costs=costs, explore_every=0) for _ in range(2)]
    sim = Sim(0.7, 0.002, 0.02, 0.0008, 0.003, batch=8)
    previous, switches, counted, seq = [None, None], 0, 0, 0
    for n in range(300):
        for i, policy in enumerate(sessions):
            gamma = policy.choose()
            if n > 10 and policy.batched():
                if gamma != previous[i]:
                    switches += 1
                    assert not policy._ticket[2], (n, i, previous[i], gamma)
                counted += policy._ticket[2]
            previous[i] = gamma
            for _ in range(2):  # this session's pass, then one of the others'
                seq += 1
                timing = sim.timing(gamma)
                timing.batch_seq, timing.worker = seq, "t0"
                costs.observe(gamma, timing)
            policy.observe(gamma, min(gamma, 2), gamma > 2, sim.timing(gamma))
    assert switches >= 10 and counted >= 100  # the plan moved, and windows were measured


def test_the_batch_plan_logs_each_window_it_closes_at_debug(caplog):
    """Each closed window is one debug line (its γ, probe or plan, rounds and rate) for an
    operator following the plan; none above debug."""
    import logging

    def run_windows(plan):
        for passes in range(0, 13):
            gamma = plan.current(passes, 0.7, 4, lambda low: 3)
            for _ in range(3):
                plan.observe(plan.ticket(passes), gamma, 0.05 if gamma else 0.04)

    with caplog.at_level(logging.INFO, logger="coordinator.batch_plan"):
        run_windows(BatchPlan(window_passes=4, settle_passes=1, min_rounds=2))
    assert not [r for r in caplog.records if "batch plan" in r.getMessage()]
    with caplog.at_level(logging.DEBUG, logger="coordinator.batch_plan"):
        run_windows(BatchPlan(window_passes=4, settle_passes=1, min_rounds=2))
    lines = [r.getMessage() for r in caplog.records if "batch plan" in r.getMessage()]
    assert lines[0].startswith("batch plan: window 1 (passes 0-4) γ=3 plan, 9 rounds measured")
    assert "γ=1 probe" in lines[1]  # the first window ends with a probe of half its γ


def _run_windows(plan, passes, count, round_s, forecast=4, alpha=0.7):
    """`count` windows of 4 passes, every settled round taking round_s[γ]; the γ of each."""
    windows = []
    for _ in range(count):
        gamma = plan.current(passes, alpha, 4, lambda low: max(low, forecast))
        windows.append(gamma)
        for step in range(1, 4):
            ticket = plan.ticket(passes + step)
            for _ in range(2):
                plan.observe(ticket, gamma, round_s[gamma])
        passes += 4
    return windows, passes


@pytest.mark.parametrize("after", ["same load", "new load"])
def test_after_a_pause_the_plan_starts_again_from_its_own_gamma(after):
    """A plan that found γ = 2 against a forecast of 4 pauses (nothing measured for longer
    than max_age windows). It starts again at 2, not at the forecast (the rule before: the
    first window after the pause at 4), its first probe at half its γ, later the forecast's 4:
    under the same load 2 stays, under a load where 4 is best the plan moves there. (The
    forecast's choice first, as before: in a simulation of 12 changes of the best γ between
    0, 1, 2 and 4, 0.91 of the best rate in the 20 windows after the restart against 0.93
    with half first — the forecast runs high under load.)"""
    before = {0: 0.10, 1: 0.12, 2: 0.135, 3: 0.16, 4: 0.2}  # γ = 2 best
    later = {0: 0.30, 1: 0.31, 2: 0.32, 3: 0.33, 4: 0.34}  # γ = 4 best
    rate = {g: expected_tokens(0.7, g) / t for g, t in later.items()}
    assert max(rate, key=rate.get) == 4
    plan = BatchPlan(window_passes=4, settle_passes=1, probe_every=2, max_age=10, min_rounds=2)
    windows, passes = _run_windows(plan, 0, 11, before)
    assert plan.best == 2 and windows[0] == 4  # started at the forecast, found 2
    # the sessions' last call opens a window at 2; then nothing for 50 windows' passes
    assert plan.current(passes, 0.7, 4, lambda low: max(low, 4)) == 2
    passes += 4 * 50
    after_pause, _ = _run_windows(plan, passes, 12, before if after == "same load" else later)
    assert after_pause[:3] == [2, 1, 2]  # 2 again; half of it probed first
    assert 4 in after_pause[3:8]  # then the forecast's choice
    assert plan.window - plan._started == 12  # the pause started the plan again
    assert plan.best == (2 if after == "same load" else 4)


class _PlanResumedAsBefore(BatchPlan):
    def resume(self, passes: int) -> None:  # the rule before: a stale plan went on as it was
        super().resume(passes)
        self._stale = False


@pytest.mark.parametrize(
    "plan_class, alpha", [(BatchPlan, 0.6), (_PlanResumedAsBefore, 0.6), (BatchPlan, 0.68)]
)
def test_back_at_its_level_with_another_acceptance_the_plan_starts_again(plan_class, alpha):
    """A level's plan found γ = 1 at α̂ 0.7; then other levels (or sessions of a fixed γ) held
    the passes for 60 windows, and when the load is back at this level α̂ is 0.6 and γ = 0 is
    best (on the stack: SmolLM2 with sampling at 4 sessions after greedy, α̂ 0.33 against
    0.40). Resumed, the plan starts again from its 1, as after a pause: its first window back
    is not measured (on the stack the sessions' first rounds there ran slow, and a probe after
    it won on that), then a probe after each window, the first at half its γ — at 0 by its
    fifth window. Negative control: resumed as before, it went on with its rotation and sat
    at 1 for four windows here (up to six, the rotation's worst case). With α̂ as it was
    (0.68: moved less than `alpha_moved`) the plan goes on as before — the code pair at 16
    sessions after a run at one lost 16 % to a restart's probes in a short run."""
    one = {0: 0.1, 1: 0.165, 2: 0.23, 3: 0.3, 4: 0.4}  # γ = 1 best at α = 0.7
    zero = {0: 0.1, 1: 0.18, 2: 0.24, 3: 0.3, 4: 0.4}  # γ = 0 best at 0.6 and at 0.68
    for table, best, a in ((one, 1, 0.7), (zero, 0, alpha)):
        rate = {g: expected_tokens(a, g) / t for g, t in table.items()}
        assert max(rate, key=rate.get) == best
    plan = plan_class(window_passes=4, settle_passes=1, probe_every=6, max_age=12, min_rounds=2)
    _, passes = _run_windows(plan, 0, 30, one)
    assert plan.best == 1
    passes += 4 * 60
    plan.resume(passes)
    windows, _ = _run_windows(plan, passes, 5, zero, alpha=alpha)
    if plan_class is BatchPlan and alpha == 0.6:
        assert windows == [1, 1, 0, 1, 0] and plan.best == 0
        assert plan.window - plan._started == 3  # restarted from its second window back
    else:  # the rotation's probe of 0 not yet confirmed
        assert windows[:4] == [1] * 4 and plan.best == 1, windows


class _PlanThatDropsUnconfirmedProbes(BatchPlan):
    def _close(self, *args) -> None:  # the rule before: such a probe was dropped
        retry = self._retry
        super()._close(*args)
        if self._probe_from is None and self.window > 1:
            self._retry = retry


@pytest.mark.parametrize("plan_class", [BatchPlan, _PlanThatDropsUnconfirmedProbes])
def test_a_probe_ahead_whose_confirmation_measured_nothing_goes_again(plan_class):
    """The forecast says 4, 2 is best; the first probe (half: 2) measures ahead of the plan,
    and then the plan's confirming window sees 13 passes with no round of the plan's (other
    sessions, of a fixed γ, held them: on the stack a bench's warm-ups). The probe goes again
    at the close of the plan's next window, and wins. Negative control: dropped, the plan
    sits at 4 until its rotation comes round (on the stack: 20 passes at γ = 4 where 0 was
    best, then one step a probe)."""
    round_s = {0: 0.10, 1: 0.12, 2: 0.135, 3: 0.16, 4: 0.2}
    plan = plan_class(window_passes=4, settle_passes=1, probe_every=6, max_age=100, min_rounds=2)
    windows, passes = _run_windows(plan, 0, 2, round_s)
    assert windows == [4, 2] and plan._probe_from == 4
    for idle in range(passes, passes + 13):  # the confirming window: no round of its own
        plan.current(idle, 0.7, 4, lambda low: max(low, 4))
    windows, _ = _run_windows(plan, passes + 13, 5, round_s)
    if plan_class is BatchPlan:
        assert windows[:3] == [4, 2, 4] and plan.best <= 2, windows
    else:
        assert 2 not in windows and plan.best == 4, windows


@pytest.mark.parametrize("backoff", [2, 0])
def test_at_gamma_0_lost_probes_come_ever_more_rarely(backoff):
    """Where speculation does not pay (γ = 0 best; on the stack SmolLM2 with sampling at 4
    sessions, a probe's window at γ = 1 ran at ~0.75 of the plan's), every probe lost in a row
    doubles the wait for the next, up to 4 × probe_every: 5 probes in 90 windows instead of
    14. When speculation pays again (γ = 1 best) a probe still finds it, later (24 windows
    here), and the plan moves there. Negative control: `backoff=0`, the rule before."""
    zero = {0: 0.1, 1: 0.18, 2: 0.24, 3: 0.3, 4: 0.4}  # γ = 0 best at α = 0.7
    one = {0: 0.1, 1: 0.14, 2: 0.24, 3: 0.3, 4: 0.4}  # γ = 1 best
    plan = BatchPlan(
        window_passes=4,
        settle_passes=1,
        probe_every=6,
        max_age=1000,
        min_rounds=2,
        backoff=backoff,
    )
    windows, passes = _run_windows(plan, 0, 90, zero, forecast=0)
    assert plan.best == 0
    probes = sum(g != 0 for g in windows)
    assert probes == (5 if backoff else 14), windows
    windows, _ = _run_windows(plan, passes, 40, one, forecast=0)
    assert plan.best == 1 and windows.index(1) <= 25, windows


def bursts(per_level: bool, bursts: int = 4, seed: int = 3) -> list[list[int]]:
    """8 sessions sharing each verify pass in bursts: 240 passes at 16 running sessions
    (γ = 2 best: round times grow fast with γ), then a tail of 120 at 3 (γ ≥ 4 best), and
    again. With `per_level` the coordinator tells the cost model its running sessions (one
    batch plan per load level); without, one plan serves every load. Returns the plan's γ per
    pass of each burst."""
    busy = {0: 0.10, 1: 0.15, 2: 0.18, 3: 0.25, 4: 0.31, 5: 0.37, 6: 0.44, 7: 0.50, 8: 0.56}
    tail = {g: 0.030 + 0.004 * g for g in range(9)}
    for table, best in ((busy, 2), (tail, 5)):
        rate = {g: expected_tokens(0.8, g) / t for g, t in table.items()}
        assert max(rate, key=rate.get) == best
    costs, running = CostModel(), [16]
    if per_level:
        costs.running = lambda: running[0]
    policies = [AdaptiveGamma(max_gamma=8, costs=costs) for _ in range(8)]
    sim, rng = Sim(0.8, 0.002, 0.02, 0.0008, 0.003, batch=8), random.Random(seed)
    plans, seq = [], 0
    for _ in range(bursts):
        plans.append([])
        for table, passes, sessions in ((busy, 240, 16), (tail, 120, 3)):
            running[0] = sessions
            for _ in range(passes):
                seq += 1
                chosen = {policy.choose() for policy in policies}
                assert len(chosen) == 1, (seq, chosen)  # one γ per pass
                gamma = chosen.pop()
                if sessions == 16:
                    plans[-1].append(gamma)
                for policy in policies:
                    timing = sim.timing(gamma)
                    timing.batch_seq, timing.worker = seq, "t0"
                    timing.round_s = table[gamma] * rng.uniform(0.95, 1.05)
                    accepted = 0
                    while accepted < gamma and rng.random() < sim.alpha:
                        accepted += 1
                    policy.observe(gamma, accepted, accepted < gamma, timing)
    return plans


def test_each_load_level_keeps_its_own_batch_plan():
    """A burst at 16 sessions (γ = 2 best) after a tail at 3 (γ = 5 best) starts where the
    last burst ended, from the plan of its own load level. Negative control: one plan for
    every load starts each burst from what the tail found and loses windows climbing back."""
    for per_level in (True, False):
        plans = bursts(per_level)
        starts = [burst[5:40] for burst in plans[1:]]  # each later burst's first windows
        at_best = sum(g == 2 for start in starts for g in start) / sum(map(len, starts))
        if per_level:
            assert at_best >= 0.7, starts
        else:
            assert at_best <= 0.4, starts


def test_the_load_level_is_smoothed_and_keeps_a_margin():
    """The plan in use follows the running sessions on a log scale (16 → level 4, covering
    about 11–22), smoothed and with a margin of 1/8 past each boundary: a session ending as
    the next begins, or a load at the boundary, does not switch plans."""
    costs, running = CostModel(), [16]
    costs.running = lambda: running[0]
    levels = []
    at_boundary = ([11] * 10 + [12] * 10) * 3  # about 11.3: would flip without the margin
    for count in (
        [16] * 20 + [15, 16] * 10 + [12] * 30 + [9] * 30 + [11] * 30 + [16] * 30 + at_boundary
    ):
        running[0] = count
        costs._track_load()
        levels.append(costs.level)
    assert set(levels[:70]) == {4}  # 16, dips to 15, 12: all level 4
    assert levels[99] == 3  # 9 sessions: past the margin below 11.3 (10.1)
    assert set(levels[100:130]) == {3}  # 11: within the level's margin above (12.7), stays
    assert set(levels[150:]) == {4} and set(costs.plans) == {0, 3, 4}


def test_a_plan_in_use_again_after_another_level_drops_its_open_probe():
    plan = BatchPlan(window_passes=4, settle_passes=1, probe_every=1, max_age=100, min_rounds=2)
    passes = 0
    while plan._probe_from is None:  # run windows until one probes
        gamma = plan.current(passes, 0.7, 4, lambda low: max(low, 2))
        for _ in range(3):
            plan.observe(plan.ticket(passes + 1), gamma, 0.1)
        passes += 1
    assert plan.gamma != plan.best
    plan.resume(passes + 2)  # a short gap: the same window goes on
    assert plan._probe_from is not None
    plan.resume(passes + 40)  # other levels held 40 passes: dropped, back at the plan's γ
    assert plan._probe_from is None and plan.gamma == plan.best and plan.start == passes + 40


class _PlanThatForgetsProbes(BatchPlan):
    def resume(self, passes: int) -> None:  # the rule before: a dropped probe is forgotten
        since_probe = self._since_probe
        super().resume(passes)
        self._retry, self._since_probe = None, since_probe


@pytest.mark.parametrize("cut", ["while measuring", "before its confirmation"])
def test_a_probe_another_level_cut_short_goes_again_first(cut):
    """The forecast says 4, 2 is best; the first probe (half: 2) is cut short by a switch to
    another load level — while it measures, or after it measured ahead of the plan but before
    the plan's window confirmed it. When the level is back, its first probe is 2 again, and
    wins. (On the stack at 16 sessions a probe at γ = 3, 34.8 against about 24 tok/s a
    session, was dropped this way, and the plan sat at 7 for a whole run.) Negative control:
    a plan that forgets the probe goes on with its rotation, one step down at most, later."""
    round_s = {0: 0.10, 1: 0.12, 2: 0.135, 3: 0.16, 4: 0.2}

    def after_the_cut(plan_class):
        plan = plan_class(
            window_passes=4, settle_passes=1, probe_every=2, max_age=100, min_rounds=2
        )
        count = 2 if cut == "while measuring" else 3
        windows, passes = _run_windows(plan, 0, count, round_s)
        assert windows == [4, 2, 4][:count]
        plan.resume(passes + 40)  # other levels held the passes meanwhile
        windows, _ = _run_windows(plan, passes + 40, 4, round_s)
        return windows, plan.best

    assert after_the_cut(BatchPlan) == ([4, 2, 4, 1], 2)  # 2 won: on to 1 at once
    windows, best = after_the_cut(_PlanThatForgetsProbes)
    assert 2 not in windows[:3] and best > 2, windows  # a step at a time, or not yet


class _PlanWithoutHalf(BatchPlan):
    PROBES = ("off", "neighbour", "model", "neighbour")  # the probes before "half"


class _PlanOffFirst(BatchPlan):
    def __post_init__(self) -> None:  # the order before: speculation off probed first
        super().__post_init__()
        self._probes = 0


def test_a_plan_far_too_high_comes_down_by_halves():
    """A forecast of γ = 8 where 3 is best (a hidden wait per candidate, as under load): the
    probes at half the plan's γ, the first of them right after the first window, bring it
    down within the first 150 passes. Mean over six seeds of the rate there, as a fraction of
    the best; negative controls: γ = 0 probed first, and the probes before (one step a probe)
    stay higher for longer."""

    def early(plan_class) -> float:
        fractions = []
        for seed in range(6):
            sim = Sim(0.8, 0.0005, 0.02, 0.0001, 0.001, batch=8, seed=seed)
            wait = lambda gamma: 0.006 * gamma  # noqa: E731
            true_rate = lambda g: expected_tokens(0.8, g) / (sim.timing(g).round_s + wait(g))  # noqa: E731, B023
            best = max(range(9), key=true_rate)
            assert best == 3
            costs = CostModel()
            costs.plans[0] = plan_class()
            plan, policy = batched_run(costs, sim, 150, wait, seed=seed)
            assert max(plan[:30]) == 8  # the plan started at the forecast: far too high
            fractions.append(sum(map(true_rate, plan)) / len(plan) / true_rate(best))
        return sum(fractions) / len(fractions)

    assert early(BatchPlan) >= 0.955  # measured 0.965
    assert early(_PlanOffFirst) < 0.95  # the first probe at γ = 0: 0.935
    assert early(_PlanWithoutHalf) < 0.92


def test_a_window_charges_a_long_tail_but_not_a_prefill():
    """A window's round time is the mean of its rounds without the slowest eighth: one
    prefill (a round 10× longer) among 33 moves it by under 1 %, while a tail of slow rounds
    (every fifth round 1.5× longer, as speculating rounds under load) is charged in part:
    5 % above the median, which charges none of it (the negative control)."""
    prefill = [0.08] * 32 + [0.8]
    assert typical_round_s(prefill) == pytest.approx(0.08, rel=0.01)
    assert statistics.fmean(prefill) > 1.25 * 0.08  # the plain mean would not do
    tail = [0.08 if i % 5 else 0.12 for i in range(33)]
    assert statistics.median(tail) == 0.08
    assert 1.04 * 0.08 < typical_round_s(tail) < statistics.fmean(tail)
    assert typical_round_s([0.1, 0.1, 0.1, 1.0]) == pytest.approx(0.1)  # a short window too


class _OneCostModelForEveryLoad(CostModel):
    def _track_load(self) -> None:  # the rule before: one set of timing estimates for all loads
        shared = self.timings[self.level]
        super()._track_load()
        self.timings[self.level] = shared


@pytest.mark.parametrize("model_class", [CostModel, _OneCostModelForEveryLoad])
def test_a_lone_session_after_a_burst_plans_with_the_costs_measured_alone(model_class):
    """A lone session finds γ = 5 best (cheap verify passes); then 16 sessions share passes 3×
    as long whose every position costs 4× more; then one session again. Once the smoothed
    load is back at one session, it plans with what one session measured — the verify fit
    as before the burst, γ within one of 5. Negative control: with one set of estimates for
    every load (the rule before) the burst's fit stays (on the stack a lone session after a
    burst of 16 decoded at γ = 0 for a third of its rounds: 0.81× of γ = 4)."""
    costs = model_class()
    running = [1]
    costs.running = lambda: running[0]
    lone = Sim(0.8, 0.001, 0.010, 0.0004, 0.001, seed=1)
    first = AdaptiveGamma(8, costs=costs)
    lone.run(first, 150)
    before, fit = first.best_gamma(), costs.verify_fit.coefficients()
    assert before == 5
    running[0] = 16
    burst = Sim(0.8, 0.004, 0.030, 0.0015, 0.004, batch=16)
    batched_run(costs, burst, 60, lambda gamma: 0.0, sessions=16, seed=11)
    assert costs.level == 4
    running[0] = 1
    after = AdaptiveGamma(8, costs=costs)
    for _ in range(200):
        if costs.level == 0:
            break
        lone.round(after, after.choose())
    assert costs.level == 0
    if model_class is CostModel:
        assert costs.verify_fit.coefficients() == pytest.approx(fit, rel=0.05)
        assert abs(after.best_gamma() - before) <= 1
    else:
        assert costs.verify_fit.coefficients()[1] > 4 * fit[1]  # the burst's slope
        assert after.best_gamma() <= before - 2


class _PrefillCountedAsDecoding(CostModel):
    """The rule before: a Prefill's wait counted as the verify call's network time, passes
    padded to a prompt fitted, and a draft's catch-up taken as draft steps."""

    def __init__(self) -> None:
        super().__init__(max_gamma=10**6)

    def observe(self, gamma: int, t: RoundTiming) -> None:
        super().observe(gamma, dataclasses.replace(t, prefill_s=0.0, draft_batch_positions=None))


def _wave_start(costs, sim, rng, sessions=16):
    """What the coordinator reports as a wave of `sessions` requests starts together at one
    load: each session's first round waits for the chunked Prefills of every prompt (0.3–0.4 s
    on the code pair), and some short prompts ride in the verify pass itself, padding it."""
    for n in range(sessions):
        timing = sim.timing(0)
        timing.prefill_s = rng.uniform(0.3, 0.4)
        timing.verify_s += timing.prefill_s
        timing.round_s += timing.prefill_s
        if n % 4 == 0:  # a pass padded to a short prompt of 30 tokens: 0.12 ms a position
            timing.batch_positions = sessions * 30
            timing.verify_forward_s = timing.verify_s = 0.016 + 0.00012 * timing.batch_positions
            timing.round_s = timing.verify_s + timing.prefill_s
            timing.verify_s += timing.prefill_s
        costs.observe(0, timing)


@pytest.mark.parametrize("model_class", [CostModel, _PrefillCountedAsDecoding])
def test_a_wave_of_prompts_does_not_make_candidates_look_cheap(model_class):
    """16 sessions of fixed γ (2, 4, 6) have measured the workers at this load; then a wave of
    16 adaptive sessions starts, and the batch plan at this load starts from the forecast made
    after their first rounds. Those rounds waited for every prompt's Prefill: counted as the
    verify call's network time, the wait is a constant ~0.35 s beside which candidates look
    free. With the prefill kept out the forecast is the true best γ (2 on this curve, measured
    at 16 sessions on the code pair: round = 10 + 3·γ ms of draft, 16 + 6.4·(γ + 1) of verify,
    6 ms rest), and the plan starts there; negative control (the rule before): γ ≥ 5."""
    rng = random.Random(3)
    costs = model_class()
    running = [16]
    costs.running = lambda: running[0]
    sim = Sim(0.7, 0.003, 0.016, 0.0004, 0.006, batch=16, draft_fixed=0.004)
    true_rate = lambda g: expected_tokens(0.7, g) / sim.timing(g).round_s  # noqa: E731
    best = max(range(9), key=true_rate)
    assert best == 2
    for n, gamma in enumerate([2, 4, 6] * 10):  # fixed-γ sessions: no plan, costs measured
        for _ in range(16):
            timing = sim.timing(gamma)
            timing.batch_seq, timing.worker = n + 1, "t0"
            accepted = 0
            while accepted < gamma and rng.random() < 0.7:
                accepted += 1
            costs.acceptance.observe(accepted, accepted < gamma)
            costs.observe(gamma, timing)
    assert costs.level == 4
    _wave_start(costs, sim, rng)
    AdaptiveGamma(8, costs=costs).choose()  # the wave's first round after its prefill
    if model_class is CostModel:
        assert costs.plan.best == best
    else:
        assert costs.plan.best >= 5, costs.plan.best


def test_passes_padded_to_a_prompt_are_not_fitted():
    """A verify pass whose rows are longer than a round's block (γ_max + 2) holds a prompt:
    it is counted as a pass but not fitted (its 0.12 ms a position would bend the decoding
    line, 16 + 0.4·P ms, to a third of its slope), and a draft call whose pass caught up on 40
    committed tokens is not taken as 2 draft steps. Negative control: the rule before."""
    fitted, before = CostModel(max_gamma=8), _PrefillCountedAsDecoding()
    for costs in (fitted, before):
        for n, positions in enumerate([32, 48, 64, 80, 16 * 40, 48, 16 * 60, 64]):
            per = 0.0004 if positions <= 16 * 10 else 0.00012
            seconds = 0.016 + per * positions
            timing = RoundTiming(
                round_s=seconds + 0.05,
                draft_s=0.05,
                draft_forward_s=0.045 if positions > 160 else 0.006,
                draft_batch_positions=16 * (40 if positions > 160 else 3),
                draft_batch_size=16,
                verify_s=seconds,
                verify_forward_s=seconds,
                batch_size=16,
                batch_positions=positions,
                batch_seq=n + 1,
                worker="t0",
            )
            costs.observe(2, timing)
    assert fitted.passes == before.passes == 8
    assert fitted.verify_fit.coefficients() == pytest.approx((0.016, 0.0004), rel=1e-6)
    assert before.verify_fit.coefficients()[1] < 0.5 * 0.0004
    assert fitted.draft_step.get(0.0) == pytest.approx(0.003)
    assert before.draft_step.get(0.0) > 0.006


def test_a_draft_pass_padded_to_another_sessions_prompt_is_not_taken_as_draft_steps():
    """The draft computes a prompt in a session's first Propose, and every session in that
    pass waits for it (the first step's rows padded to the prompt): their draft calls are not
    taken as γ draft steps (the pass's positions, `draft_batch_positions`, tell), while a
    pass of decoding rounds is. Negative control: the rule before."""
    fitted, before = CostModel(max_gamma=8), _PrefillCountedAsDecoding()
    for costs in (fitted, before):
        for n in range(12):
            padded = n % 3 == 1  # a prompt of 200 tokens in the pass: 40 ms instead of 6
            timing = RoundTiming(
                round_s=0.1,
                draft_s=0.045 if padded else 0.008,
                draft_forward_s=0.04 if padded else 0.006,
                draft_batch_size=8,
                draft_batch_positions=8 * (200 if padded else 3),
                verify_s=0.05,
                verify_forward_s=0.05,
                batch_size=8,
                batch_positions=24,
            )
            costs.observe(2, timing)
    assert fitted.draft_step.get(0.0) == pytest.approx(0.003)
    assert before.draft_step.get(0.0) > 0.005
