"""Only the project's own client errors become client status codes; anything unexpected is
INTERNAL with a generic message and a request id, never the exception's text (a host, a path,
a traceback). Through a real in-process gRPC server and client."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import redis.exceptions

from specdec.errors import Exhausted, InvalidArgument, NotFound, StaleBase, Unavailable
from specdec.serving.rpc import rpc
from specdec.serving.server import Server
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

SECRET = "10.1.2.3:6379 /srv/specdec/models/secret.py line 42"

RAISE = {
    "invalid": InvalidArgument("sampling.top_p must be in [0, 1]"),
    "stale": StaleBase("base.epoch 1 is older than the worker's epoch 2"),
    "missing": NotFound("session_id 'x' is unknown"),
    "full": Exhausted("all 4 sessions are busy"),
    "down": Unavailable("no target worker is available"),
    "timeout": asyncio.TimeoutError(SECRET),
    "bug": RuntimeError(SECRET),
    "value": ValueError(SECRET),  # a plain ValueError is a bug of ours, not the caller's input
    "key": KeyError(SECRET),
    "redis-down": redis.exceptions.ConnectionError(f"Error 111 connecting to {SECRET}"),
    "redis-slow": redis.exceptions.TimeoutError(f"Timeout reading from {SECRET}"),
    "redis-loading": redis.exceptions.BusyLoadingError(SECRET),
}


class Probe(coordinator_pb2_grpc.CoordinatorServicer):
    calls: list[tuple[str, str]] = []

    def record_call(self, method: str, code: str) -> None:
        self.calls.append((method, code))

    @rpc
    async def GetSession(self, request, context):
        raise RAISE[request.session_id]

    @rpc
    async def GenerateStream(self, request, context):
        yield coordinator_pb2.GenerateChunk(session_id="first")
        raise RAISE[request.session_id]


async def call_all(kind: str):
    server = Server(["specdec.v1.Coordinator"])
    probe = Probe()
    server.add(probe, "specdec.v1.Coordinator")
    port = server.bind("127.0.0.1", 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=kind))
            chunks = []
            with pytest.raises(grpc.aio.AioRpcError) as stream:
                async for chunk in stub.GenerateStream(
                    coordinator_pb2.GenerateRequest(session_id=kind)
                ):
                    chunks.append(chunk.session_id)
        return unary.value, stream.value, chunks, probe.calls
    finally:
        await server.drain_and_stop(0)


EXPECTED = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "stale": grpc.StatusCode.FAILED_PRECONDITION,
    "missing": grpc.StatusCode.NOT_FOUND,
    "full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "down": grpc.StatusCode.UNAVAILABLE,
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_own_errors_keep_their_code_and_message(kind):
    Probe.calls = []
    unary, stream, chunks, calls = asyncio.run(call_all(kind))
    for err in (unary, stream):
        assert err.code() == EXPECTED[kind]
        assert err.details() == str(RAISE[kind])
    assert chunks == ["first"]  # what was streamed before the error still arrived
    assert calls == [("GetSession", EXPECTED[kind].name), ("GenerateStream", EXPECTED[kind].name)]


@pytest.mark.parametrize("kind", ["bug", "value", "key"])
def test_unexpected_errors_are_internal_and_leak_nothing(kind, caplog):
    caplog.set_level(logging.ERROR, logger="specdec.serving.rpc")
    unary, stream, _, _ = asyncio.run(call_all(kind))
    ids = []
    for err in (unary, stream):
        assert err.code() == grpc.StatusCode.INTERNAL
        details = err.details()
        assert details.startswith("internal error (request id ")
        for secret_part in ("10.1.2.3", "6379", "/srv", "secret", "line 42", "Traceback"):
            assert secret_part not in details
        ids.append(details.removeprefix("internal error (request id ").rstrip(")"))
    assert ids[0] != ids[1] and all(len(i) == 16 for i in ids)
    logged = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    for request_id in ids:  # the operator finds the details under the id the client saw
        assert request_id in logged
    assert SECRET in logged


@pytest.mark.parametrize("kind", ["redis-down", "redis-slow", "redis-loading"])
def test_redis_trouble_is_unavailable_and_leaks_nothing(kind, caplog):
    """The client retries UNAVAILABLE (and resumes); Redis's address stays in the log."""
    caplog.set_level(logging.WARNING, logger="specdec.serving.rpc")
    unary, stream, _, _ = asyncio.run(call_all(kind))
    for err in (unary, stream):
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert err.details().startswith("the session store is unavailable; retry (request id ")
        for secret_part in ("10.1.2.3", "6379", "/srv", "secret"):
            assert secret_part not in err.details()
    assert SECRET in "\n".join(r.getMessage() for r in caplog.records)


def test_a_deadline_is_deadline_exceeded_without_details():
    unary, stream, _, _ = asyncio.run(call_all("timeout"))
    for err in (unary, stream):
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.details() == "deadline exceeded"
