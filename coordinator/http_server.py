"""The HTTP side of the gateway below the app: uvicorn in the coordinator's own event loop
(`HTTPServer`) and the request-body cap it enforces before any parsing (`BodyLimit`)."""

from __future__ import annotations

import asyncio
import contextlib
import json

from coordinator.openai_api import APIError


class BodyLimit:
    """ASGI middleware: a request body past `limit` bytes is 413 before it is parsed (the
    HTTP twin of gRPC's --max-message-mb)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        error = APIError(
            413,
            f"the request body exceeds {self.limit >> 20} MiB (--max-message-mb)",
            "invalid_request_error",
        )
        body = json.dumps({"error": {"message": error.message, "type": error.kind}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class HTTPServer:
    """uvicorn serving the gateway inside the coordinator's own event loop."""

    def __init__(self, gateway, host: str, port: int, tls=None):
        import uvicorn

        options = {}
        if tls is not None:  # the public certificate, read at start (restart to rotate)
            options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.client_ca:
                import ssl

                options.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        self.config = uvicorn.Config(
            gateway.app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=5,
            **options,
        )
        self.server = uvicorn.Server(self.config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Listen; returns the bound port (0 asks for a free one)."""
        # uvicorn's serve() would take over SIGINT/SIGTERM; the coordinator handles those
        self._task = asyncio.create_task(self.server._serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error (port in use, bad certificate)
                raise OSError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.02)
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._task is not None:
            self.server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
