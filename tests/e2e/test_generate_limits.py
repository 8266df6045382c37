"""Requests the whole system refuses, each with its status code: bad input naming the field,
an unknown session, the prompt length and the --max-sessions limits."""

from __future__ import annotations

import grpc
import pytest
from test_generate import request

from specdec.v1 import common_pb2, coordinator_pb2

BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt_token_ids=[10**6]), "prompt_token_ids"),
    (dict(sampling=common_pb2.SamplingParams(temperature=-1)), "sampling.temperature"),
    (dict(sampling=common_pb2.SamplingParams(top_p=1.5)), "sampling.top_p"),
    (dict(sampling=common_pb2.SamplingParams(min_p=2)), "sampling.min_p"),
    (dict(sampling=common_pb2.SamplingParams(temperature=float("nan"))), "sampling.temperature"),
    (dict(sampling=common_pb2.SamplingParams(max_new_tokens=10**6)), "sampling.max_new_tokens"),
    (dict(sampling=common_pb2.SamplingParams(stop_token_ids=[10**6])), "sampling.stop_token_ids"),
    (dict(sampling=common_pb2.SamplingParams(stop=[""])), "sampling.stop"),
    (
        dict(speculation=coordinator_pb2.SpeculationParams(num_speculative_tokens=999)),
        "speculation.num_speculative_tokens",
    ),
    (dict(session_id="bad id with spaces"), "session_id"),
    (dict(return_logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs needs return_logprobs"),
]


@pytest.mark.parametrize(("fields", "name"), BAD, ids=[n for _, n in BAD])
def test_bad_input_names_the_field(stub, fields, name):
    fields = {"prompt": "x", **fields} if "prompt_token_ids" not in fields else fields
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(coordinator_pb2.GenerateRequest(**fields), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in info.value.details()


def test_unknown_session_is_not_found(stub):
    for call in (stub.GetSession, stub.CancelSession):
        req_cls = (
            coordinator_pb2.GetSessionRequest
            if call is stub.GetSession
            else coordinator_pb2.CancelSessionRequest
        )
        with pytest.raises(grpc.RpcError) as info:
            call(req_cls(session_id="nope"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_prompt_length_limit(stub, hf):
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(coordinator_pb2.GenerateRequest(prompt_token_ids=[5] * 5000), timeout=10)
    assert (
        info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()
    )


def test_max_sessions_gives_resource_exhausted(stack):
    """A coordinator at --max-sessions refuses a new session; the running one is unharmed."""
    from specdec.serving.redis_embedded import free_port
    from specdec.v1 import coordinator_pb2_grpc

    port = free_port()
    child = stack.add_coordinator(port, name="coordinator-limited", extra=["--max-sessions", "1"])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    limited = coordinator_pb2_grpc.CoordinatorStub(channel)
    try:
        running = limited.GenerateStream(
            request(gamma=2, max_new_tokens=300, session_id="holds-the-slot"), timeout=60
        )
        first = next(running)
        with pytest.raises(grpc.RpcError) as info:
            limited.Generate(request(gamma=2, max_new_tokens=4), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max-sessions" in info.value.details()
        tokens = list(first.token_ids) + [t for chunk in running for t in chunk.token_ids]
        assert len(tokens) == 300
    finally:
        channel.close()
        child.signal(15)
        child.process.wait(timeout=20)
