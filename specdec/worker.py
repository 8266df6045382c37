"""Plumbing shared by the draft and target workers: the session table (base checks, sync,
LRU eviction under a session and memory budget) and the dynamic batcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from specdec.errors import Exhausted, InvalidArgument, NotFound, StaleBase
from specdec.grpc_util import rpc
from specdec.kv import KVSession, fingerprint
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)


def sampling_from_proto(msg, prefix: str = "sampling") -> SamplingParams:
    params = SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if 0.0 < msg.top_p < 1.0 else 1.0,
        min_p=float(msg.min_p),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        max_new_tokens=int(msg.max_new_tokens),
        stop=tuple(msg.stop),
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
    )
    if not 0.0 <= msg.top_p <= 1.0:  # also refuses NaN, which the line above maps to 1
        raise InvalidArgument(f"{prefix}.top_p must be in [0, 1], got {msg.top_p}")
    try:
        params.validate(prefix)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return params


def check_tokens(tokens, vocab_size: int, field_name: str) -> list[int]:
    tokens = [int(t) for t in tokens]
    for i, token in enumerate(tokens):
        if token >= vocab_size:
            raise InvalidArgument(
                f"{field_name}[{i}] = {token} is outside the vocabulary ({vocab_size})"
            )
    return tokens


class SessionTable:
    """Sessions of one worker, least recently used first."""

    def __init__(self, max_sessions: int, max_kv_bytes: int, vocab_size: int, max_context: int):
        self.sessions: OrderedDict[str, KVSession] = OrderedDict()
        self.busy: set[str] = set()
        self.locks: dict[str, asyncio.Lock] = {}
        self.max_sessions = max_sessions
        self.max_kv_bytes = max_kv_bytes
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.evictions = 0

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str):
        """Serialise requests of one session and protect it from eviction meanwhile."""
        lock = self.locks.setdefault(session_id, asyncio.Lock())
        async with lock:
            self.busy.add(session_id)
            try:
                yield
            finally:
                self.busy.discard(session_id)
                if not lock._waiters and session_id not in self.sessions:
                    self.locks.pop(session_id, None)

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def kv_bytes(self) -> int:
        return sum(s.nbytes for s in self.sessions.values())

    def resolve(self, base, delta) -> KVSession:
        """Check a request's base against the cache and sync the session to it.

        FAILED_PRECONDITION when the epoch is stale or the worker cannot prove it holds the
        prefix (missing tokens or fingerprint mismatch): the caller re-sends it whole.
        """
        if not base.session_id:
            raise InvalidArgument("base.session_id must not be empty")
        if base.base_len < 1:
            raise InvalidArgument("base.base_len must be >= 1 (a prompt of at least one token)")
        if base.base_len > self.max_context:
            raise InvalidArgument(
                f"base.base_len {base.base_len} exceeds the model context {self.max_context}"
            )
        new_tokens = check_tokens(delta.token_ids, self.vocab_size, "delta.token_ids")
        if delta.start + len(new_tokens) != base.base_len:
            raise InvalidArgument(
                f"delta: start ({delta.start}) + len(token_ids) ({len(new_tokens)}) must equal base.base_len ({base.base_len})"
            )
        session = self.sessions.get(base.session_id)
        if session is not None and base.epoch < session.epoch:
            raise StaleBase(
                f"base.epoch {base.epoch} is older than the worker's epoch {session.epoch}"
            )
        if delta.start == 0:
            history = new_tokens
        elif session is None or len(session.tokens) < delta.start:
            raise StaleBase(
                f"base: the worker does not hold the first {delta.start} tokens; send the full prefix"
            )
        else:
            history = session.tokens[: delta.start] + new_tokens
        if base.base_fingerprint:
            if fingerprint(history) != base.base_fingerprint:
                raise StaleBase(
                    "base.base_fingerprint does not match the worker's prefix; send the full prefix"
                )
        elif delta.start != 0:
            raise InvalidArgument("base.base_fingerprint is required unless delta.start = 0")
        if session is None:
            session = self._admit(base.session_id)
        self.sessions.move_to_end(base.session_id)
        session.epoch = int(base.epoch)
        session.sync(history)
        return session

    def _admit(self, session_id: str) -> KVSession:
        while len(self.sessions) >= self.max_sessions:
            if not self._evict_one():
                raise Exhausted(f"all {self.max_sessions} sessions are busy (--max-sessions)")
        session = KVSession(session_id)
        self.sessions[session_id] = session
        return session

    def _evict_one(self) -> bool:
        for session_id in self.sessions:
            if session_id not in self.busy:
                del self.sessions[session_id]
                self.evictions += 1
                return True
        return False

    def enforce_memory(self) -> None:
        """Evict idle sessions (LRU) until the KV buffers fit the memory budget.

        An evicted session is simply re-sent in full later (FAILED_PRECONDITION), never wrong.
        """
        while self.kv_bytes > self.max_kv_bytes and self._evict_one():
            pass

    def release(self, session_id: str) -> int:
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise NotFound(f"session_id {session_id!r} is not held by this worker")
        return session.kv_len


@dataclass
class _Pending:
    item: Any
    tokens: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter_ns)


class BatchRun(NamedTuple):
    """One item's result and the batched pass it ran in."""

    result: Any
    queue_ns: int  # waiting for the pass to start
    forward_ns: int  # the pass itself
    batch_size: int  # items in the pass
    positions: int  # what the pass computed: batch_size x the longest item (padding included)
    batch_seq: int  # the pass's sequence number on this worker (1, 2, ...)


class Batcher:
    """Collects concurrent requests into batches run by ONE model thread.

    A batch closes when it holds max_batch_size items or max_batch_tokens tokens, or as soon
    as it holds every session that was active in the last second and not released since (so a
    lone session never waits), or when waiting for the rest has taken `wait_fraction` of a
    recent forward pass (EWMA) or max_wait_ms, whichever is less. Waiting pays because a
    forward pass has a large fixed cost (per-layer work that does not grow with the batch):
    sessions whose results came back together return one after another as their coordinator
    handles them, and closing early would split them into several small, costly passes.
    Items that arrive while the model is busy form the next batch. `process(items)` runs in
    the model thread and returns one result per item (an Exception instance fails only it).
    """

    def __init__(
        self,
        process: Callable[[list], list],
        max_batch_size: int,
        max_batch_tokens: int,
        max_wait_ms: float,
        wait_fraction: float = 0.5,
    ):
        self.process = process
        self.wait_fraction = wait_fraction
        self.forward_s = 0.0  # EWMA of the forward time of a batch
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_ms / 1000.0
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.in_flight = 0
        self._task: asyncio.Task | None = None
        self._carry: _Pending | None = None
        self._recent: dict[object, float] = {}  # session → last submit (monotonic seconds)
        self.batches_run = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _active_sessions(self) -> int:
        """Sessions that submitted within the last second: how big a batch is worth waiting for."""
        horizon = time.monotonic() - 1.0
        for key in [k for k, seen in self._recent.items() if seen < horizon]:
            del self._recent[key]
        return max(1, len(self._recent))

    def forget(self, session_id: str) -> None:
        """A released session will not come back: batches stop waiting for it."""
        self._recent.pop(session_id, None)

    async def submit(self, item, tokens: int):
        """Queue one item; returns its `BatchRun` once the batch it joined has run."""
        session = getattr(item, "session", None)
        self._recent[getattr(session, "session_id", id(item))] = time.monotonic()
        future = asyncio.get_running_loop().create_future()
        self.in_flight += 1
        try:
            await self.queue.put(_Pending(item, tokens, future))
            return await future
        finally:
            self.in_flight -= 1

    async def _collect(self) -> list[_Pending]:
        first = self._carry or await self.queue.get()
        self._carry = None
        batch, tokens = [first], first.tokens
        deadline = time.perf_counter() + min(self.max_wait_s, self.wait_fraction * self.forward_s)
        expected = self._active_sessions()
        while len(batch) < self.max_batch_size:
            try:
                nxt = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - time.perf_counter()
                if remaining <= 0 or len(batch) >= expected:
                    break  # nobody else is likely to come: do not make this batch wait
                try:
                    nxt = await asyncio.wait_for(self.queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            if tokens + nxt.tokens > self.max_batch_tokens:
                self._carry = nxt  # starts the next batch
                break
            batch.append(nxt)
            tokens += nxt.tokens
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [p for p in await self._collect() if not p.future.done()]
            if not batch:
                continue
            start = time.perf_counter_ns()
            try:
                results = await loop.run_in_executor(
                    self.executor, self.process, [p.item for p in batch]
                )
            except Exception as exc:  # noqa: BLE001 - fail this batch's calls, keep serving
                results = [exc] * len(batch)
            forward_ns = time.perf_counter_ns() - start
            last = forward_ns / 1e9
            self.forward_s = 0.8 * self.forward_s + 0.2 * last if self.forward_s else last
            positions = len(batch) * max(p.tokens for p in batch)
            self.batches_run += 1
            log.debug(
                "batch %d: %d items, %d positions, waited %.1f ms, forward %.1f ms",
                self.batches_run,
                len(batch),
                positions,
                (start - batch[0].enqueued) / 1e6,
                last * 1000,
            )
            for pending, result in zip(batch, results):
                if pending.future.done():
                    continue
                if isinstance(result, Exception):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(
                        BatchRun(
                            result,
                            start - pending.enqueued,
                            forward_ns,
                            len(batch),
                            positions,
                            self.batches_run,
                        )
                    )


class WorkerService:
    """What the draft and target services share: Info, Release, load and metrics hooks.

    `model` describes what the worker serves (a ModelRuntime or a proposer): model_name,
    vocab_size, vocab_fingerprint, max_context, eos_token_ids, device, optional `kind`.
    """

    role = ""
    metrics = None  # specdec.telemetry.WorkerMetrics, set by serve_worker

    def __init__(self, model, settings, table: SessionTable, batcher: Batcher, address: str):
        self.model = model
        self.settings = settings
        self.table = table
        self.batcher = batcher
        self.address = address

    def info(self) -> common_pb2.WorkerInfo:
        m = self.model
        return common_pb2.WorkerInfo(
            role=self.role,
            model_name=m.model_name,
            vocab_size=m.vocab_size,
            vocab_fingerprint=m.vocab_fingerprint,
            max_context=m.max_context,
            max_sessions=self.settings.max_sessions,
            max_speculative_tokens=self.settings.max_speculative_tokens,
            proposer=getattr(m, "kind", ""),
            device=str(m.device),
            threads=self.settings.threads,
            active_sessions=len(self.table),
            address=self.address,
            eos_token_ids=m.eos_token_ids,
        )

    def load(self) -> float:
        """In-flight calls per batch slot, for least-load placement."""
        return self.batcher.in_flight / max(1, self.settings.max_batch_size)

    def record_call(self, method: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_call(method, code)
            if code == "FAILED_PRECONDITION":
                self.metrics.resyncs.add(1, self.metrics.attrs)

    def record_batch(self, queue_ns: int, forward_ns: int, batch: int, tokens: int) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.batch_size.record(batch, m.attrs)
            m.forward_seconds.record(forward_ns / 1e9, m.attrs)
            m.queue_seconds.record(queue_ns / 1e9, m.attrs)
            m.tokens.add(tokens, m.attrs)

    @rpc
    async def Release(self, request, context):
        async with self.table.hold(request.session_id):
            released = self.table.release(request.session_id)
        self.batcher.forget(request.session_id)
        return common_pb2.ReleaseResponse(released_tokens=released)

    @rpc
    async def Info(self, request, context):
        return self.info()
