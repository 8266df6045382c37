"""Worker calls on a long-lived stream (specdec/serving/callstream.py) against real in-process
workers: the same answers as unary calls, calls of one stream batched together, per-call
statuses and deadlines, the unary fallback for a worker without the stream method, the
drain that ends streams instead of holding the server for its whole grace period, and a
broken stream failing its calls with a failover code."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from inproc_workers import start_tier
from rounds import propose_request, verify_request

from coordinator.links import FAILOVER_CODES
from specdec.serving import callstream
from specdec.serving.callstream import CallLane
from specdec.serving.server import Server
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

PROMPTS = [[5 + i, 6, 7, 8 + i, 9] for i in range(6)]
SAMPLING = common_pb2.SamplingParams(temperature=0.8, top_p=0.95)
TIMEOUT_S = 60.0


@pytest.fixture(params=[False, True], ids=["stream", "batched"])
def batched(request) -> bool:
    """Every test runs on both call streams: one call a message (ProposeStream) and several
    calls a message (ProposeBatches)."""
    return request.param


def lanes(address: str, batched: bool):
    channel = grpc.aio.insecure_channel(address)
    target = target_pb2_grpc.TargetWorkerStub(channel)
    draft = draft_pb2_grpc.DraftWorkerStub(channel)
    if batched:
        verify = CallLane(
            target.VerifyBatches, target.Verify, target_pb2.VerifyCall, target_pb2.VerifyCalls
        )
        propose = CallLane(
            draft.ProposeBatches, draft.Propose, draft_pb2.ProposeCall, draft_pb2.ProposeCalls
        )
    else:
        verify = CallLane(target.VerifyStream, target.Verify, target_pb2.VerifyCall)
        propose = CallLane(draft.ProposeStream, draft.Propose, draft_pb2.ProposeCall)
    return channel, verify, propose, target, draft


class Counted:
    """A batched stream method that records how many calls each message carried, each way."""

    def __init__(self, open_stream):
        self.open_stream = open_stream
        self.sent: list[int] = []
        self.received: list[int] = []

    def __call__(self, requests):
        async def counted():
            async for message in requests:
                self.sent.append(len(message.calls))
                yield message

        return _CountedCall(self.open_stream(counted()), self.received)


class _CountedCall:
    def __init__(self, call, received: list[int]):
        self.call, self.received = call, received

    async def __aiter__(self):
        async for message in self.call:
            self.received.append(len(message.replies))
            yield message

    def cancel(self):
        return self.call.cancel()


def test_stream_answers_as_unary_calls_and_batches_them(loop_thread, draft, target, batched):
    async def run():
        tch, verify, _, unary_target, _ = lanes(target.address, batched)
        dch, _, propose, _, unary_draft = lanes(draft.address, batched)
        try:
            # one sampled proposal over the stream and one unary, same history and seed
            streamed = await propose(
                propose_request("p-s", PROMPTS[0], 4, 0, SAMPLING, 7), TIMEOUT_S
            )
            alone = await unary_draft.Propose(propose_request("p-u", PROMPTS[0], 4, 0, SAMPLING, 7))
            assert list(streamed.candidate_ids) == list(alone.candidate_ids)
            assert streamed.draft_dists == alone.draft_dists and len(streamed.draft_dists) == 4
            # six sessions verified at once on one stream, against unary calls one by one
            on_stream = await asyncio.gather(
                *(
                    verify(verify_request(f"v-s{i}", p, alone, 0, SAMPLING, 7), TIMEOUT_S)
                    for i, p in enumerate(PROMPTS)
                )
            )
            for i, p in enumerate(PROMPTS):
                one = await unary_target.Verify(verify_request(f"v-u{i}", p, alone, 0, SAMPLING, 7))
                assert list(on_stream[i].output_ids) == list(one.output_ids)
                assert on_stream[i].num_accepted == one.num_accepted
            # calls of one stream are served concurrently: they shared forward passes
            assert max(r.batch_size for r in on_stream) > 1
            assert verify.streaming and propose.streaming
        finally:
            await verify.close()
            await propose.close()
            await tch.close()
            await dch.close()

    loop_thread.run(run())


def test_calls_ready_together_share_a_message_each_way(loop_thread, target, monkeypatch):
    """On the batched stream, six sessions' Verify calls made together leave in fewer than
    six messages, and their replies, finished by one batched pass, come back in fewer than
    six; every call gets its own answer. With a message size limit below one call's size
    (the control), each call leaves alone."""

    async def run(tag: str) -> Counted:
        channel = grpc.aio.insecure_channel(target.address)
        stub = target_pb2_grpc.TargetWorkerStub(channel)
        counted = Counted(stub.VerifyBatches)
        verify = CallLane(counted, stub.Verify, target_pb2.VerifyCall, target_pb2.VerifyCalls)
        try:
            answers = await asyncio.gather(
                *(
                    verify(verify_request(f"m-{tag}{i}", p, [11, 12]), TIMEOUT_S)
                    for i, p in enumerate(PROMPTS)
                )
            )
            assert all(len(a.output_ids) == a.num_accepted + 1 for a in answers)
            assert max(a.batch_size for a in answers) > 1
            assert sum(counted.sent) == sum(counted.received) == len(PROMPTS)
            assert verify.streaming
            return counted
        finally:
            await verify.close()
            await channel.close()

    together = loop_thread.run(run("a"))
    assert len(together.sent) < len(PROMPTS) and len(together.received) < len(PROMPTS)
    monkeypatch.setattr(callstream, "BATCH_BYTES", 1)
    alone = loop_thread.run(run("b"))
    assert alone.sent == [1] * len(PROMPTS)


def test_a_call_ends_with_its_own_status_and_the_stream_goes_on(loop_thread, target, batched):
    async def run():
        channel, verify, *_ = lanes(target.address, batched)
        try:
            good = verify_request("st-1", PROMPTS[1], [11, 12])
            await verify(good, TIMEOUT_S)
            stream = verify.stream
            bad = verify_request("st-2", PROMPTS[1], [11, 1 << 30])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verify(bad, TIMEOUT_S)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "candidate_ids" in err.value.details()
            # a deadline too short for a forward pass ends that call only
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verify(verify_request("st-3", PROMPTS[2], [11]), 0.001)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            again = await verify(verify_request("st-4", PROMPTS[1], [11, 12]), TIMEOUT_S)
            assert len(again.output_ids) == again.num_accepted + 1
            assert verify.stream is stream  # the same stream served all four
        finally:
            await verify.close()
            await channel.close()

    loop_thread.run(run())


class UnaryOnly:
    """A target worker stand-in without VerifyStream or VerifyBatches (as an older worker):
    forwards Verify."""

    def __init__(self, upstream: str):
        self.channel = grpc.aio.insecure_channel(upstream)
        self.stub = target_pb2_grpc.TargetWorkerStub(self.channel)
        self.calls = 0

    async def Verify(self, request, context):
        self.calls += 1
        return await self.stub.Verify(request)


def test_a_worker_without_the_stream_method_gets_unary_calls(loop_thread, target, batched):
    async def run():
        proxy = UnaryOnly(target.address)
        server = Server(["specdec.v1.TargetWorker"])
        server.add(proxy, "specdec.v1.TargetWorker")
        port = server.bind("127.0.0.1", 0)
        await server.start()
        channel, verify, *_ = lanes(f"127.0.0.1:{port}", batched)
        try:
            for i in range(2):
                answer = await verify(verify_request(f"u-{i}", PROMPTS[3], [11, 12]), TIMEOUT_S)
                assert len(answer.output_ids) == answer.num_accepted + 1
            assert not verify.streaming and proxy.calls == 2
        finally:
            await channel.close()
            await proxy.channel.close()
            await server.server.stop(0)

    loop_thread.run(run())


def slowed(worker, seconds: float):
    """Make the worker's Verify take `seconds` longer (so a call is surely in flight)."""
    verify = worker.service.Verify

    async def slow(request, context):
        await asyncio.sleep(seconds)
        return await verify(request, context)

    worker.service.Verify = slow
    return worker


def test_drain_answers_the_calls_taken_then_ends_the_stream(loop_thread, model_dirs, batched):
    """With `closing` set the stream ends as soon as its call is answered, and the server
    stops far inside its grace period; without it (the negative control) an open stream
    holds the stop for the whole grace period."""

    async def stop_with_stream_open(worker, drain: bool) -> tuple[float, object]:
        channel, verify, *_ = lanes(worker.address, batched)
        try:
            await verify(verify_request("d-0", PROMPTS[4], [11]), TIMEOUT_S)  # stream open
            call = asyncio.ensure_future(
                verify(verify_request("d-1", PROMPTS[5], [11, 12]), TIMEOUT_S)
            )
            await asyncio.sleep(0.1)  # the call is taken (it takes 0.3 s)
            if drain:
                worker.service.closing.set()
            start = time.monotonic()
            await worker.server.server.stop(GRACE_S)
            elapsed = time.monotonic() - start
            answered = await asyncio.gather(call, return_exceptions=True)
            return elapsed, answered[0]
        finally:
            await verify.close()
            await channel.close()
            await worker.service.batcher.stop()

    GRACE_S = 3.0
    drained = slowed(start_tier("target", loop_thread, model_dirs["target"], max_wait_ms=1.0), 0.3)
    elapsed, answer = loop_thread.run(stop_with_stream_open(drained, drain=True))
    assert isinstance(answer, target_pb2.VerifyResponse), answer  # taken, then answered
    assert elapsed < GRACE_S / 2, elapsed
    held = slowed(start_tier("target", loop_thread, model_dirs["target"], max_wait_ms=1.0), 0.3)
    elapsed, _ = loop_thread.run(stop_with_stream_open(held, drain=False))
    assert elapsed >= GRACE_S * 0.9, elapsed


def test_a_broken_stream_fails_its_calls_for_failover_and_reopens(loop_thread, model_dirs, batched):
    worker = slowed(start_tier("target", loop_thread, model_dirs["target"], max_wait_ms=1.0), 2.0)

    async def run():
        channel, verify, *_ = lanes(worker.address, batched)
        try:
            await verify(verify_request("b-0", PROMPTS[0], [11]), TIMEOUT_S)
            first = verify.stream
            call = asyncio.ensure_future(verify(verify_request("b-1", PROMPTS[1], [11]), TIMEOUT_S))
            await asyncio.sleep(0.2)  # the call is taken (it takes 2 s)
            await worker.server.server.stop(0)  # the worker goes away mid-call
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() in FAILOVER_CODES
            assert verify.stream is None  # the next call opens a new stream
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verify(verify_request("b-2", PROMPTS[1], [11]), 2.0)
            assert err.value.code() in FAILOVER_CODES
            assert verify.stream is not first
        finally:
            await verify.close()
            await channel.close()
            await worker.service.batcher.stop()

    loop_thread.run(run())


def test_a_retired_stream_answers_its_calls_before_it_ends(
    loop_thread, target, monkeypatch, batched
):
    """Every call finds its stream too old (age limit 0): it moves to a new stream and
    half-closes the old one while the previous call is still in flight on it."""
    monkeypatch.setattr(callstream, "STREAM_MAX_AGE_S", 0.0)

    async def run():
        channel, verify, *_ = lanes(target.address, batched)
        try:
            streams = []

            async def one(i: int):
                call = asyncio.ensure_future(
                    verify(verify_request(f"r-{i}", PROMPTS[i], [11, 12]), TIMEOUT_S)
                )
                await asyncio.sleep(0)  # the call has its stream
                streams.append(verify.stream)
                return await call

            answers = await asyncio.gather(*(one(i) for i in range(4)))
            assert all(len(a.output_ids) == a.num_accepted + 1 for a in answers)
            assert len({id(s) for s in streams}) == 4
        finally:
            await verify.close()
            await channel.close()

    loop_thread.run(run())


def watched(worker, seconds: float, first_only: bool = False) -> list[str]:
    """Make the worker's Verify sleep `seconds` first (only its first call with `first_only`)
    and record in the returned list when such a handler started and when it was cancelled."""
    verify = worker.service.Verify
    seen: list[str] = []

    async def slow(request, context):
        if not (first_only and seen):
            try:
                seen.append("started")
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
        return await verify(request, context)

    worker.service.Verify = slow
    return seen


def test_a_cancelled_call_stops_the_workers_work_on_it(loop_thread, model_dirs, batched):
    """As a unary call's cancellation: the worker's handler is cancelled (it would otherwise
    sleep 2 s and then run a forward pass); the stream serves the next call."""
    worker = start_tier("target", loop_thread, model_dirs["target"], max_wait_ms=1.0)
    seen = watched(worker, 2.0, first_only=True)

    async def run():
        channel, verify, *_ = lanes(worker.address, batched)
        try:
            call = asyncio.ensure_future(verify(verify_request("c-0", PROMPTS[0], [11]), TIMEOUT_S))
            while not seen:
                await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(100):  # the cancel message reaches the worker
                if "cancelled" in seen:
                    break
                await asyncio.sleep(0.01)
            assert seen == ["started", "cancelled"]
            answer = await verify(verify_request("c-1", PROMPTS[1], [11]), TIMEOUT_S)
            assert len(answer.output_ids) == answer.num_accepted + 1
        finally:
            await verify.close()
            await channel.close()
            await worker.server.server.stop(0)
            await worker.service.batcher.stop()

    loop_thread.run(run())


def test_the_worker_ends_a_call_at_its_own_deadline(loop_thread, model_dirs, batched):
    """The worker enforces each call's `timeout_ms` itself (a caller that sent it is not
    needed to give up first): a call whose handler would take 1 s ends DEADLINE_EXCEEDED after
    its 150 ms and the handler is cancelled; the control, the same call with 5 s, is answered
    after the second and its handler is not cancelled."""
    worker = start_tier("target", loop_thread, model_dirs["target"], max_wait_ms=1.0)
    seen = watched(worker, 1.0)

    async def call_with(stream, call_id: int, timeout_ms: int):
        call = target_pb2.VerifyCall(
            call_id=call_id,
            request=verify_request(f"dl-{call_id}", PROMPTS[call_id], [11]),
            timeout_ms=timeout_ms,
        )
        start = time.monotonic()
        await stream.write(target_pb2.VerifyCalls(calls=[call]) if batched else call)
        message = await stream.read()
        reply = message.replies[0] if batched else message
        assert reply.call_id == call_id
        return reply, time.monotonic() - start

    async def run():
        channel, _, _, target, _ = lanes(worker.address, batched)
        stream = (target.VerifyBatches if batched else target.VerifyStream)()
        try:
            reply, elapsed = await call_with(stream, 1, 150)
            assert reply.status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert 0.1 < elapsed < 0.8, elapsed
            for _ in range(100):
                if "cancelled" in seen:
                    break
                await asyncio.sleep(0.01)
            assert seen == ["started", "cancelled"]
            seen.clear()
            reply, elapsed = await call_with(stream, 2, 5000)  # the control
            assert reply.status.code == 0 and reply.response.output_ids, reply
            assert elapsed >= 1.0 and seen == ["started"]
        finally:
            stream.cancel()
            await channel.close()
            await worker.server.server.stop(0)
            await worker.service.batcher.stop()

    loop_thread.run(run())
