"""Servers end every connection after a maximum age (GOAWAY): the client's channel reconnects
by itself and its calls keep succeeding, on a new connection."""

from __future__ import annotations

import asyncio

import grpc

from specdec.serving.rpc import rpc
from specdec.serving.server import Server
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc


class Peer(coordinator_pb2_grpc.CoordinatorServicer):
    @rpc
    async def GetSession(self, request, context):
        return coordinator_pb2.SessionInfo(session_id=context.peer())  # ipv4:127.0.0.1:PORT


async def peers(max_age_s: float | None) -> list[str]:
    server = Server(
        ["specdec.v1.Coordinator"],
        **({} if max_age_s is None else {"max_connection_age_s": max_age_s}),
    )
    server.add(Peer(), "specdec.v1.Coordinator")
    port = server.bind("127.0.0.1", 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            seen = []
            for _ in range(6):
                info = await stub.GetSession(
                    coordinator_pb2.GetSessionRequest(session_id="x"), timeout=5
                )
                seen.append(info.session_id)
                await asyncio.sleep(0.4)
            return seen
    finally:
        await server.drain_and_stop(0)


def test_an_old_connection_is_replaced_and_calls_keep_working():
    seen = asyncio.run(peers(max_age_s=0.5))
    assert (
        len(seen) == 6 and len(set(seen)) >= 2
    )  # every call answered, on more than one connection


def test_negative_control_the_default_age_keeps_one_connection():
    seen = asyncio.run(peers(max_age_s=None))
    assert len(set(seen)) == 1
