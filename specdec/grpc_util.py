"""gRPC plumbing shared by the three services: status mapping, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import errors, telemetry

log = logging.getLogger(__name__)

STATUS = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.StaleBase: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    for cls, code in STATUS.items():
        if isinstance(exc, cls):
            return code
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return None


def _record(service, name: str, code: grpc.StatusCode) -> None:
    hook = getattr(service, "record_call", None)
    if hook is not None:
        hook(name, code.name)


async def _abort(service, context, exc: BaseException, name: str):
    code = status_of(exc)
    if code is None:
        log.exception("unexpected error in %s", name)
        code = grpc.StatusCode.INTERNAL
    _record(service, name, code)
    await context.abort(code, str(exc))


def rpc(method):
    """Map domain errors raised by an async handler (unary or streaming) to gRPC statuses."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
                _record(self, method.__name__, grpc.StatusCode.OK)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never a crash
                await _abort(self, context, exc, method.__name__)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            with telemetry.span(f"{type(self).__name__}.{method.__name__}"):
                response = await method(self, request, context)
            _record(self, method.__name__, grpc.StatusCode.OK)
            return response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never a crash
            await _abort(self, context, exc, method.__name__)

    return unary_wrapper


class Server:
    """An aio gRPC server with the standard health service and reflection."""

    def __init__(self, service_names: list[str], max_message_mb: int = 64):
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
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
