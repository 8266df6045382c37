"""gRPC servers and channels of the three services: health, reflection, drain, logging."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MESSAGE_LIMIT_MB = 64


class Server:
    """An aio gRPC server with the standard health service and reflection."""

    def __init__(self, service_names: list[str], max_message_mb: int = MESSAGE_LIMIT_MB):
        options = [
            ("grpc.max_receive_message_length", max_message_mb << 20),
            ("grpc.max_send_message_length", max_message_mb << 20),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0

    def bind(self, host: str, port: int) -> int:
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            result = self.health.set(name, status)
            if inspect.isawaitable(result):
                await result

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def drain_and_stop(self, grace_s: float) -> None:
        """Health NOT_SERVING, let in-flight calls finish within the grace period, stop."""
        await self.set_serving(False)
        await self.server.stop(grace_s)


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", MESSAGE_LIMIT_MB << 20),
            ("grpc.max_send_message_length", MESSAGE_LIMIT_MB << 20),
        ],
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
