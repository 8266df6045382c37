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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from coordinator.http_server import BodyLimit
from coordinator.openai_api import (
    FINISH,
    APIError,
    ChatRequest,
    CompletionRequest,
    RequestFields,
    api_error,
    message_text,
    refuse_unsupported,
    sampling_params,
    speculation,
    usage,
)
from specdec.serving.security import APIKeys
from specdec.serving.wire import merge_chunk
from specdec.v1 import coordinator_pb2

log = logging.getLogger(__name__)


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

    def _check_model(self, body: RequestFields) -> None:
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
                coordinator_pb2.ChatMessage(role=m.role, content=message_text(m))
                for m in body.messages
            )
            self._logprobs(grpc_request, body.logprobs, body.top_logprobs or 0)
            return await self._answer(request, grpc_request, body, chat=True)

        return app

    def _begin(self, request: Request, body: RequestFields, max_tokens: int | None):
        """What both endpoints check first, and the request both build on."""
        self._authorize(request)
        self._check_model(body)
        refuse_unsupported(body)
        grpc_request = coordinator_pb2.GenerateRequest(
            sampling=sampling_params(body, max_tokens), session_id=uuid.uuid4().hex
        )
        if body.num_speculative_tokens is not None:
            grpc_request.speculation.num_speculative_tokens = body.num_speculative_tokens
        return grpc_request

    async def _answer(self, request: Request, grpc_request, body: RequestFields, chat: bool):
        if body.stream:
            return await self._stream(request, grpc_request, body, chat)
        return self._final(await self._collect(request, grpc_request), body, chat)

    @staticmethod
    def _logprobs(grpc_request, wanted: bool, top: int) -> None:
        if wanted:
            grpc_request.return_logprobs = True
            grpc_request.top_logprobs = top

    # --- response bodies ------------------------------------------------------------

    def _final(self, response, body: RequestFields, chat: bool) -> dict:
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

    async def _stream(self, request: Request, grpc_request, body: RequestFields, chat: bool):
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
