"""Coordinator gRPC service: the public API, as thin adapters over `Sessions`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from coordinator.context import RunContext
from coordinator.cost_model import CostModel
from coordinator.discovery import build_discovery
from coordinator.pool import WorkerPool
from coordinator.sessions import Sessions
from coordinator.settings import CoordinatorSettings
from coordinator.shedding import LoadShedder
from coordinator.store import SessionStore
from specdec.core.params import SamplingParams
from specdec.errors import Exhausted, NotFound
from specdec.serving.metrics import CoordinatorMetrics
from specdec.serving.rpc import rpc
from specdec.serving.wire import check_session_id, merge_chunk, sampling_to_proto, stats_to_proto
from specdec.text.detok import FinishReason
from specdec.text.tokenizer import eos_token_ids, vocab_fingerprint
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


def _addresses(csv: str) -> list[str]:
    return [a.strip() for a in csv.split(",") if a.strip()]


def _status(finished: bool) -> int:
    return (
        coordinator_pb2.SESSION_STATUS_FINISHED
        if finished
        else coordinator_pb2.SESSION_STATUS_RUNNING
    )


def add_logprobs(chunk: coordinator_pb2.GenerateChunk, entries: list[str]) -> None:
    """The stored per-token entries ([log p, ids, log ps]) as the chunk's fields."""
    for entry in entries:
        logprob, ids, values = json.loads(entry)
        chunk.logprobs.append(logprob)
        chunk.top_logprobs.add(token_ids=ids, logprobs=values)


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, settings: CoordinatorSettings, tokenizer, redis):
        self.settings = settings
        self.redis = redis
        fp = vocab_fingerprint(tokenizer)
        timeout, tls = settings.worker_timeout_s, settings.worker_tls()
        self.discovery = build_discovery(settings, redis)  # shared by both pools

        def pool(role: str, static: str) -> WorkerPool:
            return WorkerPool(
                role,
                _addresses(static),
                fp,
                None,
                timeout,
                tls,
                self.discovery,
                settings.worker_streams,
            )

        metrics = (
            CoordinatorMetrics(lambda: len(self.sessions)) if settings.metrics_port > 0 else None
        )
        self.ctx = RunContext(
            settings=settings,
            store=SessionStore(
                redis,
                settings.lease_s,
                settings.session_ttl_s,
                observe=metrics.observe_redis if metrics is not None else None,
            ),
            drafts=pool("draft", settings.draft_addr),
            targets=pool("target", settings.target_addr),
            costs=CostModel(max_gamma=settings.max_speculative_tokens),
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids(tokenizer),
            owner=settings.coordinator_id or f"coord-{uuid.uuid4().hex[:12]}",
            shedder=LoadShedder(settings.shed_verify_s),
            starting=asyncio.Semaphore(settings.max_starting),
            metrics=metrics,
        )
        self.sessions = Sessions(self.ctx)
        self.ctx.costs.running = lambda: len(self.sessions)  # the batch plans' load level
        self.draining = False  # SIGTERM: ending streams hand sessions over, never cancel them
        self.streams = 0  # Generate and GenerateStream calls being served
        self.attached: dict[str, int] = {}  # session id → its streams (ids sent by clients)
        self._tasks: set[asyncio.Task] = set()

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        await self.discovery.start()
        await self.refresh_workers()
        task = asyncio.create_task(self._background())
        self._tasks.add(task)

    async def refresh_workers(self) -> None:
        await self.ctx.drafts.refresh()
        await self.ctx.targets.refresh()

    async def _background(self) -> None:
        """Renew leases of running sessions and re-read the worker registry."""
        period = max(self.settings.lease_s / 4.0, 0.05)
        last_refresh = 0.0
        while True:
            await asyncio.sleep(period)
            await self.sessions.renew_leases()
            if time.monotonic() - last_refresh > 2.0:
                last_refresh = time.monotonic()
                try:
                    await self.refresh_workers()
                except Exception as exc:  # noqa: BLE001
                    log.warning("worker refresh failed: %s", exc)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.sessions.stop()
        await self.ctx.drafts.close()
        await self.ctx.targets.close()
        await self.discovery.close()

    def ready(self) -> bool:
        return bool(self.ctx.targets.alive())

    def record_call(self, method: str, code: str) -> None:
        if code != "OK":
            self.ctx.count("rejected", method=method, code=code)

    # --- RPCs -------------------------------------------------------------------------

    async def chunks(self, request):
        """The chunks of one Generate call (gRPC and the HTTP gateway alike)."""
        if self.streams >= self.settings.max_streams:
            raise Exhausted(f"this coordinator serves {self.streams} streams (--max-streams)")
        session_id, finished = request.session_id, False
        attached = self.attached.get(session_id, 0) if session_id else 0
        if attached >= self.settings.max_streams_per_session:
            raise Exhausted(f"{attached} streams follow this session (--max-streams-per-session)")
        self.streams += 1
        if session_id:
            self.attached[session_id] = attached + 1
        try:
            async for update in self.sessions.follow(request):
                session_id = update.session_id
                chunk = coordinator_pb2.GenerateChunk(
                    session_id=session_id,
                    offset=update.offset,
                    token_ids=update.token_ids,
                    text=update.text,
                )
                add_logprobs(chunk, update.logprobs)
                if update.finish_reason is not None:
                    finished = True
                    chunk.finish_reason = int(update.finish_reason)
                    chunk.stats.CopyFrom(stats_to_proto(update.stats))
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            # the client went away (cancel, deadline, disconnect): stop the session, unless
            # another stream on this coordinator still follows it
            alone = self.attached.get(request.session_id, 1) <= 1
            if not finished and alone and not self.draining:
                self.sessions.cancel_local(session_id)
            raise
        finally:
            self.streams -= 1
            if request.session_id:
                left = self.attached.pop(request.session_id) - 1
                if left:
                    self.attached[request.session_id] = left

    @rpc
    async def GenerateStream(self, request, context):
        async for chunk in self.chunks(request):
            yield chunk

    @rpc
    async def Generate(self, request, context):
        response = coordinator_pb2.GenerateResponse()
        async for chunk in self.chunks(request):
            merge_chunk(response, chunk)
        return response

    @rpc
    async def GetSession(self, request, context):
        check_session_id(request.session_id)
        record = await self.ctx.store.load(request.session_id)
        if record is None:
            raise NotFound(f"session_id {request.session_id!r} is unknown or expired")
        params = SamplingParams.from_dict(record.sampling, record.seed)
        return coordinator_pb2.SessionInfo(
            session_id=record.session_id,
            status=_status(record.status == "finished"),
            epoch=record.epoch,
            version=len(record.prompt) + len(record.generated),
            prompt_token_ids=record.prompt,
            generated_token_ids=record.generated,
            sampling=sampling_to_proto(params),
            seed=record.seed,
            draft_worker=record.draft_worker,
            target_worker=record.target_worker,
            owner=record.owner,
            finish_reason=int(FinishReason[record.finish_reason]) if record.finish_reason else 0,
            stats=stats_to_proto(record.stats),
            created_unix=record.created,
            updated_unix=record.updated,
        )

    @rpc
    async def CancelSession(self, request, context):
        check_session_id(request.session_id)
        record = await self.ctx.store.load(request.session_id)
        if record is None:
            raise NotFound(f"session_id {request.session_id!r} is unknown or expired")
        finished = record.status == "finished"
        if not finished:
            await self.ctx.store.cancel(request.session_id)
            self.sessions.cancel_local(request.session_id)
        return coordinator_pb2.CancelSessionResponse(status=_status(finished))
