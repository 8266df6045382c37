"""Dynamic batching: concurrent requests of many sessions become one forward pass."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from specdec.errors import Unavailable
from specdec.worker.threads import model_thread

log = logging.getLogger(__name__)


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
    started_ns: int  # wall clock (time.time_ns) when the pass started, for trace spans


class Batcher:
    """Collects concurrent requests into batches run by ONE model thread.

    A batch closes when it holds max_batch_size items or max_batch_tokens positions (items ×
    the longest item: what the padded pass computes), or as soon
    as it holds every session that was active in the last second and not released since (so a
    lone session never waits), or when waiting for the rest has taken `wait_fraction` of a
    recent forward pass (EWMA) or max_wait_ms, whichever is less. Waiting pays because a
    forward pass has a large fixed cost (per-layer work that does not grow with the batch):
    sessions whose results came back together return one after another as their coordinator
    handles them, and closing early would split them into several small, costly passes.
    Items that arrive while the model is busy form the next batch. `process(items)` runs in
    the model thread and returns one result per item (an Exception instance fails only it) —
    except a lone session's small item (≤ `inline_tokens` positions: a round, not a prefill),
    which runs on the event loop's thread without the two thread hand-offs — where the model
    runs on one torch thread only: with more, a pass on the loop's thread would start a second
    OpenMP pool, which costs far more than the hand-offs save (`specdec.worker.threads`).
    """

    def __init__(
        self,
        process: Callable[[list], list],
        max_batch_size: int,
        max_batch_tokens: int,
        max_wait_ms: float,
        wait_fraction: float = 0.5,
        inline_tokens: int = 16,
        threads: int = 1,
    ):
        self.process = process
        # a lone item this small skips the model thread (one torch thread only: see above)
        self.inline_tokens = inline_tokens if threads <= 1 else 0
        self.wait_fraction = wait_fraction
        self.forward_s = 0.0  # EWMA of the forward time of a batch
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_ms / 1000.0
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.executor = model_thread()
        self._occupying: Future | None = None  # the latest job given by `occupy`
        self.in_flight = 0
        self._task: asyncio.Task | None = None
        self._carry: _Pending | None = None
        self._running: list[_Pending] = []  # the batch in the model thread now
        self._recent: dict[object, float] = {}  # session → last submit (monotonic seconds)
        self.batches_run = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop the loop; calls still queued or running fail with UNAVAILABLE (retry elsewhere)."""
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.executor.shutdown(wait=False, cancel_futures=True)
        pending = [self._carry] if self._carry else []
        while not self.queue.empty():
            pending.append(self.queue.get_nowait())
        for p in pending + self._running:
            if not p.future.done():
                p.future.set_exception(Unavailable("the worker is stopping"))

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

    def occupy(self, fn, *args) -> Future:
        """Run `fn(*args)` in the model thread outside any batch (the warm-up pass); no batch
        runs on the loop's thread meanwhile (one thread at a time touches the model)."""
        self._occupying = self.executor.submit(fn, *args)  # one thread: done after the others
        return self._occupying

    def _runs_inline(self, batch: list[_Pending]) -> bool:
        """A lone session's round (one small item, nothing queued, no other session active)
        runs on the event loop's own thread: nothing else is waiting for the loop, and the
        hand-off to the model thread and back costs ~0.25 ms of a round (docs/benchmarks.md)."""
        return (
            len(batch) == 1
            and batch[0].tokens <= self.inline_tokens
            and self.queue.empty()
            and self._active_sessions() == 1
            and (self._occupying is None or self._occupying.done())
        )

    async def _collect(self) -> list[_Pending]:
        first = self._carry or await self.queue.get()
        self._carry = None
        batch, longest = [first], first.tokens
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
            # a pass computes every item at the longest one's length: count padded positions
            if (len(batch) + 1) * max(longest, nxt.tokens) > self.max_batch_tokens:
                self._carry = nxt  # starts the next batch
                break
            batch.append(nxt)
            longest = max(longest, nxt.tokens)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [p for p in await self._collect() if not p.future.done()]
            if not batch:
                continue
            self._running = batch
            start = time.perf_counter_ns()
            started_ns = time.time_ns()
            try:
                items = [p.item for p in batch]
                if self._runs_inline(batch):
                    results = self.process(items)
                else:
                    results = await loop.run_in_executor(self.executor, self.process, items)
            except Exception as exc:  # noqa: BLE001 - fail this batch's calls, keep serving
                results = [exc] * len(batch)
            self._running = []
            if len(results) != len(batch):  # a bug in process: fail them all, never hang one
                results = [RuntimeError(f"{len(results)} results for {len(batch)} items")] * len(
                    batch
                )
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
                            started_ns,
                        )
                    )
