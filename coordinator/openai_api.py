"""The OpenAI request and response shapes of the HTTP API (`coordinator.gateway`): request
models that refuse unknown fields, the mapping from them to specdec's SamplingParams, the
`usage` and `speculation` blocks, and errors in OpenAI's shape translated from the session
code's gRPC statuses (400 naming the field)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from specdec.serving.rpc import status_of
from specdec.v1 import common_pb2, coordinator_pb2

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


class RequestFields(BaseModel):
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


class CompletionRequest(RequestFields):
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


class ChatRequest(RequestFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**32 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def refuse_unsupported(body: RequestFields) -> None:
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


def sampling_params(body: RequestFields, max_tokens: int | None) -> common_pb2.SamplingParams:
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


def message_text(message: Message) -> str:
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
        "rounds_per_gamma": list(stats.rounds_per_gamma),
        "alpha": stats.alpha,
        "draft_forward_ms": stats.draft_forward_ms,
        "verify_forward_ms": stats.verify_forward_ms,
        "first_token_forward_ms": stats.first_token_forward_ms,
    }


def usage(stats: coordinator_pb2.GenerationStats) -> dict[str, int]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }
