"""Coordinator gRPC service: the public API. Validates requests, creates or resumes
sessions in Redis, runs their loops, and streams committed tokens."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
import uuid

from coordinator.loop import SessionRun
from coordinator.pool import WorkerPool
from coordinator.store import LostSession, SessionRecord, SessionStore
from specdec.client import merge_chunk
from specdec.detok import FinishReason, OutputStream
from specdec.errors import Exhausted, InvalidArgument, NotFound, Unavailable
from specdec.grpc_util import rpc
from specdec.policy import CostModel
from specdec.runtime import vocab_fingerprint
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specdec.worker import check_tokens, sampling_from_proto

log = logging.getLogger(__name__)
SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
FINISH = {r: coordinator_pb2.FinishReason.Value(f"FINISH_REASON_{r.name}") for r in FinishReason}


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, settings, tokenizer, redis):
        self.settings = settings
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_token_ids = [] if eos is None else [int(eos)]
        self.owner = settings.coordinator_id or f"coord-{uuid.uuid4().hex[:12]}"
        self.redis = redis
        self.store = SessionStore(redis, settings.lease_s, settings.session_ttl_s)
        fp = vocab_fingerprint(tokenizer)
        split = lambda s: [a.strip() for a in s.split(",") if a.strip()]  # noqa: E731
        self.drafts = WorkerPool(
            "draft", split(settings.draft_addr), fp, redis, settings.worker_timeout_s
        )
        self.targets = WorkerPool(
            "target", split(settings.target_addr), fp, redis, settings.worker_timeout_s
        )
        self.runs: dict[str, tuple[SessionRun, asyncio.Task]] = {}
        self.costs = CostModel()  # timings the adaptive γ policy of every session shares
        self.metrics = None  # specdec.telemetry.CoordinatorMetrics, set by main
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.refresh_workers()
        task = asyncio.create_task(self._background())
        self._tasks.add(task)

    async def refresh_workers(self) -> None:
        await self.drafts.refresh()
        await self.targets.refresh()

    async def _background(self) -> None:
        """Renew leases of running sessions and re-read the worker registry."""
        period = max(self.settings.lease_s / 4.0, 0.05)
        last_refresh = 0.0
        while True:
            await asyncio.sleep(period)
            for session_id, (run, _task) in list(self.runs.items()):
                if run.finish_reason is not None:
                    continue  # finished: the commit released the lease
                try:
                    if not await self.store.renew(session_id, self.owner, run.epoch):
                        log.warning("lease of %s lost; stopping its loop", session_id)
                        self.runs[session_id][1].cancel()
                except Exception as exc:  # noqa: BLE001 - Redis hiccup: try again next period
                    log.warning("lease renewal failed: %s", exc)
            if time.monotonic() - last_refresh > 2.0:
                last_refresh = time.monotonic()
                try:
                    await self.refresh_workers()
                except Exception as exc:  # noqa: BLE001
                    log.warning("worker refresh failed: %s", exc)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for _, task in list(self.runs.values()):
            task.cancel()
        await self.drafts.close()
        await self.targets.close()

    def count(self, name: str, **attrs) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).add(1, attrs)

    def record_call(self, method: str, code: str) -> None:
        if code != "OK":
            self.count("rejected", method=method, code=code)

    def ready(self) -> bool:
        return bool(self.targets.alive())

    def sampling_msg(self, params) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
        )

    # --- validation -------------------------------------------------------------------

    def _validate(self, request) -> tuple[list[int], object, int | None]:
        s = self.settings
        if request.prompt and request.prompt_token_ids:
            raise InvalidArgument("prompt and prompt_token_ids are exclusive; set one")
        if request.prompt_token_ids:
            prompt = check_tokens(request.prompt_token_ids, self.vocab_size, "prompt_token_ids")
        elif request.prompt:
            prompt = self.tokenizer.encode(request.prompt, add_special_tokens=False)
        else:
            raise InvalidArgument("prompt: one of prompt or prompt_token_ids must be non-empty")
        if not prompt:
            raise InvalidArgument("prompt: encodes to zero tokens")
        if len(prompt) > s.max_prompt_tokens:
            raise InvalidArgument(
                f"prompt: {len(prompt)} tokens exceed --max-prompt-tokens {s.max_prompt_tokens}"
            )
        params = sampling_from_proto(request.sampling)
        check_tokens(params.stop_token_ids, self.vocab_size, "sampling.stop_token_ids")
        if any(not text for text in params.stop):
            raise InvalidArgument("sampling.stop: stop strings must not be empty")
        max_new = params.max_new_tokens or s.default_max_new_tokens
        if max_new > s.max_new_tokens:
            raise InvalidArgument(
                f"sampling.max_new_tokens {max_new} exceeds the limit {s.max_new_tokens}"
            )
        max_context = min((w.info.max_context for w in self.targets.alive()), default=1 << 30)
        max_new = min(max_new, max_context - len(prompt))
        if max_new < 1:
            raise InvalidArgument(
                f"prompt: {len(prompt)} tokens leave no room in the target context {max_context}"
            )
        from dataclasses import replace

        params = replace(params, max_new_tokens=max_new)
        spec = request.speculation
        gamma = spec.num_speculative_tokens if spec.HasField("num_speculative_tokens") else None
        if gamma is not None and gamma > s.max_speculative_tokens:
            raise InvalidArgument(
                f"speculation.num_speculative_tokens {gamma} exceeds --max-speculative-tokens {s.max_speculative_tokens}"
            )
        if request.session_id and not SESSION_ID.match(request.session_id):
            raise InvalidArgument("session_id must match [A-Za-z0-9._:-]{1,128}")
        return prompt, params, gamma

    # --- sessions -----------------------------------------------------------------------

    async def _open(self, request) -> SessionRun | None:
        """Start a new session or find/resume an existing one; None = follow it in Redis."""
        session_id = request.session_id
        if session_id in self.runs:
            return self.runs[session_id][0]
        record = await self.store.load(session_id) if session_id else None
        if record is None:
            prompt, params, gamma = self._validate(request)
            if not self.targets.alive():
                await self.refresh_workers()
                if not self.targets.alive():
                    raise Unavailable("no target worker is available")
            if len(self.runs) >= self.settings.max_sessions:
                raise Exhausted(f"this coordinator runs {len(self.runs)} sessions (--max-sessions)")
            seed = params.seed if params.seed is not None else secrets.randbits(64)
            record = SessionRecord(
                session_id=session_id or uuid.uuid4().hex,
                epoch=0,
                version=len(prompt),
                prompt=prompt,
                generated=[],
                sampling=_params_dict(params),
                seed=seed,
                gamma=gamma,
            )
            if not await self.store.create(record, self.owner):
                return await self._open(request)  # lost a creation race: attach to the winner
            return self._spawn(record, record.epoch, params)
        if record.status == "finished":
            return None
        epoch = await self.store.take_over(record.session_id, self.owner)
        if epoch is None:
            return None  # another live coordinator runs it: follow it in Redis
        record = await self.store.load(record.session_id)
        run = self._spawn(record, epoch, _params_from_dict(record.sampling))
        run.stats.takeovers += 1
        self.count("takeovers")
        log.info(
            "took over session %s at %d generated tokens (epoch %d)",
            record.session_id,
            len(record.generated),
            epoch,
        )
        return run

    def _spawn(self, record: SessionRecord, epoch: int, params) -> SessionRun:
        run = SessionRun(self, record, epoch, params, started=time.time())
        task = asyncio.create_task(run.run())
        self.runs[record.session_id] = (run, task)
        task.add_done_callback(lambda _t, sid=record.session_id: self.runs.pop(sid, None))
        return run

    async def _follow(self, request):
        """Stream (offset, tokens, finish_reason, stats) of a session; take over if orphaned."""
        offset = request.resume_from
        run = await self._open(request)
        session_id = run.session_id if run else request.session_id
        while True:
            if run is not None:
                tokens = run.generated[offset:]
                if tokens:
                    yield session_id, offset, tokens, None, None
                    offset += len(tokens)
                if run.finish_reason is not None and offset >= len(run.generated):
                    yield session_id, offset, [], run.finish_reason, run.stats_dict()
                    return
                if run.error is not None and run.finish_reason is None:
                    if isinstance(run.error, LostSession):
                        run = await self._open(request)  # another coordinator has it: follow
                        continue
                    if isinstance(run.error, asyncio.CancelledError):
                        raise Unavailable("the coordinator is shutting down; resume elsewhere")
                    raise run.error
                await run.changed.wait()
                continue
            record = await self.store.load(session_id)
            if record is None:
                raise NotFound(f"session_id {session_id!r} is unknown or expired")
            tokens = record.generated[offset:]
            if tokens:
                yield session_id, offset, tokens, None, None
                offset += len(tokens)
            if record.status == "finished":
                yield session_id, offset, [], FinishReason[record.finish_reason], record.stats
                return
            if not record.owner:
                run = await self._open(request)
                continue
            await asyncio.sleep(0.02)

    def _text_stream(self, request, prompt_and_prior: list[int], params: dict) -> OutputStream:
        return OutputStream(
            self.tokenizer,
            prompt_and_prior,
            stop=params.get("stop", ()),
            stop_token_ids=(),
            eos_token_ids=(),
            ignore_eos=True,
            max_new_tokens=None,
        )

    async def _chunks(self, request, context):
        text_stream = None
        session_id, finished = request.session_id, False
        try:
            async for session_id, offset, tokens, reason, stats in self._follow(request):
                if text_stream is None:
                    record = await self.store.load(session_id)
                    prior = record.prompt + record.generated[: request.resume_from]
                    text_stream = self._text_stream(request, prior, record.sampling)
                chunk = coordinator_pb2.GenerateChunk(
                    session_id=session_id, offset=offset, token_ids=tokens
                )
                if tokens:
                    chunk.text = text_stream.push(tokens).text
                if reason is not None:
                    finished = True
                    chunk.text += text_stream.finish(FinishReason.LENGTH)
                    chunk.finish_reason = FINISH[reason]
                    chunk.stats.CopyFrom(_stats_msg(stats))
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            if (
                not finished
            ):  # the client went away (cancel, deadline, disconnect): stop its session
                self._cancel_local(session_id)
            raise

    def _cancel_local(self, session_id: str) -> None:
        """Stop a session this coordinator runs; its loop commits CANCELLED and releases workers."""
        if session_id in self.runs:
            self.runs[session_id][0].cancel_requested = True

    # --- RPCs -----------------------------------------------------------------------------

    @rpc
    async def GenerateStream(self, request, context):
        async for chunk in self._chunks(request, context):
            yield chunk

    @rpc
    async def Generate(self, request, context):
        response = coordinator_pb2.GenerateResponse()
        async for chunk in self._chunks(request, context):
            merge_chunk(response, chunk)
        return response

    @rpc
    async def GetSession(self, request, context):
        record = await self.store.load(request.session_id)
        if record is None:
            raise NotFound(f"session_id {request.session_id!r} is unknown or expired")
        params = record.sampling
        return coordinator_pb2.SessionInfo(
            session_id=record.session_id,
            status=coordinator_pb2.SESSION_STATUS_FINISHED
            if record.status == "finished"
            else coordinator_pb2.SESSION_STATUS_RUNNING,
            epoch=record.epoch,
            version=len(record.prompt) + len(record.generated),
            prompt_token_ids=record.prompt,
            generated_token_ids=record.generated,
            sampling=common_pb2.SamplingParams(
                temperature=params["temperature"],
                top_k=params["top_k"],
                top_p=params["top_p"],
                min_p=params["min_p"],
                seed=record.seed,
                max_new_tokens=params["max_new_tokens"],
                stop=params["stop"],
                stop_token_ids=params["stop_token_ids"],
                ignore_eos=params["ignore_eos"],
            ),
            seed=record.seed,
            draft_worker=record.draft_worker,
            target_worker=record.target_worker,
            owner=record.owner,
            finish_reason=FINISH[FinishReason[record.finish_reason]] if record.finish_reason else 0,
            stats=_stats_msg(record.stats),
            created_unix=record.created,
            updated_unix=record.updated,
        )

    @rpc
    async def CancelSession(self, request, context):
        record = await self.store.load(request.session_id)
        if record is None:
            raise NotFound(f"session_id {request.session_id!r} is unknown or expired")
        if record.status != "finished":
            await self.store.cancel(request.session_id)
            self._cancel_local(request.session_id)
        finished = record.status == "finished"
        return coordinator_pb2.CancelSessionResponse(
            status=coordinator_pb2.SESSION_STATUS_FINISHED
            if finished
            else coordinator_pb2.SESSION_STATUS_RUNNING
        )


def _params_dict(params) -> dict:
    return {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "max_new_tokens": params.max_new_tokens,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
    }


def _params_from_dict(d: dict):
    from specdec.sampling import SamplingParams

    return SamplingParams(
        temperature=d["temperature"],
        top_k=d["top_k"],
        top_p=d["top_p"],
        min_p=d["min_p"],
        max_new_tokens=d["max_new_tokens"],
        stop=tuple(d["stop"]),
        stop_token_ids=tuple(d["stop_token_ids"]),
        ignore_eos=d["ignore_eos"],
    )


def _stats_msg(stats: dict) -> coordinator_pb2.GenerationStats:
    fields = coordinator_pb2.GenerationStats.DESCRIPTOR.fields_by_name
    return coordinator_pb2.GenerationStats(
        **{k: v for k, v in (stats or {}).items() if k in fields}
    )
