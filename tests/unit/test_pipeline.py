"""Pipelined rounds (coordinator --pipeline): when a block drafted ahead may be used, what the
policy predicts for such rounds, and the performance model of it."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from coordinator.ahead import Ahead, after_guess, block_ahead_holds
from coordinator.cost_model import RoundTiming
from coordinator.links import BadAnswer
from coordinator.policy import AdaptiveGamma
from coordinator.round_outcome import RoundOutcome
from coordinator.run import SessionRun
from specdec.core.perf_model import expected_tokens, speedup_draft_ahead, speedup_sync
from specdec.text.detok import StreamStep
from specdec.v1 import common_pb2, draft_pb2


def outcome(gamma, accepted, tokens, reason=None) -> RoundOutcome:
    return RoundOutcome(gamma, accepted, StreamStep(len(tokens), (), None), tokens, reason)


def test_a_block_drafted_ahead_holds_only_after_a_full_acceptance_with_the_guessed_bonus():
    full = outcome(3, 3, [11, 12, 13, 14])  # 3 candidates accepted, bonus 14
    assert block_ahead_holds(full, 3, [14, 20, 21])
    assert not block_ahead_holds(full, 3, [15, 20, 21])  # the guess was not the bonus
    assert not block_ahead_holds(full, 3, [14])  # nothing after the guess
    assert not block_ahead_holds(outcome(3, 2, [11, 12, 14]), 3, [14, 20])  # a rejection
    assert not block_ahead_holds(outcome(3, 3, [11, 12, 13]), 3, [13, 20])  # a stop cut it
    assert not block_ahead_holds(outcome(3, 3, [11, 12, 13, 14], "LENGTH"), 3, [14, 20])
    assert not block_ahead_holds(full, 2, [14, 20])  # drafted after another round's block


def test_after_guess_is_the_block_without_its_first_candidate():
    dists = [common_pb2.SparseDist(token_ids=[t], weights=[1]) for t in (14, 20, 21)]
    answer = draft_pb2.ProposeResponse(
        candidate_ids=[14, 20, 21], draft_dists=dists, forward_ns=3000, queue_ns=7
    )
    block = after_guess(answer)
    assert list(block.candidate_ids) == [20, 21]
    assert [list(d.token_ids) for d in block.draft_dists] == [[20], [21]]
    assert block.forward_ns == 2000 and block.queue_ns == 7
    greedy = after_guess(draft_pb2.ProposeResponse(candidate_ids=[14, 20], token_only=True))
    assert list(greedy.candidate_ids) == [20] and not greedy.draft_dists and greedy.token_only


def trained(draft_step: float, verify: float, rest: float, alpha: float) -> AdaptiveGamma:
    """A policy whose estimates are these exact costs (seconds) and this acceptance."""
    policy = AdaptiveGamma(8, prior_weight=0.0, alpha_decay=1.0)
    for gamma in (2, 4, 2, 4):
        timing = RoundTiming(
            round_s=gamma * draft_step + verify + rest,
            draft_s=gamma * draft_step,
            verify_s=verify,
            draft_forward_s=gamma * draft_step,
            verify_forward_s=verify,
            batch_positions=gamma + 1,
        )
        policy.observe(gamma, 0, True, timing)
    for estimate in (policy._acceptance, policy.costs.acceptance):
        estimate.accepted, estimate.rejections = alpha * 1e6, (1 - alpha) * 1e6
    return policy


def test_the_policy_predicts_a_pipelined_round_as_the_longer_leg_plus_the_missed_drafts():
    policy = trained(draft_step=0.002, verify=0.040, rest=0.001, alpha=0.8)
    assert policy.alpha == pytest.approx(0.8)
    gamma, hit = 4, 0.8**5
    sync = 4 * 0.002 + 0.040 + 0.001
    assert policy.round_s(gamma) == pytest.approx(sync)  # pipeline off by default
    policy.pipeline = "on"
    assert policy.round_s(gamma) == pytest.approx((1 - hit) * 4 * 0.002 + 0.041)
    assert policy.pipelining_pays(gamma)
    assert policy.expected_rate(gamma) > expected_tokens(0.8, gamma) / sync


def test_drafting_ahead_does_not_pay_when_the_draft_is_as_slow_as_the_verify():
    policy = trained(draft_step=0.015, verify=0.012, rest=0.001, alpha=0.5)
    assert not policy.pipelining_pays(2)
    policy.pipeline = "on"  # forced: predicted slower than a synchronous round
    on = policy.round_s(2)
    assert on > 2 * 0.015 + 0.012 + 0.001
    policy.pipeline = "auto"  # auto drafts ahead only where it pays: the synchronous cost
    assert policy.round_s(2) == pytest.approx(2 * 0.015 + 0.013)
    assert policy.round_s(0) == pytest.approx(0.013)


def test_speedup_draft_ahead_exact():
    alpha, gamma, c, v, rho_d, rho_v = 0.5, 3, 0.2, 1.0, 0.1, 0.1
    hit = 0.5**4
    a, a_next, b = 3 * 0.2 + 0.1, 4 * 0.2 + 0.1, 1.1
    expected = expected_tokens(alpha, gamma) / ((1 - hit) * a + max(a_next, b))
    assert speedup_draft_ahead(alpha, gamma, c, v, rho_d, rho_v) == pytest.approx(expected)
    assert speedup_draft_ahead(0.9, 0, c, 3.0, 0.5, 0.25) == pytest.approx(0.8)
    # every candidate and guess accepted, the draft leg hidden: one verify per γ+1 tokens
    assert speedup_draft_ahead(1.0, 4, 0.1, 1.0, 0.0, 0.0) == pytest.approx(5.0)
    # nothing accepted: never better than a synchronous round, worse when A' > B
    assert speedup_draft_ahead(0.0, 2, 0.1, 1.0, 0.0, 0.0) == pytest.approx(
        speedup_sync(0.0, 2, 0.1, 1.0, 0.0)
    )
    assert speedup_draft_ahead(0.0, 2, 1.0, 1.0, 0.0, 0.0) < speedup_sync(0.0, 2, 1.0, 1.0, 0.0)


# --- settle_ahead: what the coordinator does with the block drafted ahead ------------------


class FakeLinks:
    """The two things settle_ahead touches on SessionLinks: the attached draft and failover."""

    def __init__(self, address: str):
        self.draft = SimpleNamespace(worker=SimpleNamespace(address=address), synced=0)
        self.failed_over: list[tuple[str, str, bool]] = []

    async def draft_failed(self, address, exc, keep_gamma):
        self.failed_over.append((address, type(exc).__name__, keep_gamma))
        return True


def session_run(address="draft-a:1", gamma=None) -> tuple[SessionRun, list]:
    """A SessionRun with only what settle_ahead reads (the real method runs)."""
    counted = []
    run = object.__new__(SessionRun)
    run.session_id = "s"
    run.record = SimpleNamespace(gamma=gamma)
    run.ctx = SimpleNamespace(count=lambda name, **labels: counted.append((name, labels)))
    run.links = FakeLinks(address)
    run.committed = list(range(20))
    return run, counted


def settle(run: SessionRun, answer, gamma: int, tokens: list[int], address="draft-a:1"):
    async def go():
        future = asyncio.get_running_loop().create_future()
        future.set_result(answer)  # propose_ahead returns a failure, it does not raise it
        ahead = Ahead(future, gamma, address)
        return await run.settle_ahead(ahead, outcome(gamma, gamma, tokens))

    return asyncio.run(go())


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")


def test_a_block_that_holds_becomes_the_next_proposal_and_the_draft_is_in_sync():
    run, counted = session_run()
    answer = draft_pb2.ProposeResponse(candidate_ids=[14, 20, 21], token_only=True)
    block = settle(run, answer, 3, [11, 12, 13, 14])
    assert list(block.candidate_ids) == [20, 21]
    assert run.links.draft.synced == 20 and counted == [("drafts_ahead", {"outcome": "hit"})]
    miss = settle(run, answer, 3, [11, 12, 13, 15])  # the bonus was not the guess
    assert miss is None and counted[-1] == ("drafts_ahead", {"outcome": "miss"})


def test_a_block_from_a_draft_that_is_no_longer_attached_is_discarded():
    run, counted = session_run(address="draft-b:1")  # failed over while the block was drafted
    answer = draft_pb2.ProposeResponse(candidate_ids=[14, 20], token_only=True)
    assert settle(run, answer, 3, [11, 12, 13, 14]) is None
    assert counted == [("drafts_ahead", {"outcome": "miss"})] and run.links.draft.synced == 0


@pytest.mark.parametrize(
    ("error", "fails_over"),
    [
        (rpc_error(grpc.StatusCode.UNAVAILABLE), True),  # the draft died: as a failed Propose
        (rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), True),
        (BadAnswer("inconsistent"), True),  # an answer that cannot be right: as a dead draft
        (rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED), False),  # busy: the next Propose says
        (rpc_error(grpc.StatusCode.INVALID_ARGUMENT), False),  # refused, not dead
    ],
)
def test_a_draft_that_failed_while_drafting_ahead_is_failed_over_once(error, fails_over):
    run, counted = session_run(gamma=3)
    assert settle(run, error, 3, [11, 12, 13, 14]) is None
    assert counted == [("drafts_ahead", {"outcome": "failed"})]
    expected = [("draft-a:1", type(error).__name__, True)] if fails_over else []
    assert run.links.failed_over == expected
    # a failure of a draft the session already left is not failed over again
    run, _ = session_run(address="draft-b:1")
    settle(run, error, 3, [11, 12, 13, 14])
    assert run.links.failed_over == []
