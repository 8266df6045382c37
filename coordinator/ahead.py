"""Pipelined speculation (PEARL, docs/architecture.md): while the target verifies a round's
block, the session's draft proposes the next block from the optimistic prefix (the committed
tokens and this round's candidates). The next round uses it when this round accepted every
candidate and its bonus token is the draft's guess, and discards it otherwise — lossless by
construction (`Ahead`). `DraftsAhead` is the part of a session's run (`SessionRun`) that
starts, settles and cancels those blocks; --pipeline says when (auto: off while sessions
share verify passes)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from coordinator.links import BUSY, FAILOVER_CODES
from specdec.serving.telemetry import span
from specdec.v1 import draft_pb2

if TYPE_CHECKING:
    from coordinator.round_outcome import RoundOutcome

log = logging.getLogger(__name__)


@dataclass
class Ahead:
    """The next round's block, drafted from the optimistic prefix (the committed tokens and
    this round's γ candidates) while the target verifies them. Its first candidate is the
    draft's guess of the bonus token; the rest are the next round's candidates, valid only if
    this round accepts every candidate and its bonus token equals the guess — then they are
    exactly what a Propose from the new committed prefix would return (same q̃, same
    counter-based randomness at the same positions), so using them is lossless."""

    task: asyncio.Task
    gamma: int  # this round's γ (the block it follows)
    address: str  # the draft worker asked
    asked: int = 0  # the next round's γ it was asked for (more than it holds if it stopped early)


def block_ahead_holds(outcome: RoundOutcome, gamma: int, drafted: list[int]) -> bool:
    """Whether a block drafted ahead (the guess, then candidates) is the next round's: the
    round accepted all γ candidates, committed them and the bonus token, goes on, and its
    bonus token is the guess. Anything else and it was drafted from a prefix that is not the
    committed one."""
    return (
        outcome.reason is None
        and outcome.accepted == gamma == outcome.gamma
        and len(outcome.tokens) == gamma + 1
        and len(drafted) >= 2
        and drafted[0] == outcome.tokens[-1]
    )


def after_guess(answer: draft_pb2.ProposeResponse) -> draft_pb2.ProposeResponse:
    """The candidates after the guess, as the Propose from the new prefix would answer
    (forward time scaled to the steps they took)."""
    n = len(answer.candidate_ids)
    return draft_pb2.ProposeResponse(
        candidate_ids=list(answer.candidate_ids)[1:],
        draft_dists=list(answer.draft_dists)[1:],
        token_only=answer.token_only,
        queue_ns=answer.queue_ns,
        forward_ns=answer.forward_ns * (n - 1) // n,
        total_ns=answer.total_ns,
        computed_tokens=answer.computed_tokens,
        batch_size=answer.batch_size,
        batch_positions=answer.batch_positions,
    )


class DraftsAhead:
    """The blocks drafted ahead of a session's rounds: a part of `SessionRun`, which holds the
    state these use (its links, policy, record, committed prefix and settings) and its
    `gamma_within` and `propose_request`, so a block ahead is bounded and asked for as a
    round's own Propose is."""

    ahead: Ahead | None

    def stop_ahead(self) -> None:
        if self.ahead is not None:
            self.ahead.task.cancel()
            self.ahead = None

    def pipeline_mode(self) -> str:
        """--pipeline as it applies now: auto is off while this coordinator's sessions share
        verify passes (batches of ≥ 1.5 sessions on average) — under load the draft tier's
        time is better spent on other sessions than on blocks that may be discarded."""
        mode = self.ctx.settings.pipeline
        return "off" if mode == "auto" and self.policy.batched() else mode

    def draft_ahead(self, proposal) -> Ahead | None:
        """Start drafting the next block from the optimistic prefix (see `Ahead`), or None
        when this round has no candidates, the budget leaves no room for another round of
        candidates, or pipelining is off."""
        worker = self.links.draft.worker
        mode = self.pipeline_mode()
        if proposal is None or worker is None or mode == "off":
            return None
        gamma = len(proposal.candidate_ids)
        if gamma == 0 or (mode == "auto" and not self.policy.pipelining_pays(gamma)):
            return None
        # after a full acceptance `gamma + 1` more tokens are committed; the next round then
        # verifies at most `left - 1` candidates (choose_gamma's bound)
        left = self.max_new_tokens - self.produced - gamma - 1
        fixed = self.record.gamma
        budget = self.gamma_within(left)
        # the guess takes one of the draft's steps: past its limit, no block ahead (a fixed γ
        # must stay what choose_gamma would give, or the seeded text would change)
        next_gamma = min(budget, worker.info.max_speculative_tokens - 1)
        if next_gamma < 1 or (fixed is not None and next_gamma < budget):
            return None
        optimistic = self.committed + list(proposal.candidate_ids)
        build = self.propose_request(next_gamma + 1)
        task = asyncio.create_task(
            self._propose_ahead(optimistic, build, next_gamma + 1, len(self.committed))
        )
        return Ahead(task, gamma, worker.address, next_gamma)

    async def _propose_ahead(self, optimistic, build, steps: int, held: int):
        """The call behind `draft_ahead`, in a `specdec.draft_ahead` span of the round."""
        with span("specdec.draft_ahead", steps=steps, tokens=len(optimistic)):
            return await self.links.propose_ahead(optimistic, build, steps, held)

    async def settle_ahead(self, ahead: Ahead, outcome: RoundOutcome):
        """Wait for the drafted-ahead block; the next round's proposal when this round accepted
        every candidate and its bonus token is the draft's guess, else None (discarded). A
        draft that failed meanwhile is failed over here, as a failed Propose would be."""
        answer = await ahead.task
        hit = False
        if isinstance(answer, draft_pb2.ProposeResponse):
            candidates = list(answer.candidate_ids)
            worker = self.links.draft.worker
            hit = block_ahead_holds(outcome, ahead.gamma, candidates) and (
                worker is not None and worker.address == ahead.address
            )
            self.ctx.count("drafts_ahead", outcome="hit" if hit else "miss")
            log.debug(
                "session %s: block drafted ahead %s (accepted %d/%d, guess %s, bonus %s)",
                self.session_id,
                "used" if hit else "discarded",
                outcome.accepted,
                ahead.gamma,
                candidates[:1],
                outcome.tokens[-1:],
            )
        elif isinstance(answer, Exception):
            self.ctx.count("drafts_ahead", outcome="failed")
            code = answer.code() if isinstance(answer, grpc.aio.AioRpcError) else None
            refused = code is not None and code not in FAILOVER_CODES  # the next Propose says
            worker = self.links.draft.worker
            same = worker is not None and worker.address == ahead.address
            if not (refused or code == BUSY) and same:
                await self.links.draft_failed(ahead.address, answer, self.record.gamma is not None)
        if not hit:
            return None
        self.links.draft.synced = len(self.committed)  # the guess was right: it holds all of it
        self.ready_asked = ahead.asked
        return after_guess(answer)
