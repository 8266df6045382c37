"""Redis trouble of every topology becomes UNAVAILABLE (the client resumes), with no host,
port or library text in the message; any other Redis error is a bug of ours: INTERNAL."""

from __future__ import annotations

import grpc
import pytest
import redis.exceptions as rx

from specdec.serving.rpc import status_of

HOST = "10.1.2.3:6379"


@pytest.mark.parametrize(
    "exc",
    [
        rx.ConnectionError(f"Error 111 connecting to {HOST}. Connection refused."),
        rx.TimeoutError(f"Timeout reading from {HOST}"),
        rx.MaxConnectionsError("Too many connections"),
        rx.BusyLoadingError("Redis is loading the dataset in memory"),
        rx.ReadOnlyError("You can't write against a read only replica."),
        rx.ClusterDownError("The cluster is down"),
        rx.TryAgainError("TRYAGAIN"),
        rx.MasterDownError("MASTERDOWN Link with MASTER is down"),
        rx.RedisClusterException(f"Redis Cluster cannot be connected: {HOST}"),
        # a demoted master (Sentinel failover) as a plain reply error from inside a script
        rx.ResponseError(
            "Error running script (call to f_abc): @user_script:1: @user_script: 1: "
            "-READONLY You can't write against a read only replica."
        ),
    ],
)
def test_redis_trouble_is_unavailable_without_internals(exc):
    code, message = status_of(exc)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "10.1.2.3" not in message and "6379" not in message and "retry" in message


@pytest.mark.parametrize(
    "exc",
    [
        rx.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        rx.DataError("Invalid input of type: 'dict'"),
        ValueError("a bug"),
    ],
)
def test_other_errors_are_internal_and_generic(exc):
    code, message = status_of(exc)
    assert code == grpc.StatusCode.INTERNAL
    assert message.startswith("internal error (request id ") and "WRONGTYPE" not in message
