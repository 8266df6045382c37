"""The HTTP gateway's error mapping: the gRPC status of an exception, as OpenAI's shape."""

from __future__ import annotations

import pytest

from coordinator.openai_api import api_error
from specdec import errors


@pytest.mark.parametrize(
    "exc, status, kind, param",
    [
        (
            errors.InvalidArgument("sampling.top_p must be in (0, 1]"),
            400,
            "invalid_request_error",
            "top_p",
        ),
        (
            errors.InvalidArgument("sampling.max_new_tokens: 9 > 4"),
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            errors.InvalidArgument("messages[2].role must be one of"),
            400,
            "invalid_request_error",
            "messages",
        ),
        (
            errors.InvalidArgument("return_logprobs: not served"),
            400,
            "invalid_request_error",
            "logprobs",
        ),
        (errors.Exhausted("this coordinator serves 9 streams"), 429, "rate_limit_error", None),
        (errors.Unavailable("no target worker is available"), 503, "service_unavailable", None),
        (errors.NotFound("session_id 'x' is unknown"), 404, "not_found_error", None),
        (errors.Conflict("session_id reused"), 409, "invalid_request_error", None),
        (RuntimeError("/secret/path on host-7"), 500, "internal_error", None),
    ],
)
def test_errors_map_to_openai_statuses(exc, status, kind, param):
    error = api_error(exc)
    assert (error.status, error.kind, error.param) == (status, kind, param)
    if status == 500:  # never the exception's text: a generic message with a request id
        assert "secret" not in error.message and "request id" in error.message
