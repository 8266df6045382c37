"""The standard health service of every server: Check per service name, and Watch streams
that follow the status and end cleanly (OK, after NOT_SERVING) when the server drains, so a
drain never waits out its grace period for a watcher and never logs a cancelled call."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.serving.server import Server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "specdec.v1.TargetWorker"
GRACE_S = 20.0


async def watch_through_drain(
    aio_server, port: int, set_serving, drain_and_stop, grace_s: float
) -> tuple[list[int], object, float]:
    """Watch "" while the server goes SERVING, then drains: (statuses seen, how the stream
    ended, seconds the drain took)."""
    await aio_server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        seen: list[int] = []
        first = await call.read()
        seen.append(first.status)
        await set_serving(True)
        seen.append((await call.read()).status)
        started = time.monotonic()
        drain = asyncio.ensure_future(drain_and_stop(grace_s))
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                seen.append(response.status)
            ended = await call.code()
        except grpc.aio.AioRpcError as err:
            ended = err.code()
        await drain
        return seen, ended, time.monotonic() - started


def test_watch_follows_the_status_and_ends_ok_when_the_server_drains(caplog):
    async def run():
        server = Server([SERVICE])
        port = server.bind("127.0.0.1", 0)
        return await watch_through_drain(
            server, port, server.set_serving, server.drain_and_stop, GRACE_S
        )

    with caplog.at_level(logging.DEBUG, logger="grpc"):
        seen, ended, drain_s = asyncio.run(run())
    assert seen == [NOT_SERVING, SERVING, NOT_SERVING]
    assert ended == grpc.StatusCode.OK
    # the drain did not wait for the watcher: far inside the grace period
    assert drain_s < GRACE_S / 2
    assert not [r for r in caplog.records if r.exc_info], "a call ended with an exception"


def test_negative_control_the_reference_servicer_holds_the_drain_until_the_grace_ends():
    """grpc's own aio servicer keeps the stream open: the drain waits out the whole grace
    period and the watcher's call is cut, not ended - what the test above would see."""
    grace_s = 2.0

    async def run():
        server = grpc.aio.server()
        reference = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(reference, server)
        port = server.add_insecure_port("127.0.0.1:0")

        async def set_serving(serving: bool) -> None:
            await reference.set("", SERVING if serving else NOT_SERVING)

        async def drain_and_stop(grace_s: float) -> None:
            await reference.enter_graceful_shutdown()
            await server.stop(grace_s)

        await reference.set("", NOT_SERVING)
        return await watch_through_drain(server, port, set_serving, drain_and_stop, grace_s)

    seen, ended, drain_s = asyncio.run(run())
    assert seen == [NOT_SERVING, SERVING, NOT_SERVING]
    assert ended != grpc.StatusCode.OK
    assert drain_s >= grace_s * 0.9


@pytest.mark.parametrize("name", ["", SERVICE])
def test_check_answers_for_every_served_name_and_not_found_otherwise(name):
    async def check() -> tuple[int, int, grpc.StatusCode]:
        server = Server([SERVICE])
        port = server.bind("127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service=name)
                before = (await stub.Check(request, timeout=10)).status
                await server.set_serving(True)
                after = (await stub.Check(request, timeout=10)).status
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
                return before, after, err.value.code()
        finally:
            await server.drain_and_stop(0)

    assert asyncio.run(check()) == (NOT_SERVING, SERVING, grpc.StatusCode.NOT_FOUND)
