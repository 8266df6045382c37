"""Sessions through the whole system (real processes and Redis): the record, cancel here and
through another coordinator, reattach and resume, two streams of one session, a paused Redis."""

from __future__ import annotations

import itertools

import grpc
import pytest
from test_generate import request

from specdec.v1 import coordinator_pb2


def test_session_record_and_cancel(stub):
    response = stub.Generate(
        request(gamma=2, max_new_tokens=8, seed=5, session_id="rec-1"), timeout=60
    )
    info = stub.GetSession(coordinator_pb2.GetSessionRequest(session_id="rec-1"), timeout=10)
    assert info.status == coordinator_pb2.SESSION_STATUS_FINISHED
    assert list(info.generated_token_ids) == list(response.token_ids) and info.seed == 5
    assert info.version == len(info.prompt_token_ids) + 8
    again = stub.Generate(request(gamma=2, max_new_tokens=8, session_id="rec-1"), timeout=60)
    assert list(again.token_ids) == list(response.token_ids)  # reattach, no new generation
    stream = stub.GenerateStream(
        request(gamma=2, max_new_tokens=400, session_id="cancel-me"), timeout=60
    )
    next(stream)
    stub.CancelSession(coordinator_pb2.CancelSessionRequest(session_id="cancel-me"), timeout=10)
    last = list(stream)[-1]
    assert last.finish_reason == coordinator_pb2.FINISH_REASON_CANCELLED


def test_cancel_through_another_coordinator(stack, stub):
    """CancelSession on a replica that does not run the session reaches it through Redis."""
    from specdec.serving.redis_embedded import free_port
    from specdec.v1 import coordinator_pb2_grpc

    port = free_port()
    child = stack.add_coordinator(port, name="coordinator-replica")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    replica = coordinator_pb2_grpc.CoordinatorStub(channel)
    try:
        stream = stub.GenerateStream(
            request(gamma=2, max_new_tokens=400, session_id="cancel-remote"), timeout=60
        )
        first = next(stream)
        replica.CancelSession(
            coordinator_pb2.CancelSessionRequest(session_id="cancel-remote"), timeout=10
        )
        chunks = [first, *stream]
        assert chunks[-1].finish_reason == coordinator_pb2.FINISH_REASON_CANCELLED
        info = replica.GetSession(
            coordinator_pb2.GetSessionRequest(session_id="cancel-remote"), timeout=10
        )
        assert info.finish_reason == coordinator_pb2.FINISH_REASON_CANCELLED
        assert len(info.generated_token_ids) < 400
        # the round verified while the cancelling commit was in flight is discarded: what
        # was streamed is exactly what Redis holds
        streamed = [t for c in chunks for t in c.token_ids]
        assert streamed == list(info.generated_token_ids)
        assert [c.offset for c in chunks[1:]] == list(
            itertools.accumulate(len(c.token_ids) for c in chunks[:-1])
        )
    finally:
        channel.close()
        child.signal(15)
        child.process.wait(timeout=20)


def test_a_paused_redis_is_unavailable_quickly_then_recovers(stack, stub):
    """SIGSTOP the real redis-server: a request is UNAVAILABLE (which clients retry) within
    about --redis-timeout-s, not a minute-long hang or INTERNAL; after SIGCONT it serves."""
    import signal
    import time

    expected = list(stub.Generate(request(max_new_tokens=8), timeout=60).token_ids)
    redis_process = stack.redis.process
    redis_process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request(max_new_tokens=8, session_id="during-pause"), timeout=30)
        elapsed = time.monotonic() - started
    finally:
        redis_process.send_signal(signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "session store is unavailable" in err.value.details()
    assert "127.0.0.1" not in err.value.details()
    assert elapsed < 5
    assert list(stub.Generate(request(max_new_tokens=8), timeout=60).token_ids) == expected


def test_reattach_must_repeat_the_request_or_only_name_the_session(stub):
    """A reused session_id with another prompt or sampling is FAILED_PRECONDITION, never the
    old session's tokens for a new request; session_id + resume_from alone reattaches."""
    first = stub.Generate(request(max_new_tokens=8, session_id="reattach-1"), timeout=60)
    for changed in (dict(prompt="class B:"), dict(temperature=0.5, seed=1)):
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request(max_new_tokens=8, session_id="reattach-1", **changed), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "session_id 'reattach-1' exists with another prompt" in err.value.details()
    only_id = coordinator_pb2.GenerateRequest(session_id="reattach-1", resume_from=3)
    resumed = stub.Generate(only_id, timeout=30)
    assert list(resumed.token_ids) == list(first.token_ids)[3:]
    beyond = coordinator_pb2.GenerateRequest(session_id="reattach-1", resume_from=9)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(beyond, timeout=30)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "resume_from 9 is beyond the 8 tokens" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        fresh = request(session_id="never-created-1")
        fresh.resume_from = 2
        stub.Generate(fresh, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "resume_from: session_id 'never-created-1' does not exist" in err.value.details()


def test_one_of_two_streams_leaving_does_not_cancel_the_session(stub):
    req = request(max_new_tokens=300, session_id="two-streams")
    leaving = stub.GenerateStream(req, timeout=60)
    next(leaving)
    staying = stub.GenerateStream(
        coordinator_pb2.GenerateRequest(session_id="two-streams"), timeout=60
    )
    first = next(staying)
    leaving.cancel()
    chunks = [first, *staying]
    assert chunks[-1].finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 300
