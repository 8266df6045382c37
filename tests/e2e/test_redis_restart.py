"""The embedded Redis restarted under a running stack: with its append-only file, finished
sessions are still there and a session streaming through the restart finishes exactly (the
client resumes); without it (the negative control), the same restart loses the sessions."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
import redis
from test_faults import reference, stream_and_kill

from specdec.client import Client
from specdec.launcher.stack import Stack, StackSettings
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.slow


def stack_settings(model_dirs, persist: bool) -> StackSettings:
    return StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        persist_redis=persist,
        coordinator_args=["--lease-s", "1.0"],
    )


def crash_and_restart(stack) -> None:
    stack.redis.process.send_signal(signal.SIGKILL)
    stack.redis.process.wait(10)
    stack.redis.restart()


def test_sessions_survive_a_redis_restart(model_dirs):
    with Stack(stack_settings(model_dirs, persist=True)) as stack:
        with Client(stack.address) as client:
            done = client.generate(
                "import os\n", max_new_tokens=12, ignore_eos=True, session_id="kept"
            )
        expected = reference(stack, num_speculative_tokens=2)
        tokens, last = stream_and_kill(
            stack, lambda: crash_and_restart(stack), num_speculative_tokens=2, session_id="through"
        )
        assert tokens == expected  # no token lost or repeated across the restart
        with Client(stack.address) as client:
            assert session_code(client, "kept") == grpc.StatusCode.OK
            info = client.get_session("kept")
        assert info.status == coordinator_pb2.SESSION_STATUS_FINISHED
        assert list(info.generated_token_ids) == list(done.token_ids)


def test_negative_control_without_persistence_the_restart_loses_them(model_dirs):
    with (
        Stack(stack_settings(model_dirs, persist=False)) as stack,
        Client(stack.address) as client,
    ):
        client.generate("import os\n", max_new_tokens=4, ignore_eos=True, session_id="lost")
        crash_and_restart(stack)
        assert session_code(client, "lost") == grpc.StatusCode.NOT_FOUND
        # a client resuming the lost session gets an error, never a new generation
        stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(stack.address))
        resume = coordinator_pb2.GenerateRequest(session_id="lost", resume_from=2)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.GenerateStream(resume, timeout=30))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def session_code(client, session_id: str):
    """GetSession's status code once the coordinator has reconnected to Redis."""
    for _ in range(20):
        try:
            client.get_session(session_id)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                return exc.code()
        time.sleep(0.25)
    return grpc.StatusCode.UNAVAILABLE


def test_a_redis_that_loses_its_data_mid_stream_ends_the_session_never_a_new_one(model_dirs):
    """An external Redis restarted empty while a session streams (no persistence): the
    stream ends with an error (ABORTED or NOT_FOUND) after a prefix of the right tokens, a
    resume is refused, and nothing re-creates the session — never a new generation."""
    with Stack(stack_settings(model_dirs, persist=False)) as stack:
        expected = reference(stack, num_speculative_tokens=2)
        tokens = []
        with pytest.raises(grpc.RpcError) as info:
            tokens, _ = stream_and_kill(
                stack, lambda: crash_and_restart(stack), num_speculative_tokens=2,
                session_id="wiped",
            )  # fmt: skip
        assert info.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND), (
            info.value.code(),
            info.value.details(),
        )
        admin = redis.Redis.from_url(stack.redis_url)
        time.sleep(2.5)  # past the 1 s lease and a renewal tick: nothing brought it back
        assert admin.keys("specdec:{wiped}*") == []
        stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(stack.address))
        resume = coordinator_pb2.GenerateRequest(session_id="wiped", resume_from=5)
        with pytest.raises(grpc.RpcError) as again:
            list(stub.GenerateStream(resume, timeout=30))
        assert again.value.code() == grpc.StatusCode.NOT_FOUND
        assert admin.keys("specdec:{wiped}*") == []
    assert len(expected) > 20
