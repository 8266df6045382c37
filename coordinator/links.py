"""A session's ties to its draft and target workers: bases, resync, failover, release.

Every worker request carries the session's base (session id, epoch, committed length and
its fingerprint) and the committed tokens the worker lacks. A worker that cannot prove it
holds the prefix refuses (FAILED_PRECONDITION) and the call is repeated once with the whole
prefix. A worker that fails moves the session to another one of its tier with an epoch bump
(the old worker then refuses the stale epoch); with no draft left a session goes target-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import grpc

from coordinator.context import RunContext
from coordinator.pool import Worker
from coordinator.stats import Stats
from coordinator.store import LostSession
from specdec.core.prefix import PrefixDigest
from specdec.errors import InvalidArgument, Unavailable
from specdec.serving.telemetry import client_span, flush_soon, span, trace_metadata
from specdec.serving.wire import check_draft_dists, check_tokens
from specdec.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)

FAILOVER_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}
# A full worker (RESOURCE_EXHAUSTED) is back-pressure, not a failure: the draft round goes
# target-only, a verify waits (backing off) and moves to another target after a few tries;
# neither marks the worker dead.
BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED
# A worker whose answer was inconsistent gets no session for this long (a failed one: 5 s).
BAD_ANSWER_QUARANTINE_S = 300.0


class BadAnswer(Exception):
    """A worker's answer that cannot be right for what it was asked (never committed)."""


def check_proposal(response: draft_pb2.ProposeResponse, gamma: int, vocab: int) -> None:
    """Raise BadAnswer unless the draft sent at most γ candidates inside the vocabulary, each
    with a valid q̃ that gives it positive probability."""
    candidates = list(response.candidate_ids)
    if len(candidates) > gamma:
        raise BadAnswer(f"{len(candidates)} candidates for γ = {gamma}")
    try:
        check_tokens(candidates, vocab, "candidate_ids")
        check_draft_dists(candidates, response.draft_dists, vocab)
    except InvalidArgument as exc:
        raise BadAnswer(str(exc)) from exc


def check_verdict(
    response: target_pb2.VerifyResponse, candidates: list[int], max_output: int, vocab: int
) -> None:
    """Raise BadAnswer unless the target's output is consistent with what it was asked: the
    accepted prefix of the candidates (at most the budget allows) plus one token, inside the
    vocabulary."""
    accepted = response.num_accepted
    offered = min(len(candidates), max_output - 1) if max_output else len(candidates)
    output = list(response.output_ids)
    if accepted > offered:
        raise BadAnswer(f"num_accepted {accepted} of {offered} candidates")
    if len(output) != accepted + 1:
        raise BadAnswer(f"{len(output)} output tokens for {accepted} accepted (expected +1)")
    if output[:accepted] != candidates[:accepted]:
        raise BadAnswer("the accepted output tokens differ from the candidates")
    try:
        check_tokens(output, vocab, "output_ids")
    except InvalidArgument as exc:
        raise BadAnswer(str(exc)) from exc


@dataclass
class Link:
    """A session's tie to one worker and how much of the committed prefix it holds."""

    worker: Worker | None = None
    synced: int = 0  # committed tokens already sent (0 = send the full prefix)


class SessionLinks:
    """The draft and target workers of one session, and the epoch that binds them."""

    def __init__(
        self, ctx: RunContext, session_id: str, epoch: int, remembered: dict, stats: Stats
    ):
        self.ctx = ctx
        self.session_id = session_id
        self.epoch = epoch
        self.remembered = remembered  # role → address recorded in Redis (session affinity)
        self.stats = stats
        self.draft = Link()
        self.target = Link()
        self.draft_wait_spent = False  # a fixed-γ session waited out a draft outage
        self.prefill_s = 0.0  # of the last verify: spent on a chunked Prefill before it
        # the digest of the committed prefix so far (it only grows during a run)
        self.prefix = PrefixDigest()
        # the round's commit still in flight (SessionRun's; the commit runs behind the next
        # round's calls): it carries this epoch, so an epoch bump waits for it to land
        self.landing: asyncio.Task | None = None

    async def landed(self) -> None:
        """Wait for the commit in flight (raises what it raised: LostSession ends the run)."""
        if self.landing is not None:
            landing, self.landing = self.landing, None
            await landing

    def link(self, role: str) -> Link:
        return self.draft if role == "draft" else self.target

    def _base(self, link: Link, committed: list[int], stable: int):
        """The base and delta of a call for the prefix `committed`, whose first `stable`
        tokens are the session's committed ones (the rest: candidates drafted ahead)."""
        start = link.synced if 0 < link.synced <= len(committed) else 0
        base = common_pb2.Base(
            session_id=self.session_id,
            epoch=self.epoch,
            base_len=len(committed),
            base_fingerprint=self.prefix.of(committed, stable),
        )
        return base, common_pb2.TokenDelta(start=start, token_ids=committed[start:])

    async def _call(
        self,
        link: Link,
        method: str,
        committed: list[int],
        build,
        timeout: float,
        stable: int | None = None,
    ):
        """Call a worker about the prefix `committed` (its first `stable` tokens committed;
        default all); a refused base (FAILED_PRECONDITION) is retried once with the full
        prefix (a `specdec.resync` span)."""
        tier = "draft" if link is self.draft else "target"
        stable = len(committed) if stable is None else stable
        try:
            return await self._send(link, tier, method, committed, build, timeout, stable)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        link.synced = 0
        self.ctx.count("resyncs", tier=tier)
        with span("specdec.resync", tier=tier, tokens=len(committed)):
            try:
                return await self._send(link, tier, method, committed, build, timeout, stable)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    await self._check_still_ours(exc)
                raise

    async def _check_still_ours(self, refusal: grpc.aio.AioRpcError) -> None:
        """A worker refused the base even with the whole prefix: when another coordinator
        has moved the session to a later epoch meanwhile (this one stalled past its lease and
        the lease renewal has not told it yet), that is a lost session — the run stops and
        its streams follow the new owner — not a failure."""
        record = await self.ctx.store.load(self.session_id)
        if record is None or record.epoch > self.epoch:
            now = "expired" if record is None else f"at epoch {record.epoch}"
            raise LostSession(
                f"session {self.session_id}: a worker refused epoch {self.epoch} (the session "
                f"is {now})"
            ) from refusal

    async def _send(
        self,
        link: Link,
        tier: str,
        method: str,
        committed: list[int],
        build,
        timeout: float,
        stable: int,
    ):
        base, delta = self._base(link, committed, stable)
        worker = link.worker
        worker.in_flight += 1
        try:
            with client_span(f"{tier}/{method}", worker=worker.address, delta=len(delta.token_ids)):
                response = await worker.call(method)(
                    build(base, delta), timeout=timeout, metadata=trace_metadata()
                )
            link.synced = len(committed)
            return response
        finally:
            worker.in_flight -= 1

    async def attach(self, role: str, exclude: set[str]) -> bool:
        """(Re)assign a worker of `role`, bump the epoch in Redis; False when none is left."""
        pool, link = self.ctx.pool(role), self.link(role)
        prefer = link.worker.address if link.worker else self.remembered.get(role, "")
        worker = pool.pick(prefer=prefer, exclude=exclude)
        if worker is None:
            await pool.refresh()
            worker = pool.pick(exclude=exclude)
        if link.worker is not None:
            link.worker.sessions.discard(self.session_id)
        link.worker, link.synced = worker, 0
        if worker is not None:
            worker.sessions.add(self.session_id)
            if role == "draft":
                self.draft_wait_spent = False  # the next outage may be waited for again
        # A commit still in flight compares the current epoch in Redis: bumped first, it would
        # fail and the run would lose its own session (a takeover to recover it)
        await self.landed()
        self.epoch = await self.ctx.store.reassign(
            self.session_id,
            self.ctx.owner,
            self.draft.worker.address if self.draft.worker else "",
            self.target.worker.address if self.target.worker else "",
        )
        return worker is not None

    def _failed(self, role: str, address: str, exc: Exception) -> None:
        if isinstance(exc, BadAnswer):
            log.error(
                "session %s: %s %s answered inconsistently (%s); failing over",
                self.session_id,
                role,
                address,
                exc,
            )
            self.ctx.count("bad_answers", tier=role)
            # it answers Info well: out for the whole quarantine, without a probe
            self.ctx.pool(role).mark_dead(address, BAD_ANSWER_QUARANTINE_S, probe=False)
        else:
            log.warning(
                "session %s: %s %s failed (%s); failing over",
                self.session_id,
                role,
                address,
                exc.code(),
            )
            self.ctx.pool(role).mark_dead(address)
        if role == "draft":
            self.stats.draft_failovers += 1
        else:
            self.stats.target_failovers += 1
        self.ctx.count("failovers", tier=role)

    async def propose(
        self, committed: list[int], build, gamma: int, keep_gamma: bool = False
    ) -> draft_pb2.ProposeResponse | None:
        """Candidates from the draft; None when it failed, was full or answered nonsense (this
        round then goes target-only).

        With `keep_gamma` (the request fixed γ) a failed draft is replaced and the round is
        proposed again on the new one (each failed draft is out for a while, so this ends),
        and a full one is waited for (within --draft-timeout-s), so the γ schedule — and with it a seeded sampled text — is the
        same as in a run without the fault; target-only only when no draft answers."""
        deadline = time.monotonic() + self.ctx.settings.draft_timeout_s
        busy = 0
        while self.draft.worker is not None:
            address = self.draft.worker.address
            try:
                response = await self._call(
                    self.draft, "Propose", committed, build, self.ctx.settings.draft_timeout_s
                )
                check_proposal(response, gamma, self.draft.worker.info.vocab_size)
                return response
            except (grpc.aio.AioRpcError, BadAnswer) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == BUSY:
                    self.ctx.count("backpressure", tier="draft")
                    busy += 1
                    if not keep_gamma or time.monotonic() > deadline:
                        return None
                    await asyncio.sleep(min(0.2, 0.005 * 2**busy))
                    continue
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in FAILOVER_CODES:
                    raise
                attached = await self.draft_failed(address, exc, keep_gamma)
                if not (keep_gamma and attached):  # a failed draft is out for 5 s: bounded
                    return None
        return None

    async def draft_failed(self, address: str, exc: Exception, keep_gamma: bool) -> bool:
        """Move the session off a failed draft (a `specdec.failover` span); with `keep_gamma`
        wait for one to come back when none is left. True when a draft is attached."""
        with span("specdec.failover", tier="draft", worker=address) as s:
            self._failed("draft", address, exc)
            attached = await self.attach("draft", exclude={address})
            if s is not None:
                s.set_attribute("to", self.draft.worker.address if attached else "")
        flush_soon()
        if keep_gamma and not attached:  # none left: wait for one to come back
            attached = await self.wait_for_draft()
        return attached

    async def propose_ahead(
        self, optimistic: list[int], build, gamma: int, held: int
    ) -> draft_pb2.ProposeResponse | Exception | None:
        """The next block, drafted from `optimistic` (the committed prefix and this round's
        candidates) while the target verifies them: one attempt on the session's draft, no
        failover and no waiting (the caller fails over after the round if it must). Returns
        the answer, or the exception it ended with. The draft is afterwards known to hold only
        the first `held` tokens (the optimistic ones may yet be rejected)."""
        link = self.draft
        if link.worker is None:
            return None
        try:
            response = await self._call(
                link, "Propose", optimistic, build, self.ctx.settings.draft_timeout_s, held
            )
            check_proposal(response, gamma, link.worker.info.vocab_size)
            return response
        except (grpc.aio.AioRpcError, BadAnswer) as exc:
            return exc
        finally:
            link.synced = min(link.synced, held)

    async def wait_for_draft(self) -> bool:
        """Poll the draft pool until a worker is alive again (then attach it), at most
        --fixed-gamma-wait-s once per outage: False when none came back (the session then
        goes target-only without waiting again until a draft is back)."""
        if self.draft_wait_spent:
            return False
        deadline = time.monotonic() + self.ctx.settings.fixed_gamma_wait_s
        pool = self.ctx.drafts
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            await pool.refresh()
            if pool.alive() and await self.attach("draft", exclude=set()):
                return True
        self.draft_wait_spent = True
        return False

    async def verify(
        self, committed: list[int], build, candidates: list[int], max_output: int
    ) -> target_pb2.VerifyResponse:
        """The target's verdict, failing over to another target until the deadline (also
        when a target answers something inconsistent with the candidates)."""
        settings = self.ctx.settings
        deadline = time.monotonic() + settings.worker_timeout_s
        failed: set[str] = set()
        busy = 0
        self.prefill_s = 0.0
        while True:
            if self.target.worker is None and not await self.attach("target", exclude=failed):
                if time.monotonic() > deadline:
                    raise Unavailable("no target worker is available (target tier down)")
                failed.clear()
                await asyncio.sleep(0.2)
                continue
            try:
                await self._prefill_if_long(committed)
                response = await self._call(
                    self.target, "Verify", committed, build, settings.worker_timeout_s
                )
                check_verdict(response, candidates, max_output, self.target.worker.info.vocab_size)
                return response
            except grpc.aio.AioRpcError as exc:
                if exc.code() == BUSY:
                    busy += 1
                    self.ctx.count("backpressure", tier="target")
                    if time.monotonic() > deadline:
                        raise Unavailable("the target tier stayed full past the deadline") from exc
                    if busy % 3 == 0:  # try a less loaded target; the same one if none
                        await self.attach("target", exclude={self.target.worker.address})
                    await asyncio.sleep(min(0.5, 0.01 * 2**busy))
                    continue
                if exc.code() not in FAILOVER_CODES:
                    raise
                failure: Exception = exc
            except BadAnswer as exc:
                failure = exc
            address = self.target.worker.address
            with span("specdec.failover", tier="target", worker=address):
                self._failed("target", address, failure)
            flush_soon()
            failed.add(address)
            self.target.worker = None
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"target worker {address} failed and no other answered in time"
                ) from failure

    async def _prefill_if_long(self, committed: list[int]) -> None:
        """Send a long missing prefix as a chunked Prefill, so it does not stall a batch."""
        missing = len(committed) - self.target.synced
        if missing > self.ctx.settings.prefill_threshold:
            t0 = time.perf_counter()
            with span("specdec.prefill", tokens=missing):
                await self._call(
                    self.target,
                    "Prefill",
                    committed,
                    lambda base, delta: target_pb2.PrefillRequest(base=base, delta=delta),
                    self.ctx.settings.worker_timeout_s,
                )
            self.prefill_s += time.perf_counter() - t0

    async def release(self) -> None:
        """Free the session's KV on both workers (best effort: a dead worker holds nothing).
        Its span may end after the request's: the stream has its last token by then."""
        with span("specdec.release"):
            await self._release()

    async def _release(self) -> None:
        for link in (self.draft, self.target):
            if link.worker is None:
                continue
            link.worker.sessions.discard(self.session_id)
            # NOT_FOUND there already, or the worker is gone: nothing to free either way
            tier = "draft" if link is self.draft else "target"
            with (
                contextlib.suppress(grpc.aio.AioRpcError),
                client_span(f"{tier}/Release", worker=link.worker.address),
            ):
                await link.worker.stub.Release(
                    common_pb2.ReleaseRequest(session_id=self.session_id, epoch=self.epoch),
                    timeout=2.0,
                    metadata=trace_metadata(),
                )
