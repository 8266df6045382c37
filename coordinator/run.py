"""The speculation loop of one session, run by the coordinator that holds its lease.

Each round: choose γ → propose (draft pool) → verify (target pool) → detokenise and apply the
stop conditions → commit to Redis (compare-and-set) → publish to the session's streams →
record statistics, metrics and the policy's observations. Tokens reach `generated` (what
streams read) only after Redis acknowledged them: commit before stream (invariant 4).

The commit runs behind: a round's commit and publish go on while the next round proposes and
verifies from the prefix the workers already hold (`committed`, ahead of `generated` by the
round in flight), and each commit waits for the one before it (the compare-and-set needs
it), as does a failover's epoch bump (the commit carries the epoch it was made at). A lost
lease or a CancelSession seen by that commit ends the session before the next round's tokens
are committed; that round's work is discarded (workers fence stale epochs).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from coordinator.ahead import Ahead, DraftsAhead
from coordinator.context import RunContext
from coordinator.links import SessionLinks
from coordinator.policy import AdaptiveGamma
from coordinator.round_outcome import RecordsRounds, RoundOutcome, logprob_entries
from coordinator.stats import Stats
from coordinator.store import LostSession, SessionRecord
from specdec.core.params import SamplingParams
from specdec.serving.telemetry import span
from specdec.serving.wire import processors_to_proto
from specdec.text.detok import FinishReason, OutputStream
from specdec.v1 import draft_pb2, target_pb2

log = logging.getLogger(__name__)


class SessionRun(DraftsAhead, RecordsRounds):
    """Runs one session to completion on this coordinator (the lease holder)."""

    def __init__(
        self,
        ctx: RunContext,
        record: SessionRecord,
        epoch: int,
        params: SamplingParams,
        started: float,
    ):
        self.ctx = ctx
        self.record = record
        self.session_id = record.session_id
        self.params = params
        self.processors = processors_to_proto(params)
        self.prompt = list(record.prompt)
        self.generated = list(record.generated)  # committed in Redis, in order
        self.texts = list(record.texts)  # per generated token, its text
        self.top_logprobs = record.top_logprobs  # None: the session has no log-probabilities
        self.logprobs = list(record.logprobs)  # per generated token, a JSON entry
        self.tail = ""  # text released at the end, after the last token's
        # the prefix the workers hold: `generated` plus the round whose commit is in flight
        self.committed = self.prompt + self.generated
        self.max_new_tokens = params.max_new_tokens
        self.started = started
        self.stats = Stats.restore(record.stats)
        self.links = SessionLinks(
            ctx,
            self.session_id,
            epoch,
            {"draft": record.draft_worker, "target": record.target_worker},
            self.stats,
        )
        self.policy = AdaptiveGamma(ctx.settings.max_speculative_tokens, ctx.costs)
        self.ahead: Ahead | None = None  # the next block, drafting while this round verifies
        self.ready: draft_pb2.ProposeResponse | None = None  # a drafted-ahead block now valid
        self.ready_asked = 0  # the γ that block was asked for
        self.finish_reason: FinishReason | None = None
        self.changed = asyncio.Event()
        self.cancel_requested = False
        self.error: BaseException | None = None
        self.output = OutputStream(
            ctx.tokenizer,
            self.prompt,
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
            eos_token_ids=ctx.eos_token_ids,
            ignore_eos=params.ignore_eos,
            max_new_tokens=self.max_new_tokens,
        )
        if self.generated:  # a takeover: rebuild stop-string state from the committed tokens
            self.output.push(self.generated)

    @property
    def epoch(self) -> int:
        return self.links.epoch

    # --- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        # commits run as tasks beside the rounds: their spans are the session's, not a round's
        self.outer = contextvars.copy_context()
        try:
            # The first round sends the whole prompt (or a taken-over prefix): only
            # --max-starting sessions at once, so a burst queues here, not on the workers
            async with self.ctx.starting:
                if self.record.gamma != 0:
                    await self.links.attach("draft", exclude=set())
                await self._round()
            while self.finish_reason is None:
                await self._round()
        except LostSession as exc:
            log.warning("%s; stopping", exc)
            self.ctx.count("lost")
            self.error = exc
        except BaseException as exc:
            if not isinstance(self.error, LostSession):  # lease renewal may have said why
                self.error = exc
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("session %s failed", self.session_id)
            raise
        finally:
            self.stop_ahead()  # cancelled or failed mid-round
            await self.settle_landing()
            self.changed.set()
            if self.record.gamma is None:
                log.debug("session %s policy: %s", self.session_id, self.policy.describe())
            await self.links.release()

    async def _round(self) -> None:
        if self.finish_reason is None:
            with span(
                "specdec.round",
                session_id=self.session_id,
                epoch=self.epoch,
                round=self.stats.rounds + 1,
            ) as s:
                outcome = await self.round()
                if s is not None:
                    s.set_attributes(
                        {
                            "gamma": outcome.gamma,
                            "accepted": outcome.accepted,
                            "tokens": len(outcome.tokens),
                        }
                    )

    async def round(self) -> RoundOutcome:
        t0 = time.perf_counter()
        proposal, overlapped, asked = self.ready, self.ready is not None, self.ready_asked
        self.ready = None
        if proposal is None:
            await self._reattach_draft()
            asked = self.choose_gamma()
            proposal = await self.propose(asked) if asked > 0 else None
        t1 = time.perf_counter()
        self.stats.drafted_ahead += int(overlapped)
        self.ahead = self.draft_ahead(proposal)
        result = await self.verify(proposal)
        t2 = time.perf_counter()
        outcome = self.accept(proposal, result)
        await self.landed()  # the previous round's commit: this one's compare-and-set needs it
        if self.finish_reason is not None:  # CancelSession, seen by that commit: discard
            outcome.tokens, outcome.reason = [], self.finish_reason
            self.stop_ahead()
            return outcome
        self.advance(outcome)
        self.links.landing = asyncio.create_task(
            self.commit_and_publish(outcome, self.stats.rounds), context=self.outer.copy()
        )
        if outcome.reason is not None:  # the last round: the session ends once it is published
            await self.landed()
        t3 = time.perf_counter()
        if self.ahead is not None:
            self.ready = await self.settle_ahead(self.ahead, outcome)
            self.ahead = None
        round_s = time.perf_counter() - t0
        marks = (t0, t1, t2, time.perf_counter() - t3)
        self.record_round(outcome, proposal, result, marks, round_s, overlapped, asked)
        return outcome

    async def landed(self) -> None:
        """Wait for the previous round's commit and publish (raises what it raised:
        LostSession ends the run). A failover's epoch bump waits for it too."""
        await self.links.landed()

    async def settle_landing(self) -> None:
        """At the end of a run: a commit still in flight lands (its tokens were verified), or
        is cancelled with the run (a takeover recomputes them)."""
        landing, self.links.landing = self.links.landing, None
        if landing is None:
            return
        if isinstance(self.error, asyncio.CancelledError):
            landing.cancel()
        try:
            await landing
        except (Exception, asyncio.CancelledError) as exc:
            if not isinstance(exc, (LostSession, asyncio.CancelledError)):
                log.warning("session %s: the last commit failed: %r", self.session_id, exc)

    @property
    def produced(self) -> int:
        """Tokens generated so far, the round whose commit is in flight included."""
        return len(self.committed) - len(self.prompt)

    # --- the steps of a round -------------------------------------------------------

    async def _reattach_draft(self) -> None:
        """A session that went target-only gets a draft again as soon as one is alive; one
        with a fixed γ waits for one up to --fixed-gamma-wait-s first (its γ schedule, and
        so its seeded text, then stays that of a run without the outage)."""
        if self.links.draft.worker is not None or self.record.gamma == 0:
            return
        if self.record.gamma is not None and not self.ctx.drafts.alive():
            await self.links.wait_for_draft()
        if self.ctx.drafts.alive():
            await self.links.attach("draft", exclude=set())

    def choose_gamma(self) -> int:
        """The request's γ, else the adaptive policy's; never past the length budget."""
        if self.links.draft.worker is None:
            return 0
        self.policy.pipeline = self.pipeline_mode()
        return max(self.gamma_within(self.max_new_tokens - self.produced), 0)

    def gamma_within(self, remaining: int) -> int:
        """The request's γ, else the adaptive policy's, bounded by --max-speculative-tokens
        and by `remaining` tokens of the length budget (γ candidates and the next token)."""
        fixed = self.record.gamma
        gamma = self.policy.choose() if fixed is None else fixed
        return min(gamma, self.ctx.settings.max_speculative_tokens, remaining - 1)

    def propose_request(self, steps: int):
        """The Propose for `steps` draft steps, as `SessionLinks` builds it (base, delta)."""
        return lambda base, delta: draft_pb2.ProposeRequest(
            base=base,
            delta=delta,
            num_speculative_tokens=steps,
            sampling=self.processors,
            seed=self.record.seed,
            min_confidence=self.ctx.settings.draft_confidence,
        )

    async def propose(self, gamma: int) -> draft_pb2.ProposeResponse | None:
        """Step 1: γ candidates and their q̃ from the draft tier (None: go target-only)."""
        return await self.links.propose(
            self.committed,
            self.propose_request(gamma),
            gamma,
            keep_gamma=self.record.gamma is not None,
        )

    async def verify(self, proposal) -> target_pb2.VerifyResponse:
        """Step 2: the target verifies the candidates (none: a plain decoding step)."""
        candidates = list(proposal.candidate_ids) if proposal is not None else []
        dists = list(proposal.draft_dists) if proposal is not None else []
        remaining = self.max_new_tokens - self.produced
        return await self.links.verify(
            self.committed,
            lambda base, delta: target_pb2.VerifyRequest(
                base=base,
                delta=delta,
                candidate_ids=candidates,
                draft_dists=dists,
                sampling=self.processors,
                seed=self.record.seed,
                max_output_tokens=remaining,
                return_logprobs=self.top_logprobs is not None,
                top_logprobs=self.top_logprobs or 0,
            ),
            candidates,
            remaining,
        )

    def accept(self, proposal, result: target_pb2.VerifyResponse) -> RoundOutcome:
        """Step 3: stop conditions and text for the verified tokens; what ends the session now."""
        gamma = len(proposal.candidate_ids) if proposal is not None else 0
        output_ids = list(result.output_ids)
        step = self.output.push(output_ids)
        reason = step.finish_reason
        tail = step.tail
        if reason is None and self.cancel_requested:
            reason = FinishReason.CANCELLED
            tail = self.output.finish(reason)
        elif reason is None:
            tail = self.output.tail()  # stored only if CancelSession ends the session in Redis
        tokens = output_ids[: step.num_tokens]
        outcome = RoundOutcome(gamma, result.num_accepted, step, tokens, reason, tail)
        outcome.verify_forward_s = result.forward_ns / 1e9
        if proposal is not None:
            outcome.draft_forward_s = proposal.forward_ns / 1e9
        if self.top_logprobs is not None:
            outcome.logprobs = logprob_entries(result, len(tokens))
        return outcome

    def advance(self, outcome: RoundOutcome) -> None:
        """Step 4: the round's tokens join the workers' prefix; its commit is prepared."""
        self.stats.count_round(
            outcome.gamma, outcome.accepted, outcome.draft_forward_s, outcome.verify_forward_s
        )
        if self.stats.first_token_s is None and outcome.tokens:
            self.stats.first_token(time.time() - self.started)
        outcome.version = len(self.committed)
        outcome.stats = self.stats.as_dict(
            len(self.prompt), self.produced + len(outcome.tokens), time.time() - self.started
        )
        self.committed += outcome.tokens  # in place: no call in flight holds the list

    async def commit_and_publish(self, outcome: RoundOutcome, round_no: int) -> None:
        # The next round's first call is queued in this same pass of the event loop: let its
        # stream send it before this commit writes to Redis, so the write (a socket send that
        # wakes Redis) is not on the round's critical path (docs/benchmarks.md, "The commit
        # after the next call").
        await asyncio.sleep(0)
        with span("specdec.commit", tokens=len(outcome.tokens), round=round_no):
            await self.commit(outcome)
        self.publish(outcome)

    async def commit(self, outcome: RoundOutcome) -> None:
        """Step 5: append the round's tokens in Redis (compare-and-set on the version)."""
        _, committed_reason = await self.ctx.store.commit(
            self.session_id,
            self.ctx.owner,
            outcome.version,
            self.epoch,
            outcome.tokens,
            list(outcome.step.texts),
            outcome.stats,
            outcome.reason.name if outcome.reason is not None else "",
            outcome.tail,
            outcome.logprobs,
        )
        if committed_reason and outcome.reason is None:  # CancelSession reached us via Redis
            outcome.reason = FinishReason[committed_reason]
            self.output.finish(outcome.reason)

    def publish(self, outcome: RoundOutcome) -> None:
        """Step 6: what Redis holds now reaches the streams."""
        self.generated += outcome.tokens
        self.texts += outcome.step.texts
        self.logprobs += outcome.logprobs or []
        if outcome.reason is not None:
            self.tail = outcome.tail
        self.finish_reason = outcome.reason
        self.changed.set()
        self.changed = asyncio.Event()

    def stats_dict(self) -> dict:
        return self.stats.as_dict(len(self.prompt), len(self.generated), time.time() - self.started)
