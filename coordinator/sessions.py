"""The sessions of one coordinator: create, resume or take over, run, follow, keep leases.

A session is run by exactly one coordinator, the holder of its lease in Redis. A client
attached to another coordinator (or reattaching with the same session id) follows the
session's committed tokens in Redis, and takes the session over when its owner's lease has
expired. Streams only ever see what Redis holds (commit before stream).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from coordinator.admission import Encoder, admit
from coordinator.context import RunContext
from coordinator.run import SessionRun
from coordinator.store import LostSession, SessionRecord
from specdec.core.params import SamplingParams
from specdec.errors import Conflict, Exhausted, InvalidArgument, NotFound, OutOfRange, Unavailable
from specdec.serving.telemetry import flush_soon, span
from specdec.text.detok import FinishReason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """Committed tokens of a session from `offset` on, with their text; the last has the end."""

    session_id: str
    offset: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    stats: dict | None = None
    logprobs: list[str] = field(default_factory=list)  # per token, when the session has them


class Sessions:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.encoder = Encoder(ctx.tokenizer)
        self.runs: dict[str, tuple[SessionRun, asyncio.Task]] = {}

    def __len__(self) -> int:
        return len(self.runs)

    # --- opening ----------------------------------------------------------------------

    async def open(self, request) -> SessionRun | None:
        """Start a new session or find/resume an existing one; None = follow it in Redis."""
        session_id = request.session_id
        if not session_id:
            return await self._create(request)
        entry = self.runs.get(session_id)
        record = entry[0].record if entry else await self.ctx.store.load(session_id)
        if record is None:
            if request.resume_from:
                # NOT_FOUND, not INVALID_ARGUMENT: whether it exists is state (it may have
                # expired, or an external Redis lost it); a resume never starts a new one
                raise NotFound(
                    f"resume_from: session_id {session_id!r} does not exist or expired "
                    "(a new session starts at 0)"
                )
            return await self._create(request)
        await self._check_reattach(request, record)
        return await self._attach(session_id)

    def _max_context(self) -> int:
        """The smallest context window of the live target workers (admission's bound)."""
        return min((w.info.max_context for w in self.ctx.targets.alive()), default=1 << 30)

    async def _check_reattach(self, request, record: SessionRecord) -> None:
        """A request naming an existing session either only reattaches (no prompt) or repeats
        the session's request exactly: never silently the old session for a new request."""
        has_prompt = request.prompt or request.prompt_token_ids or request.messages
        if has_prompt:
            admission = await admit(request, self.ctx.settings, self.encoder, self._max_context())
            same_sampling = {
                k: v for k, v in admission.params.to_dict().items() if k != "seed"
            } == {k: v for k, v in record.sampling.items() if k != "seed"}
            same_logprobs = admission.top_logprobs == record.top_logprobs
            if admission.prompt != record.prompt or not same_sampling or not same_logprobs:
                raise Conflict(
                    f"session_id {record.session_id!r} exists with another prompt or sampling "
                    "parameters; use a new session_id, or send only session_id and resume_from "
                    "to reattach"
                )
            if admission.params.seed is not None and admission.params.seed != record.seed:
                raise Conflict(f"session_id {record.session_id!r} exists with another seed")

    async def _attach(self, session_id: str) -> SessionRun | None:
        """An existing session: this coordinator's live run, a takeover when its owner's lease
        has expired, or None to follow it in Redis. Never creates a session: a follower whose
        session vanished gets NOT_FOUND, never another generation under the same stream."""
        entry = self.runs.get(session_id)
        if entry is not None:
            run, task = entry
            if not isinstance(run.error, LostSession):
                return run
            # a run that lost its lease, still releasing its workers: wait for it to end
            # (it yields), then look at Redis like any other coordinator would
            await asyncio.wait({task})
            if self.runs.get(session_id) is entry:
                self.runs.pop(session_id)
        record = await self.ctx.store.load(session_id)
        if record is None:
            raise NotFound(f"session_id {session_id!r} is unknown or expired")
        if record.status == "finished":
            return None
        epoch = await self.ctx.store.take_over(record.session_id, self.ctx.owner)
        if epoch is None:
            return None  # another live coordinator runs it: follow it in Redis
        with span("specdec.takeover", session_id=session_id) as s:
            record = await self.ctx.store.load(record.session_id)
            if record is None:
                raise NotFound(f"session_id {session_id!r} is unknown or expired")
            if s is not None:
                s.set_attributes({"epoch": epoch, "generated": len(record.generated)})
            # the run's rounds are children of this span (its task copies the context)
            run = self._spawn(record, epoch, SamplingParams.from_dict(record.sampling, record.seed))
        flush_soon()
        run.stats.takeovers += 1
        self.ctx.count("takeovers")
        log.info(
            "took over session %s at %d generated tokens (epoch %d)",
            record.session_id,
            len(record.generated),
            epoch,
        )
        return run

    async def _create(self, request) -> SessionRun | None:
        targets = self.ctx.targets
        admission = await admit(request, self.ctx.settings, self.encoder, self._max_context())
        if not targets.alive():
            await targets.refresh()
            if not targets.alive():
                raise Unavailable("no target worker is available")
        if len(self.runs) >= self.ctx.settings.max_sessions:
            raise Exhausted(f"this coordinator runs {len(self.runs)} sessions (--max-sessions)")
        slow = self.ctx.shedder.saturated()
        if slow is not None:
            self.ctx.count("shed")
            raise Exhausted(
                f"the target tier is saturated: verify steps take {slow:.1f} s "
                f"(--shed-verify-s {self.ctx.settings.shed_verify_s:g}); retry later"
            )
        params = admission.params
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        record = SessionRecord(
            session_id=request.session_id or uuid.uuid4().hex,
            epoch=0,
            version=len(admission.prompt),
            prompt=admission.prompt,
            generated=[],
            sampling=params.to_dict(),
            seed=seed,
            gamma=admission.gamma,
            top_logprobs=admission.top_logprobs,
        )
        if not await self.ctx.store.create(record, self.ctx.owner):
            return await self._attach(record.session_id)  # lost a creation race: the winner's
        if self.ctx.metrics is not None:
            self.ctx.metrics.prompt_tokens.add(len(record.prompt))
        return self._spawn(record, record.epoch, params)

    def _spawn(self, record: SessionRecord, epoch: int, params: SamplingParams) -> SessionRun:
        run = SessionRun(self.ctx, record, epoch, params, started=time.time())
        task = asyncio.create_task(run.run())
        self.runs[record.session_id] = (run, task)
        task.add_done_callback(lambda _t, sid=record.session_id: self.runs.pop(sid, None))
        return run

    # --- following --------------------------------------------------------------------

    async def follow(self, request) -> AsyncIterator[Update]:
        """Committed tokens of a session from `request.resume_from`; take over if orphaned."""
        offset = request.resume_from
        if offset and not request.session_id:
            raise InvalidArgument("resume_from needs the session_id of an existing session")
        run = await self.open(request)
        session_id = run.session_id if run else request.session_id
        if run is not None:
            committed = len(run.generated)
        else:
            record = await self.ctx.store.load(session_id)
            committed = len(record.generated) if record is not None else 0
        if offset > committed:
            raise OutOfRange(
                f"resume_from {offset} is beyond the {committed} tokens session "
                f"{session_id!r} has generated"
            )
        while True:
            if run is not None:
                if len(run.generated) > offset:
                    tokens = run.generated[offset:]
                    update = Update(
                        session_id,
                        offset,
                        tokens,
                        "".join(run.texts[offset:]),
                        logprobs=run.logprobs[offset:],
                    )
                    # advanced before the yield: while the chunk is written the run may
                    # publish more, which the next update must start with, not skip
                    offset += len(tokens)
                    yield update
                    continue
                if run.finish_reason is not None and offset >= len(run.generated):
                    yield Update(
                        session_id, offset, [], run.tail, run.finish_reason, run.stats_dict()
                    )
                    return
                if run.error is not None and run.finish_reason is None:
                    if isinstance(run.error, LostSession):
                        run = await self._attach(session_id)  # another coordinator has it
                        continue
                    if isinstance(run.error, asyncio.CancelledError):
                        raise Unavailable("the coordinator is shutting down; resume elsewhere")
                    raise run.error
                await run.changed.wait()
                continue
            record = await self.ctx.store.load(session_id)
            if record is None:
                raise NotFound(f"session_id {session_id!r} is unknown or expired")
            if len(record.generated) > offset:
                yield Update(
                    session_id,
                    offset,
                    record.generated[offset:],
                    "".join(record.texts[offset:]),
                    logprobs=record.logprobs[offset:],
                )
                offset = len(record.generated)
            if record.status == "finished":
                reason = FinishReason[record.finish_reason]
                yield Update(session_id, offset, [], record.tail, reason, record.stats)
                return
            if not record.owner:
                run = await self._attach(session_id)
                continue
            await asyncio.sleep(0.02)

    def cancel_local(self, session_id: str) -> None:
        """Stop a session this coordinator runs; its loop commits CANCELLED and releases workers."""
        if session_id in self.runs:
            self.runs[session_id][0].cancel_requested = True

    # --- leases -----------------------------------------------------------------------

    async def renew_leases(self) -> None:
        """Extend the leases of every running session in one pipeline; stop the loops whose
        lease is lost (a paused coordinator whose sessions were taken over)."""
        running = [
            (session_id, run, task)
            for session_id, (run, task) in list(self.runs.items())
            if run.finish_reason is None  # finished: the commit released the lease
        ]
        try:
            kept = await self.ctx.store.renew_all(
                self.ctx.owner, [(session_id, run.epoch) for session_id, run, _ in running]
            )
        except Exception as exc:  # noqa: BLE001 - Redis hiccup: try again next period
            log.warning("lease renewal failed: %s: %s", type(exc).__name__, exc)
            return
        for (session_id, run, task), ok in zip(running, kept):
            if not ok:
                log.warning("lease of %s lost; stopping its loop", session_id)
                run.error = LostSession(f"lease of session {session_id} lost")
                task.cancel()

    async def stop(self) -> None:
        """Stop every loop (each releases its workers), then give up their leases so another
        coordinator takes the sessions over at once instead of after the lease time: a
        rolling update hands sessions over; it never ends them."""
        entries = list(self.runs.items())
        for _, (_, task) in entries:
            task.cancel()
        await asyncio.gather(*(task for _, (_, task) in entries), return_exceptions=True)
        running = [sid for sid, (run, _) in entries if run.finish_reason is None]
        try:
            await self.ctx.store.release_all(self.ctx.owner, running)
        except Exception as exc:  # noqa: BLE001 - Redis down: the leases expire by themselves
            log.warning("could not release leases: %s: %s", type(exc).__name__, exc)
