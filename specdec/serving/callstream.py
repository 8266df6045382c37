"""Calls multiplexed on one long-lived gRPC stream per worker (ProposeStream, VerifyStream;
several calls a message on ProposeBatches, VerifyBatches).

At one request a round makes two worker calls, and on a host where the forward pass leaves
gRPC idle, a unary call costs about twice a message on an open stream (a new HTTP/2 stream,
its headers and gRPC's thread hand-offs waking from idle; docs/benchmarks.md, "A lean
round"). So the coordinator keeps one stream per worker and method (`CallLane`), and the
worker answers each call on it (`serve_calls`) through the very handler its unary method
runs — the same checks, status mapping, metrics and trace span — as if it had arrived alone.

Semantics are the unary call's: each call has a deadline (the worker stops working on it
then too), a caller that cancels it makes the worker stop too (a `cancel` message), it ends
with its response or its status code and message (the caller sees a
`grpc.aio.AioRpcError`, so failover code is shared), and a stream that breaks fails the calls
in flight on it with the stream's status (a dead worker: UNAVAILABLE) — the next call opens
a new stream. A worker that drains answers the calls it has, then ends its streams OK; calls
it did not take end UNAVAILABLE and fail over. A worker without the stream method (an older
version during a rolling upgrade) answers UNIMPLEMENTED, and the lane then makes unary calls.

On the batched stream (a worker whose WorkerInfo sets call_batches) each message carries a
list of calls or replies: the calls queued while the lane's previous message was being
written leave together (up to BATCH_BYTES), and the replies a worker finishes in one turn of
its event loop (one batched pass) leave together. Under load the sessions of a verify pass
have their next calls ready at once, and one message instead of one per session saves each
hop a message's fixed cost per session (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import grpc

from specdec.serving.server import Malformed

log = logging.getLogger(__name__)

# A lane moves its calls to a new stream once its stream is this old, and half-closes the
# old one (the worker answers what it took, then ends it): a stream never outlives the
# server's connection age (GOAWAY after 30 min, connections cut 5 min later), which would
# fail the calls on it and fail their sessions over.
STREAM_MAX_AGE_S = 300.0

CODES = {code.value[0]: code for code in grpc.StatusCode}

# A batched stream's message stops taking more calls past this size (a call's full-prefix
# resync can be large; gRPC's message limit is 64 MB); one larger call still goes alone.
BATCH_BYTES = 4 << 20


async def within(awaitable, seconds: float | None):
    """`await awaitable` with a deadline, in the calling task: no task of its own and one
    wake-up fewer than `asyncio.wait_for`."""
    async with asyncio.timeout(seconds):
        return await awaitable


def call_error(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """What a failed unary call raises, for a call carried by a stream."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message)


# --- the worker's side ----------------------------------------------------------------


class CallAborted(grpc.aio.AbortError):
    """`abort` of one call on a stream: ends that call with a status, not the stream."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """What a unary handler uses of its gRPC context, for one call carried by a stream."""

    def __init__(self, metadata):
        self._metadata = tuple(metadata.items())

    def invocation_metadata(self):
        return self._metadata

    async def send_initial_metadata(self, metadata) -> None:
        """A call on a stream has no headers of its own (the stream's were sent)."""

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        raise CallAborted(code, details)


async def serve_calls(
    requests, context, handler, reply_cls, closing: asyncio.Event, replies_cls=None
) -> None:
    """Answer every call of a stream: each runs `handler(request, CallContext)` (the unary
    method, `rpc`-wrapped) as its own task, so calls of different sessions batch together,
    and its reply (`reply_cls`: call_id, response, status) is written when it is done. Ends
    when the caller closes its side or `closing` is set (the worker drains), after the calls
    taken are answered; a cancelled stream (the caller went away) cancels them.

    With `replies_cls` (ProposeReplies: the batched stream) every message carries a list of
    calls, and the replies finished in the same turn of the event loop (the sessions of one
    batched pass) leave in one message."""
    writing = asyncio.Lock()
    calls: dict[int, asyncio.Task] = {}  # call id → the task answering it
    unsent: list = []  # batched stream: replies not yet written

    async def send(reply) -> None:
        if replies_cls is None:
            async with writing:
                await context.write(reply)
            return
        unsent.append(reply)
        if len(calls) > 1:  # the other replies finished in this turn join this one
            await asyncio.sleep(0)
        async with writing:
            if unsent:  # else another call's message carried it
                message = replies_cls(replies=unsent)
                unsent.clear()
                await context.write(message)

    async def answer(call) -> None:
        reply = reply_cls(call_id=call.call_id)
        try:
            timeout = call.timeout_ms / 1000 if call.timeout_ms else None
            work = handler(call.request, CallContext(call.metadata))
            reply.response.CopyFrom(await within(work, timeout))
        except CallAborted as exc:
            reply.status.code, reply.status.message = exc.code.value[0], exc.details
        except asyncio.TimeoutError:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
            reply.status.code, reply.status.message = code.value[0], "deadline exceeded"
        await send(reply)

    def start(call) -> None:
        if call.cancel:  # the caller gave up on it
            task = calls.get(call.call_id)
            if task is not None:
                task.cancel()
            return
        task = asyncio.ensure_future(answer(call))
        calls[call.call_id] = task
        task.add_done_callback(lambda _, i=call.call_id: calls.pop(i, None))

    async def take() -> None:
        async for message in requests:
            if isinstance(message, Malformed):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request: not a valid {message.message_name} (malformed protobuf)",
                )
            for call in message.calls if replies_cls is not None else (message,):
                start(call)

    reader = asyncio.ensure_future(take())
    drained = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait({reader, drained}, return_when=asyncio.FIRST_COMPLETED)
        if reader.done():
            reader.result()  # a malformed call ends the stream with its status
    except BaseException:
        for task in calls.values():
            task.cancel()
        raise
    finally:
        reader.cancel()
        drained.cancel()
    if calls:  # taken: answered before the stream ends
        await asyncio.gather(*calls.values(), return_exceptions=True)


# --- the caller's side ----------------------------------------------------------------


class _Unsupported(Exception):
    """The worker has no stream method (UNIMPLEMENTED): make unary calls."""


@dataclass
class _Stream:
    call: object  # grpc.aio.StreamStreamCall
    outbox: asyncio.Queue
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    reader: asyncio.Task | None = None
    opened: float = field(default_factory=time.monotonic)


class CallLane:
    """Calls of one method to one worker on one long-lived stream (opened at the first call
    and again after it ended); unary calls once the worker answered UNIMPLEMENTED."""

    def __init__(self, open_stream, unary, call_cls, calls_cls=None):
        """open_stream: the stub's stream method (ProposeStream); unary: its unary one
        (Propose); call_cls: the stream's call message (ProposeCall). With `calls_cls`
        (ProposeCalls), open_stream is the batched stream (ProposeBatches): the calls queued
        while the previous message was being written leave together in the next."""
        self.open_stream, self.unary, self.call_cls = open_stream, unary, call_cls
        self.calls_cls = calls_cls
        self.streaming = True
        self.ids = itertools.count(1)
        self.stream: _Stream | None = None

    async def __call__(self, request, timeout: float, metadata=()):
        if not self.streaming:
            return await self.unary(request, timeout=timeout, metadata=metadata)
        stream = self.stream
        if stream is not None and time.monotonic() - stream.opened > STREAM_MAX_AGE_S:
            stream.outbox.put_nowait(None)  # retired: its calls are answered, then it ends
            stream = None
        if stream is None:
            stream = self._open()
        call_id = next(self.ids)
        answer = asyncio.get_running_loop().create_future()
        stream.pending[call_id] = answer
        stream.outbox.put_nowait(
            self.call_cls(
                call_id=call_id,
                request=request,
                metadata=dict(metadata or ()),
                timeout_ms=max(1, int(timeout * 1000)),
            )
        )
        try:
            return await within(answer, timeout)
        except asyncio.TimeoutError:
            raise call_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:  # as a unary call's cancellation, the worker stops
            if stream is self.stream:
                stream.outbox.put_nowait(self.call_cls(call_id=call_id, cancel=True))
            raise
        except _Unsupported:
            if self.streaming:
                log.info("worker has no %s: unary calls", self.call_cls.__name__)
            self.streaming = False
            return await self.unary(request, timeout=timeout, metadata=metadata)
        finally:
            stream.pending.pop(call_id, None)

    def _open(self) -> _Stream:
        outbox: asyncio.Queue = asyncio.Queue()

        async def calls():
            ended = False
            while not ended and (call := await outbox.get()) is not None:
                if self.calls_cls is None:
                    yield call
                    continue
                batch, size = [call], 0
                while not outbox.empty():
                    size += call.ByteSize()  # sized only when another call could join it
                    if size >= BATCH_BYTES:
                        break
                    call = outbox.get_nowait()
                    if call is None:  # the end: after this message
                        ended = True
                        break
                    batch.append(call)
                yield self.calls_cls(calls=batch)

        stream = _Stream(self.open_stream(calls()), outbox)
        stream.reader = asyncio.ensure_future(self._read(stream))
        self.stream = stream
        return stream

    async def _read(self, stream: _Stream) -> None:
        """Hand each reply to its call; when the stream ends, fail the calls still on it."""
        ended: Exception = call_error(
            grpc.StatusCode.UNAVAILABLE, "the worker ended the call stream (draining)"
        )
        try:
            async for message in stream.call:
                for reply in message.replies if self.calls_cls is not None else (message,):
                    answer = stream.pending.pop(reply.call_id, None)
                    if answer is None or answer.done():
                        continue  # its caller gave up (deadline, cancellation)
                    if reply.status.code:
                        code = CODES.get(reply.status.code, grpc.StatusCode.UNKNOWN)
                        answer.set_exception(call_error(code, reply.status.message))
                    else:
                        answer.set_result(reply.response)
        except grpc.aio.AioRpcError as exc:
            ended = _Unsupported() if exc.code() == grpc.StatusCode.UNIMPLEMENTED else exc
        except asyncio.CancelledError:
            ended = call_error(grpc.StatusCode.CANCELLED, "the call stream was closed")
            raise
        finally:
            stream.outbox.put_nowait(None)  # ends the request iterator gRPC consumes
            if self.stream is stream:
                self.stream = None
            for answer in stream.pending.values():
                if not answer.done():
                    answer.set_exception(ended)
            stream.pending.clear()

    async def close(self) -> None:
        """End the stream: calls in flight on it end CANCELLED."""
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.outbox.put_nowait(None)
            stream.call.cancel()
            if stream.reader is not None:
                await asyncio.gather(stream.reader, return_exceptions=True)
