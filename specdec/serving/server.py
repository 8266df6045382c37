"""gRPC servers and channels of the three services: health, reflection, drain, logging."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection

from specdec.serving.security import APIKeys, ClientTLS, ServerTLS

MESSAGE_LIMIT_MB = 64
# Pings every 30 s find a dead peer (a vanished pod, a dropped NAT entry) within 40 s.
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
]


# A connection lives at most 30 min (then GOAWAY: the client reconnects, possibly to another
# replica behind a load balancer, so load spreads again after a scale-up); calls in flight
# get 5 more minutes, then end UNAVAILABLE and the clients resume them (resume_from).
MAX_CONNECTION_AGE_S = 1800.0
MAX_CONNECTION_AGE_GRACE_S = 300.0


HANDLERS = {  # (client streaming, server streaming) → grpc's handler of that shape
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class Server:
    """An aio gRPC server with the standard health service and reflection."""

    def __init__(
        self,
        service_names: list[str],
        max_message_mb: int = MESSAGE_LIMIT_MB,
        max_connection_age_s: float = MAX_CONNECTION_AGE_S,
        reflection: bool = False,
    ):
        options = [
            ("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(MAX_CONNECTION_AGE_GRACE_S * 1000)),
            ("grpc.max_receive_message_length", max_message_mb << 20),
            ("grpc.max_send_message_length", max_message_mb << 20),
            ("grpc.so_reuseport", 0),
            *KEEPALIVE,
        ]
        self.server = grpc.aio.server(options=options)
        self.service_names = list(service_names)
        self.health = Health(["", *self.service_names])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection:  # off by default: it hands any caller the whole API surface
            grpc_reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, grpc_reflection.SERVICE_NAME],
                self.server,
            )
        self.port = 0

    def add(self, servicer, service_name: str, api_keys: APIKeys | None = None) -> None:
        """Serve `servicer`'s methods for the named service, with request parsing that never
        fails the call: bytes that are not the method's message (malformed protobuf, a string
        that is not UTF-8) reach the handler as `Malformed`, which `rpc` refuses as
        INVALID_ARGUMENT (grpc's own parser would answer with its exception text).

        With `api_keys`, every method of the service needs `authorization: Bearer <key>`
        (UNAUTHENTICATED otherwise, before the request is looked at); health and reflection
        stay open."""
        service = descriptor_pool.Default().FindServiceByName(service_name)
        handlers = {}
        for method in service.methods:
            make = HANDLERS[method.client_streaming, method.server_streaming]
            handler = getattr(servicer, method.name, None)
            if handler is None:  # a servicer without it (a test's stand-in): UNIMPLEMENTED
                continue
            if api_keys is not None:
                handler = _authenticated(handler, api_keys, method.server_streaming, servicer)
            handlers[method.name] = make(
                handler,
                request_deserializer=_tolerant_parser(GetMessageClass(method.input_type)),
                response_serializer=lambda message: message.SerializeToString(),
            )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service_name, handlers),)
        )

    def bind(self, host: str, port: int, tls: ServerTLS | None = None) -> int:
        """Listen on host:port, over TLS (mutual when `tls.client_ca` is set) or plaintext."""
        address = f"{host}:{port}"
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, tls.credentials())
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}")
        return self.port

    async def set_serving(self, serving: bool) -> None:
        await self.health.set(serving)

    async def start(self) -> None:
        await self.server.start()

    async def drain_and_stop(self, grace_s: float) -> None:
        """Health NOT_SERVING (Watch streams get it, then end OK), let in-flight calls finish
        within the grace period, stop."""
        await self.health.close()
        await self.server.stop(grace_s)


class Health(health_pb2_grpc.HealthServicer):
    """The standard health service (grpc.health.v1) over a fixed set of service names, all
    with one status. Unlike grpc's reference servicer, a Watch stream ends (status OK) once
    the server drains and the watcher has seen NOT_SERVING: the reference's streams stay open
    until the grace period cancels them, which holds up every drain and logs the
    cancellation as an error."""

    def __init__(self, names: list[str]):
        self.status = dict.fromkeys(names, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.closed = False
        self.changed = asyncio.Condition()

    async def set(self, serving: bool) -> None:
        """Every name SERVING or NOT_SERVING; no effect once `close` has run."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        async with self.changed:
            if self.closed or all(s == status for s in self.status.values()):
                return
            self.status = dict.fromkeys(self.status, status)
            self.changed.notify_all()

    async def close(self) -> None:
        """NOT_SERVING for good; every Watch stream sends it and ends."""
        async with self.changed:
            self.status = dict.fromkeys(self.status, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.closed = True
            self.changed.notify_all()

    async def Check(self, request, context):
        if request.service not in self.status:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=self.status[request.service])

    async def Watch(self, request, context):
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        sent = None
        while True:
            async with self.changed:
                await self.changed.wait_for(
                    lambda last=sent: (
                        self.closed or self.status.get(request.service, unknown) != last
                    )
                )
                status, closed = self.status.get(request.service, unknown), self.closed
            if status != sent:  # written outside the lock: a slow watcher holds up nobody
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if closed:
                return


class Malformed:
    """A request whose bytes did not parse as its method's message."""

    def __init__(self, message_name: str):
        self.message_name = message_name


def _authenticated(handler, api_keys: APIKeys, streaming: bool, servicer):
    """`handler` behind an API-key check that runs before anything reads the request."""

    async def refuse(context) -> None:
        reason = api_keys.authorize(context.invocation_metadata())
        if reason is not None:
            hook = getattr(servicer, "record_call", None)
            if hook is not None:
                hook(handler.__name__, grpc.StatusCode.UNAUTHENTICATED.name)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    if streaming:

        async def stream(request, context):
            await refuse(context)
            async for item in handler(request, context):
                yield item

        return stream

    async def unary(request, context):
        await refuse(context)
        return await handler(request, context)

    return unary


def _tolerant_parser(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError, invalid UTF-8: the handler refuses it
            return Malformed(message_cls.DESCRIPTOR.full_name)

    return parse


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def channel(address: str, tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """A channel to another tier: plaintext, or TLS (mutual when `tls` has a certificate)."""
    options = [
        ("grpc.max_receive_message_length", MESSAGE_LIMIT_MB << 20),
        ("grpc.max_send_message_length", MESSAGE_LIMIT_MB << 20),
        *KEEPALIVE,
    ]
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options + tls.options())


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
