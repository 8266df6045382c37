"""What one round of a session's run produced (`RoundOutcome`), its tokens' log-probability
entries as the commit stores them, and what the round leaves besides its commit: metrics, the
policy's observations and the debug log (`RecordsRounds`, a part of `SessionRun`)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from coordinator.cost_model import RoundTiming
from specdec.text.detok import FinishReason, StreamStep
from specdec.v1 import target_pb2

log = logging.getLogger(__name__)


@dataclass
class RoundOutcome:
    """What one round produced, before and after its commit."""

    gamma: int  # candidates verified
    accepted: int
    step: StreamStep  # tokens to commit and their text
    tokens: list[int]
    reason: FinishReason | None = None
    tail: str = ""
    logprobs: list[str] | None = None  # per token, a JSON entry (when the session has them)
    version: int = 0  # the prefix length the commit's compare-and-set expects
    stats: dict | None = None  # the session's statistics as of this round
    draft_forward_s: float = 0.0  # the workers' own times for this round's passes
    verify_forward_s: float = 0.0


def logprob_entries(result: target_pb2.VerifyResponse, n: int) -> list[str]:
    """One JSON entry per committed token: [log p, alternative ids, their log p]."""
    tops = list(result.output_top_logprobs)
    entries = []
    for i in range(n):
        top = tops[i] if i < len(tops) else None
        entries.append(
            json.dumps(
                [
                    result.output_logprobs[i],
                    list(top.token_ids) if top else [],
                    list(top.logprobs) if top else [],
                ]
            )
        )
    return entries


class RecordsRounds:
    """Step 7 of a session's rounds: a part of `SessionRun`, which holds the state these use
    (its context, links, policy, statistics, start time and published tokens)."""

    def record_round(
        self,
        outcome: RoundOutcome,
        proposal,
        result,
        marks,
        round_s: float,
        overlapped: bool,
        asked: int,
    ) -> None:
        """Step 7: metrics, the policy's observations and the debug log. `overlapped`: the
        round's candidates were drafted ahead, during the previous round's verify; `asked`:
        the γ the draft was asked for (more than it proposed when it stopped early)."""
        t0, t1, t2, ahead_wait_s = marks
        gamma, accepted = outcome.gamma, outcome.accepted
        self._observe_metrics(gamma, accepted, outcome.tokens, outcome.reason, round_s)
        timing = RoundTiming(
            round_s=round_s,
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            prefill_s=min(self.links.prefill_s, t2 - t1),
            draft_overlapped=overlapped,
            ahead_wait_s=ahead_wait_s,
            verify_forward_s=result.forward_ns / 1e9,
            verify_queue_s=result.queue_ns / 1e9,
            batch_size=max(result.batch_size, 1),
            batch_positions=result.batch_positions or None,
            batch_seq=result.batch_seq or None,
            worker=self.links.target.worker.address if self.links.target.worker else "",
        )
        if proposal is not None and gamma:
            timing.draft_forward_s = proposal.forward_ns / 1e9
            timing.draft_queue_s = proposal.queue_ns / 1e9
            if proposal.batch_size:  # the draft's pass (a model proposer reports it)
                timing.draft_batch_size = proposal.batch_size
                timing.draft_batch_positions = proposal.batch_positions
        self.policy.observe(gamma, accepted, accepted < gamma, timing, asked=asked)
        self.ctx.shedder.observe(t2 - t1)
        log.debug(
            "session %s round %d: γ=%d accepted=%d draft %.1f ms (queued %.1f, forward %.1f, "
            "in the worker %.1f) verify %.1f ms (queued %.1f, forward %.1f, in the worker %.1f, "
            "%d sessions) round %.1f ms",
            self.session_id,
            self.stats.rounds,
            gamma,
            accepted,
            1000 * (t1 - t0),
            1000 * timing.draft_queue_s,
            1000 * (timing.draft_forward_s or 0.0),
            proposal.total_ns / 1e6 if proposal is not None and gamma else 0.0,
            1000 * (t2 - t1),
            1000 * timing.verify_queue_s,
            1000 * timing.verify_forward_s,
            result.total_ns / 1e6,
            timing.batch_size,
            1000 * round_s,
        )

    def _observe_metrics(
        self, gamma: int, accepted: int, tokens: list[int], reason, round_s
    ) -> None:
        m = self.ctx.metrics
        if m is None:
            return
        m.rounds.add(1)
        m.generated.add(len(tokens))
        m.speculative_tokens.record(gamma)
        if gamma:
            m.drafts.add(1)
            m.draft_tokens.add(gamma)
            m.accepted.add(accepted)
            for position in range(accepted):
                m.accepted_per_pos.add(1, {"position": str(position)})
        m.round_seconds.record(round_s)
        m.acceptance_length.record(accepted + 1)
        if self.stats.rounds == 1 and self.stats.first_token_s is not None:
            m.ttft.record(self.stats.first_token_s)
        if reason is not None:
            m.requests.add(1, {"finish_reason": reason.name})
            elapsed = time.time() - self.started
            m.e2e.record(elapsed)
            if len(self.generated) > 1 and self.stats.first_token_s is not None:
                m.tpot.record((elapsed - self.stats.first_token_s) / (len(self.generated) - 1))
