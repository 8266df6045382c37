"""The OpenAI-compatible HTTP API beside gRPC (`--http-port`): a thin adapter over the same
session code the gRPC service runs (`CoordinatorService.chunks`), so admission, limits,
failover, resume and cancellation are the same.

    POST /v1/completions        POST /v1/chat/completions   (stream: server-sent events)
    GET  /v1/models             GET  /health                GET /openapi.json

Requests are OpenAI's, plus specdec's extensions (`num_speculative_tokens`, `top_k`,
`min_p`, `ignore_eos`, `stop_token_ids`); every response carries `usage` and a `speculation`
block (draft and accepted tokens, acceptance rate, mean acceptance length, acceptance per
position). Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with
400 naming the field, 401, 404, 429 past the caps and 503 while the target tier is down. A
client that disconnects mid-request cancels its session, as on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Annotated, Any, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from specdec.serving.rpc import status_of
from specdec.serving.security import APIKeys
from specdec.serving.wire import merge_chunk
from specdec.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

FINISH = {
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
    coordinator_pb2.FINISH_REASON_EOS: "stop",
    coordinator_pb2.FINISH_REASON_STOP: "stop",
    coordinator_pb2.FINISH_REASON_CANCELLED: "cancelled",
}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# The proto field an admission message names, as the request field a client sent.
PARAM = {
    "sampling.max_new_tokens": "max_tokens",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.min_p": "min_p",
    "sampling.stop_token_ids": "stop_token_ids",
    "sampling.stop": "stop",
    "sampling.seed": "seed",
    "speculation.num_speculative_tokens": "num_speculative_tokens",
    "prompt_token_ids": "prompt",
    "prompt": "prompt",
    "messages": "messages",
    "return_logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
}


U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]  # token ids and counts, as the proto holds them


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
        )


def api_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception of the session code (the gRPC mapping, translated)."""
    code, message = status_of(exc)
    status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
    param = None
    if status == 400:
        field = message.split(":", 1)[0].split(" ", 1)[0].split("[", 1)[0]
        param = PARAM.get(field, field if field.isidentifier() else None)
    return APIError(status, message, kind, param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take (OpenAI's, then specdec's extensions)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the served model's id (GET /v1/models)")
    max_tokens: int | None = Field(
        default=None, ge=1, le=2**32 - 1, description="tokens to generate"
    )
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, description="only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    user: str | None = Field(default=None, description="accepted and ignored")
    presence_penalty: float | None = Field(default=None, description="only 0")
    frequency_penalty: float | None = Field(default=None, description="only 0")
    # specdec and vLLM extensions
    num_speculative_tokens: int | None = Field(
        default=None,
        ge=0,
        le=2**32 - 1,
        description="γ per round; unset = adaptive, 0 = speculation off",
    )
    top_k: int | None = Field(default=None, ge=0, le=2**32 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[U32] | None = None


class CompletionRequest(_Common):
    prompt: str | list[U32] = Field(description="text, or token ids")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="top alternatives")
    echo: bool = Field(default=False, description="only false")
    best_of: int | None = Field(default=None, description="only 1")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**32 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def _unsupported(body: _Common) -> None:
    """Refuse, naming the field, what specdec does not do (rather than silently ignore it)."""
    checks = [
        ("n", body.n not in (None, 1), "only n = 1 is served"),
        ("presence_penalty", body.presence_penalty not in (None, 0.0), "penalties are not served"),
        (
            "frequency_penalty",
            body.frequency_penalty not in (None, 0.0),
            "penalties are not served",
        ),
        ("echo", getattr(body, "echo", False), "echo is not served"),
        ("best_of", getattr(body, "best_of", None) not in (None, 1), "only best_of = 1 is served"),
    ]
    for param, bad, why in checks:
        if bad:
            raise APIError(400, f"{param}: {why}", "invalid_request_error", param)


def _sampling(body: _Common, max_tokens: int | None) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams(
        # OpenAI's default temperature is 1 (sampling); 0 is greedy
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        max_new_tokens=max_tokens or 0,
        ignore_eos=body.ignore_eos,
    )
    if body.seed is not None:
        sampling.seed = body.seed
    if body.stop is not None:
        sampling.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        sampling.stop_token_ids.extend(body.stop_token_ids)
    return sampling


def _content(message: Message) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def speculation(stats: coordinator_pb2.GenerationStats) -> dict[str, Any]:
    return {
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "accepted_per_position": list(stats.accepted_per_position),
        "rounds": stats.rounds,
        "drafts": stats.drafts,
        "mean_speculative_tokens": stats.mean_speculative_tokens,
        "alpha": stats.alpha,
    }


def usage(stats: coordinator_pb2.GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


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


class Gateway:
    """The FastAPI app over a CoordinatorService."""

    def __init__(self, service, model_id: str, api_keys: APIKeys | None = None):
        self.service = service
        self.model_id = model_id
        self.api_keys = api_keys
        self.created = int(time.time())
        self.app = self._build()
        self.app.add_middleware(BodyLimit, limit=service.settings.max_message_mb << 20)

    # --- plumbing -------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_keys is None:
            return
        header = request.headers.get("authorization")
        reason = self.api_keys.authorize([("authorization", header)] if header else [])
        if reason is not None:
            self.service.record_call("http", "UNAUTHENTICATED")
            raise APIError(401, reason, "authentication_error", code="invalid_api_key")

    def _check_model(self, body: _Common) -> None:
        if body.model != self.model_id:
            raise APIError(
                404,
                f"model: {body.model!r} is not served here; this server serves {self.model_id!r}",
                "not_found_error",
                "model",
                "model_not_found",
            )

    async def _first_and_rest(self, request: coordinator_pb2.GenerateRequest):
        """Start the session and fetch its first chunk, so admission errors become an HTTP
        status before a stream's 200 is sent; returns (first chunk or None, the iterator)."""
        chunks = self.service.chunks(request).__aiter__()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            return None, chunks
        except Exception as exc:  # noqa: BLE001 - mapped like the gRPC service maps it
            raise api_error(exc) from exc
        return first, chunks

    @staticmethod
    async def _cancel_on_disconnect(request: Request, work: asyncio.Task) -> None:
        while not work.done():
            if await request.is_disconnected():
                work.cancel()
                return
            await asyncio.sleep(0.25)

    async def _collect(self, request: Request, grpc_request) -> coordinator_pb2.GenerateResponse:
        """A whole completion; the session is cancelled if the client leaves first (also
        before its first token)."""
        response = coordinator_pb2.GenerateResponse()

        async def run():
            async for chunk in self.service.chunks(grpc_request):
                merge_chunk(response, chunk)

        work = asyncio.ensure_future(run())
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(request, work))
        try:
            await work
        except asyncio.CancelledError:
            raise APIError(499, "the client disconnected", "cancelled") from None
        except Exception as exc:  # noqa: BLE001 - mapped like the gRPC service maps it
            raise api_error(exc) from exc
        finally:
            watcher.cancel()
        return response

    # --- the endpoints --------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(
            title="specdec",
            version="1",
            description="OpenAI-compatible API of a specdec coordinator (lossless speculative "
            "decoding).",
        )

        @app.exception_handler(APIError)
        async def on_api_error(_request, exc: APIError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def on_validation(_request, exc: RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            param = ".".join(loc) or None
            message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
            return APIError(400, message, "invalid_request_error", param).response()

        @app.exception_handler(Exception)
        async def on_internal(_request, exc: Exception):
            return api_error(exc).response()  # INTERNAL: generic message, logged with an id

        @app.get("/health")
        async def health():
            if not self.service.ready():
                return JSONResponse({"status": "not serving"}, status_code=503)
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(request: Request):
            self._authorize(request)
            return {
                "object": "list",
                "data": [
                    {
                        "id": self.model_id,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "specdec",
                    }
                ],
            }

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            grpc_request = self._begin(request, body, body.max_tokens or 16)  # OpenAI's: 16
            if isinstance(body.prompt, str):
                grpc_request.prompt = body.prompt
            else:
                grpc_request.prompt_token_ids.extend(body.prompt)
            self._logprobs(grpc_request, body.logprobs is not None, body.logprobs or 0)
            return await self._answer(request, grpc_request, body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatRequest, request: Request):
            grpc_request = self._begin(request, body, body.max_completion_tokens or body.max_tokens)
            grpc_request.messages.extend(
                coordinator_pb2.ChatMessage(role=m.role, content=_content(m)) for m in body.messages
            )
            self._logprobs(grpc_request, body.logprobs, body.top_logprobs or 0)
            return await self._answer(request, grpc_request, body, chat=True)

        return app

    def _begin(self, request: Request, body: _Common, max_tokens: int | None):
        """What both endpoints check first, and the request both build on."""
        self._authorize(request)
        self._check_model(body)
        _unsupported(body)
        grpc_request = coordinator_pb2.GenerateRequest(
            sampling=_sampling(body, max_tokens), session_id=uuid.uuid4().hex
        )
        if body.num_speculative_tokens is not None:
            grpc_request.speculation.num_speculative_tokens = body.num_speculative_tokens
        return grpc_request

    async def _answer(self, request: Request, grpc_request, body: _Common, chat: bool):
        if body.stream:
            return await self._stream(request, grpc_request, body, chat)
        return self._final(await self._collect(request, grpc_request), body, chat)

    @staticmethod
    def _logprobs(grpc_request, wanted: bool, top: int) -> None:
        if wanted:
            grpc_request.return_logprobs = True
            grpc_request.top_logprobs = top

    # --- response bodies ------------------------------------------------------------

    def _final(self, response, body: _Common, chat: bool) -> dict:
        stats = response.stats
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": FINISH.get(response.finish_reason),
            "logprobs": self._logprob_block(response, chat) if response.logprobs else None,
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": response.text}
        else:
            choice["text"] = response.text
        return {
            "id": ("chatcmpl-" if chat else "cmpl-") + response.session_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_id,
            "choices": [choice],
            "usage": usage(stats),
            "speculation": speculation(stats),
        }

    def _logprob_block(self, response, chat: bool) -> dict:
        """OpenAI's logprobs object for the tokens of a response or chunk."""
        tokenizer = self.service.ctx.tokenizer

        def text(token_id: int) -> str:
            return tokenizer.decode([token_id])

        tokens = [text(t) for t in response.token_ids]
        tops = [
            [(text(t), lp) for t, lp in zip(top.token_ids, top.logprobs)]
            for top in response.top_logprobs
        ]
        if chat:
            return {
                "content": [
                    {
                        "token": token,
                        "logprob": lp,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(t.encode())}
                            for t, v in (tops[i] if i < len(tops) else [])
                        ],
                    }
                    for i, (token, lp) in enumerate(zip(tokens, response.logprobs))
                ]
            }
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": list(response.logprobs),
            "top_logprobs": [dict(top) for top in tops] if any(tops) else None,
            "text_offset": offsets,
        }

    async def _stream(self, request: Request, grpc_request, body: _Common, chat: bool):
        first, chunks = await self._first_and_rest(grpc_request)
        stream_id = ("chatcmpl-" if chat else "cmpl-") + grpc_request.session_id
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        def frame(choice: dict) -> dict:
            return {
                "id": stream_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.model_id,
                "choices": [choice],
            }

        async def events():
            final_stats = None
            try:
                if chat:
                    yield event(
                        frame(
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        )
                    )
                pending = [first] if first is not None else []

                async def all_chunks():
                    for chunk in pending:
                        yield chunk
                    async for chunk in chunks:
                        yield chunk

                async for chunk in all_chunks():
                    finish = FINISH.get(chunk.finish_reason) if chunk.finish_reason else None
                    logprobs = self._logprob_block(chunk, chat) if chunk.logprobs else None
                    if chat:
                        choice = {
                            "index": 0,
                            "delta": {"content": chunk.text} if chunk.text else {},
                        }
                    else:
                        choice = {"index": 0, "text": chunk.text}
                    choice.update(logprobs=logprobs, finish_reason=finish)
                    payload = frame(choice)
                    if finish is not None:
                        final_stats = chunk.stats
                        payload["speculation"] = speculation(chunk.stats)
                    yield event(payload)
                if include_usage and final_stats is not None:
                    tail = frame({})
                    tail["choices"] = []
                    tail["usage"] = usage(final_stats)
                    yield event(tail)
            except Exception as exc:  # noqa: BLE001 - after the 200: an error event, then end
                err = api_error(exc)
                yield event(
                    {"error": {"message": err.message, "type": err.kind, "param": err.param}}
                )
            finally:
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await chunks.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


class HTTPServer:
    """uvicorn serving the gateway inside the coordinator's own event loop."""

    def __init__(self, gateway: Gateway, host: str, port: int, tls=None):
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
