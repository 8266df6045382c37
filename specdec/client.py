"""Python client of the specdec Coordinator.

    from specdec.client import Client
    client = Client(["127.0.0.1:50051"])
    for chunk in client.stream("def fib(n):", max_new_tokens=64, temperature=0):
        print(chunk.text, end="", flush=True)
    result = client.generate("import os", max_new_tokens=32)
    print(result.text, result.stats.mean_acceptance_length)

Over TLS, pass the CA that signed the coordinator's certificate (`tls_ca=`; a client
certificate with `tls_cert=`/`tls_key=` where the coordinator asks for one); with API keys on,
`api_key=` (default: the SPECDEC_API_KEY environment variable) goes with every call as
`authorization: Bearer <key>`.

Both clients retry UNAVAILABLE (a coordinator restart or failover) by calling again — on the
next address of the list — with the same `session_id` and `resume_from` set to the tokens
already received, so the caller never sees a duplicated or lost token.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
from opentelemetry import propagate

from specdec.serving.security import ClientTLS
from specdec.serving.wire import merge, merge_chunk
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

__all__ = ["AsyncClient", "Client", "build_request", "merge", "merge_chunk"]

RETRYABLE = {grpc.StatusCode.UNAVAILABLE}
SAMPLING_FIELDS = {
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
}


def build_request(
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    num_speculative_tokens: int | None = None,
    session_id: str = "",
    return_logprobs: bool = False,
    top_logprobs: int = 0,
    **sampling,
) -> coordinator_pb2.GenerateRequest:
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling fields: {sorted(unknown)}")
    request = coordinator_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        session_id=session_id or uuid.uuid4().hex,
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):  # chat messages: {"role": …, "content": …}
        request.messages.extend(coordinator_pb2.ChatMessage(**m) for m in prompt)
    else:
        request.prompt_token_ids.extend(prompt)
    if num_speculative_tokens is not None:
        request.speculation.num_speculative_tokens = num_speculative_tokens
    if return_logprobs or top_logprobs:
        request.return_logprobs, request.top_logprobs = True, top_logprobs
    return request


class _ClientBase:
    """Addresses, deadline and retry settings shared by both clients."""

    def __init__(
        self,
        addresses: str | Sequence[str] = "127.0.0.1:50051",
        timeout_s: float = 300.0,
        retries: int = 10,
        backoff_s: float = 0.5,
        *,
        tls_ca: str | None = None,
        tls_cert: str = "",
        tls_key: str = "",
        server_name: str = "",
        api_key: str | None = None,
    ):
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        tls_ca = os.environ.get("SPECDEC_TLS_CA", "") if tls_ca is None else tls_ca
        self.tls = ClientTLS(tls_ca, tls_cert, tls_key, server_name)
        api_key = os.environ.get("SPECDEC_API_KEY", "") if api_key is None else api_key
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._index = 0
        self._channel = None
        self._stub = None
        # the trace id of the latest stream, from the coordinator's W3C `traceresponse`
        # ('' when the coordinator does not trace)
        self.trace_id = ""

    def _metadata(self) -> tuple:
        """The API key, plus the caller's trace context (W3C traceparent) when the calling
        code runs inside an OpenTelemetry span: the request then joins the caller's trace."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        return self.metadata + tuple(carrier.items())

    def _note_trace(self, initial_metadata) -> None:
        for key, value in initial_metadata or ():
            if key == "traceresponse" and value.count("-") == 3:
                self.trace_id = value.split("-")[1]

    def _address(self) -> str:
        return self.addresses[self._index % len(self.addresses)]

    def _backoff(self, exc: grpc.RpcError, attempt: int) -> float:
        """Seconds to wait before retry `attempt` (from 1); re-raises what is not retryable."""
        if exc.code() not in RETRYABLE or attempt > self.retries:
            raise exc
        return self.backoff_s * attempt

    def _open(self, grpc_module):
        """A channel to the current address (TLS when a CA or certificate is given)."""
        address = self._address()
        if not self.tls.enabled:
            return grpc_module.insecure_channel(address)
        return grpc_module.secure_channel(address, self.tls.credentials(), self.tls.options())

    def _remaining(self, deadline: float) -> float:
        return max(0.1, deadline - time.monotonic())


class Client(_ClientBase):
    """Blocking client; `addresses` are coordinators tried in turn on UNAVAILABLE."""

    def _connect(self):
        if self._stub is None:
            self._channel = self._open(grpc)
            self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        return self._stub

    def _rotate(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
        self._index += 1

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()

    def stream(self, prompt, **kwargs) -> Iterator[coordinator_pb2.GenerateChunk]:
        """Yield chunks as tokens are committed; resumes transparently after UNAVAILABLE."""
        request = build_request(prompt, **kwargs)
        received, attempt = 0, 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            request.resume_from = received
            try:
                call = self._connect().GenerateStream(
                    request, timeout=self._remaining(deadline), metadata=self._metadata()
                )
                self._note_trace(call.initial_metadata())
                for chunk in call:
                    attempt = 0
                    received = chunk.offset + len(chunk.token_ids)
                    yield chunk
                    if chunk.finish_reason:
                        return
                return
            except grpc.RpcError as exc:
                attempt += 1
                wait = self._backoff(exc, attempt)
                self._rotate()
                time.sleep(wait)

    def generate(self, prompt, **kwargs) -> coordinator_pb2.GenerateResponse:
        """The whole completion (streamed underneath, so it also survives a coordinator restart)."""
        return merge(self.stream(prompt, **kwargs))

    def get_session(self, session_id: str) -> coordinator_pb2.SessionInfo:
        return self._connect().GetSession(
            coordinator_pb2.GetSessionRequest(session_id=session_id),
            timeout=10,
            metadata=self._metadata(),
        )

    def cancel(self, session_id: str) -> coordinator_pb2.CancelSessionResponse:
        return self._connect().CancelSession(
            coordinator_pb2.CancelSessionRequest(session_id=session_id),
            timeout=10,
            metadata=self._metadata(),
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """asyncio client with the same retry-with-resume behaviour."""

    def _connect(self):
        if self._stub is None:
            self._channel = self._open(grpc.aio)
            self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        return self._stub

    async def _rotate(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
        self._index += 1

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def stream(self, prompt, **kwargs) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        request = build_request(prompt, **kwargs)
        received, attempt = 0, 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            request.resume_from = received
            try:
                call = self._connect().GenerateStream(
                    request, timeout=self._remaining(deadline), metadata=self._metadata()
                )
                self._note_trace(await call.initial_metadata())
                async for chunk in call:
                    attempt = 0
                    received = chunk.offset + len(chunk.token_ids)
                    yield chunk
                    if chunk.finish_reason:
                        return
                return
            except grpc.aio.AioRpcError as exc:
                attempt += 1
                wait = self._backoff(exc, attempt)
                await self._rotate()
                await asyncio.sleep(wait)

    async def generate(self, prompt, **kwargs) -> coordinator_pb2.GenerateResponse:
        response = coordinator_pb2.GenerateResponse()
        async for chunk in self.stream(prompt, **kwargs):
            merge_chunk(response, chunk)
        return response
