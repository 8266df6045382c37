"""The speculation loop of one session: propose (draft pool) → verify (target pool) →
commit (Redis, compare-and-set) → publish to streams. Failover moves a session to another
worker with an epoch bump and a full-prefix resync; with no draft left it goes target-only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from coordinator.pool import Worker, WorkerPool
from coordinator.store import LostSession, SessionRecord, SessionStore
from specdec.detok import FinishReason, OutputStream
from specdec.errors import Unavailable
from specdec.kv import fingerprint
from specdec.policy import AdaptiveGamma, RoundTiming
from specdec.telemetry import span
from specdec.v1 import common_pb2, draft_pb2, target_pb2

log = logging.getLogger(__name__)

FAILOVER_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass
class Link:
    """A session's tie to one worker and how much of the committed prefix it holds."""

    worker: Worker | None = None
    synced: int = 0  # committed tokens already sent (0 = send the full prefix)


@dataclass
class Stats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejection_rounds: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    gamma_sum: int = 0
    draft_failovers: int = 0
    target_failovers: int = 0
    takeovers: int = 0
    first_token_s: float | None = None

    def as_dict(self, prompt_tokens: int, generated: int, elapsed_s: float) -> dict:
        rounds = max(self.rounds, 1)
        accepted = self.accepted_tokens
        return {
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_acceptance_length": (accepted + self.rounds) / rounds if self.rounds else 0.0,
            "accepted_per_position": list(self.accepted_per_position),
            "alpha": accepted / (accepted + self.rejection_rounds)
            if accepted + self.rejection_rounds
            else 0.0,
            "time_to_first_token_ms": 1000.0 * (self.first_token_s or 0.0),
            "total_time_ms": 1000.0 * elapsed_s,
            "tokens_per_second": generated / elapsed_s if elapsed_s > 0 else 0.0,
            "mean_speculative_tokens": self.gamma_sum / rounds if self.rounds else 0.0,
            "draft_failovers": self.draft_failovers,
            "target_failovers": self.target_failovers,
            "takeovers": self.takeovers,
        }


class SessionRun:
    """Runs one session to completion on this coordinator (the lease holder)."""

    def __init__(self, coordinator, record: SessionRecord, epoch: int, params, started: float):
        self.c = coordinator
        self.settings = coordinator.settings
        self.store: SessionStore = coordinator.store
        self.record = record
        self.session_id = record.session_id
        self.epoch = epoch
        self.params = params
        self.prompt = list(record.prompt)
        self.generated = list(record.generated)
        self.committed = self.prompt + self.generated  # kept in step with `generated`
        self.max_new_tokens = params.max_new_tokens
        self.started = started
        self.stats = Stats(
            **{
                k: v
                for k, v in record.stats.get("_raw", {}).items()
                if k in Stats.__dataclass_fields__
            }
        )
        self.stats.accepted_per_position = self.stats.accepted_per_position or []
        self.draft = Link()
        self.target = Link()
        self.policy = AdaptiveGamma(self.settings.max_speculative_tokens, self.c.costs)
        self.finish_reason: FinishReason | None = None
        self.changed = asyncio.Event()
        self.cancel_requested = False
        self.error: BaseException | None = None
        self.output = OutputStream(
            coordinator.tokenizer,
            self.prompt,
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
            eos_token_ids=coordinator.eos_token_ids,
            ignore_eos=params.ignore_eos,
            max_new_tokens=self.max_new_tokens,
        )
        if self.generated:  # a takeover: rebuild stop-string state from the committed tokens
            self.output.push(self.generated)

    # --- worker calls ---------------------------------------------------------------

    def _base(self, link: Link) -> tuple[common_pb2.Base, common_pb2.TokenDelta]:
        committed = self.committed
        start = link.synced if 0 < link.synced <= len(committed) else 0
        base = common_pb2.Base(
            session_id=self.session_id,
            epoch=self.epoch,
            base_len=len(committed),
            base_fingerprint=fingerprint(committed),
        )
        return base, common_pb2.TokenDelta(start=start, token_ids=committed[start:])

    async def _call(self, link: Link, method: str, build, timeout: float):
        """Call a worker; a refused base (FAILED_PRECONDITION) is retried once with the full prefix."""
        for attempt in range(2):
            base, delta = self._base(link)
            worker = link.worker
            worker.in_flight += 1
            try:
                return await getattr(worker.stub, method)(build(base, delta), timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and attempt == 0:
                    link.synced = 0
                    continue
                raise
            finally:
                worker.in_flight -= 1
        raise AssertionError("unreachable")

    async def _attach(self, role: str, exclude: set[str]) -> bool:
        """(Re)assign a worker of `role`, bump the epoch in Redis; False when none is left."""
        pool: WorkerPool = self.c.drafts if role == "draft" else self.c.targets
        link = self.draft if role == "draft" else self.target
        remembered = self.record.draft_worker if role == "draft" else self.record.target_worker
        prefer = link.worker.address if link.worker else remembered  # session affinity
        worker = pool.pick(prefer=prefer, exclude=exclude)
        if worker is None:
            await pool.refresh()
            worker = pool.pick(exclude=exclude)
        if link.worker is not None:
            link.worker.sessions.discard(self.session_id)
        link.worker, link.synced = worker, 0
        if worker is not None:
            worker.sessions.add(self.session_id)
        self.epoch = await self.store.reassign(
            self.session_id,
            self.c.owner,
            self.draft.worker.address if self.draft.worker else "",
            self.target.worker.address if self.target.worker else "",
        )
        return worker is not None

    async def _propose(self, gamma: int):
        link = self.draft
        try:
            return await self._call(
                link,
                "Propose",
                lambda base, delta: draft_pb2.ProposeRequest(
                    base=base,
                    delta=delta,
                    num_speculative_tokens=gamma,
                    sampling=self.c.sampling_msg(self.params),
                    seed=self.record.seed,
                ),
                self.settings.draft_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in FAILOVER_CODES:
                raise
            log.warning(
                "session %s: draft %s failed (%s); failing over",
                self.session_id,
                link.worker.address,
                exc.code(),
            )
            self.c.drafts.mark_dead(link.worker.address)
            self.stats.draft_failovers += 1
            self.c.count("failovers", tier="draft")
            await self._attach("draft", exclude={link.worker.address})
            return None  # this round goes target-only

    async def _verify(self, candidates, dists):
        deadline = time.monotonic() + self.settings.worker_timeout_s
        failed: set[str] = set()
        while True:
            if self.target.worker is None and not await self._attach("target", exclude=failed):
                if time.monotonic() > deadline:
                    raise Unavailable("no target worker is available (target tier down)")
                failed.clear()
                await asyncio.sleep(0.2)
                continue
            remaining = self.max_new_tokens - len(self.generated)
            try:
                await self._prefill_if_long()
                return await self._call(
                    self.target,
                    "Verify",
                    lambda base, delta, remaining=remaining: target_pb2.VerifyRequest(
                        base=base,
                        delta=delta,
                        candidate_ids=candidates,
                        draft_dists=dists,
                        sampling=self.c.sampling_msg(self.params),
                        seed=self.record.seed,
                        max_output_tokens=remaining,
                    ),
                    self.settings.worker_timeout_s,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in FAILOVER_CODES:
                    raise
                address = self.target.worker.address
                log.warning(
                    "session %s: target %s failed (%s); failing over",
                    self.session_id,
                    address,
                    exc.code(),
                )
                self.c.targets.mark_dead(address)
                self.stats.target_failovers += 1
                self.c.count("failovers", tier="target")
                failed.add(address)
                self.target.worker = None
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"target worker {address} failed and no other answered in time"
                    ) from exc

    async def _prefill_if_long(self) -> None:
        """Send a long missing prefix as a chunked Prefill, so it does not stall a batch."""
        missing = len(self.committed) - self.target.synced
        if missing > self.settings.prefill_threshold:
            await self._call(
                self.target,
                "Prefill",
                lambda base, delta: target_pb2.PrefillRequest(base=base, delta=delta),
                self.settings.worker_timeout_s,
            )
            self.target.synced = len(self.committed)

    # --- the loop -------------------------------------------------------------------

    def choose_gamma(self) -> int:
        remaining = self.max_new_tokens - len(self.generated)
        fixed = self.record.gamma
        gamma = self.policy.choose() if fixed is None else fixed
        gamma = min(gamma, self.settings.max_speculative_tokens, remaining - 1)
        if self.draft.worker is None:
            return 0
        return max(gamma, 0)

    async def run(self) -> None:
        try:
            if self.record.gamma != 0:
                await self._attach("draft", exclude=set())
            while self.finish_reason is None:
                await self.round()
        except LostSession as exc:
            log.warning("%s; stopping", exc)
            self.c.count("lost")
            self.error = exc
        except BaseException as exc:
            self.error = exc
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("session %s failed", self.session_id)
            raise
        finally:
            self.changed.set()
            if self.record.gamma is None:
                log.debug("session %s policy: %s", self.session_id, self.policy.describe())
            await self.release_workers()

    async def round(self) -> None:
        with span("specdec.round", session_id=self.session_id, epoch=self.epoch):
            await self._round()

    async def _round(self) -> None:
        t0 = time.perf_counter()
        if self.draft.worker is None and self.c.drafts.alive() and self.record.gamma != 0:
            await self._attach("draft", exclude=set())
        gamma = self.choose_gamma()
        candidates, dists, proposal = [], [], None
        if gamma > 0:
            proposal = await self._propose(gamma)
            if proposal is not None:
                self.draft.synced = len(self.committed)
                candidates, dists = list(proposal.candidate_ids), list(proposal.draft_dists)
        t1 = time.perf_counter()
        result = await self._verify(candidates, dists)
        t2 = time.perf_counter()
        self.target.synced = len(self.committed)
        accepted = result.num_accepted
        step = self.output.push(list(result.output_ids))
        tokens = list(result.output_ids)[: step.num_tokens]
        reason = step.finish_reason
        if reason is None and self.cancel_requested:
            reason = FinishReason.CANCELLED
        self._count(len(candidates), accepted)
        self.generated += tokens
        self.committed += tokens
        if self.stats.first_token_s is None and tokens:
            self.stats.first_token_s = time.time() - self.started
        stats = self.stats_dict()
        _, committed_reason = await self.store.commit(
            self.session_id,
            self.c.owner,
            len(self.committed) - len(tokens),
            self.epoch,
            tokens,
            stats,
            reason.name if reason is not None else "",
        )
        if committed_reason and reason is None:  # CancelSession reached us through Redis
            reason = FinishReason[committed_reason]
        if reason == FinishReason.CANCELLED:
            self.output.finish(reason)
        self.finish_reason = reason  # commit before stream (invariant 4)
        round_s = time.perf_counter() - t0
        self._observe(len(candidates), accepted, tokens, reason, round_s)
        self.changed.set()
        self.changed = asyncio.Event()
        timing = RoundTiming(
            round_s=round_s,
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            verify_forward_s=result.forward_ns / 1e9,
            verify_queue_s=result.queue_ns / 1e9,
            batch_size=max(result.batch_size, 1),
            batch_positions=result.batch_positions or None,
            batch_seq=result.batch_seq or None,
            worker=self.target.worker.address if self.target.worker else "",
        )
        if proposal is not None and candidates:
            timing.draft_forward_s = proposal.forward_ns / 1e9
            timing.draft_queue_s = proposal.queue_ns / 1e9
        self.policy.observe(len(candidates), accepted, accepted < len(candidates), timing)
        log.debug(
            "session %s round %d: γ=%d accepted=%d draft %.1f ms verify %.1f ms round %.1f ms",
            self.session_id,
            self.stats.rounds,
            len(candidates),
            accepted,
            1000 * (t1 - t0),
            1000 * (t2 - t1),
            1000 * round_s,
        )

    def _observe(
        self, gamma: int, accepted: int, tokens: list[int], reason, round_s: float
    ) -> None:
        m = self.c.metrics
        if m is None:
            return
        m.rounds.add(1)
        m.generated.add(len(tokens))
        m.draft_tokens.add(gamma)
        m.accepted.add(accepted)
        m.round_seconds.record(round_s)
        m.acceptance_length.record(accepted + 1)
        if self.stats.rounds == 1 and self.stats.first_token_s is not None:
            m.ttft.record(self.stats.first_token_s)
        if reason is not None:
            m.requests.add(1, {"finish_reason": reason.name})

    def _count(self, gamma: int, accepted: int) -> None:
        s = self.stats
        s.rounds += 1
        s.gamma_sum += gamma
        s.draft_tokens += gamma
        s.accepted_tokens += accepted
        s.rejection_rounds += int(accepted < gamma)
        if len(s.accepted_per_position) < gamma:
            s.accepted_per_position += [0] * (gamma - len(s.accepted_per_position))
        for i in range(accepted):
            s.accepted_per_position[i] += 1

    def stats_dict(self) -> dict:
        d = self.stats.as_dict(len(self.prompt), len(self.generated), time.time() - self.started)
        raw = {k: getattr(self.stats, k) for k in Stats.__dataclass_fields__}
        return {**d, "_raw": raw}

    async def release_workers(self) -> None:
        for link in (self.draft, self.target):
            if link.worker is None:
                continue
            link.worker.sessions.discard(self.session_id)
            # NOT_FOUND there already, or the worker is gone: nothing to free either way
            with contextlib.suppress(grpc.aio.AioRpcError):
                await link.worker.stub.Release(
                    common_pb2.ReleaseRequest(session_id=self.session_id), timeout=2.0
                )
