"""Status mapping for gRPC handlers, in one place.

Only the project's own client-facing errors (`specdec.errors`) become client codes, with
their message. A deadline that ran out is DEADLINE_EXCEEDED. Anything else is a bug of ours:
INTERNAL with a generic message that carries a request id; the traceback goes to the log
under the same id, so nothing about hosts, paths or code reaches the caller.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import uuid

import grpc
import redis.exceptions

from specdec import errors
from specdec.serving import telemetry
from specdec.serving.server import Malformed

log = logging.getLogger(__name__)

STATUS = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.StaleBase: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Exhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}


# Redis failures a retry can outlive (connection refused or reset, a timeout, a replica that
# is loading, a cluster failing over); the message never carries Redis's host or port.
REDIS_TROUBLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterException,  # "Redis Cluster cannot be connected"
)
# Error replies that mean the same when a client library passes them on as a plain reply
# error (Redis 6.2 answers a script that writes on a demoted master "... READONLY ...").
REDIS_TROUBLE_REPLIES = ("READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN")


def _redis_trouble(exc: BaseException) -> bool:
    if isinstance(exc, REDIS_TROUBLE):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and any(
        word in str(exc) for word in REDIS_TROUBLE_REPLIES
    )


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-safe message for an exception raised in a handler."""
    for cls, code in STATUS.items():
        if isinstance(exc, cls):
            return code, str(exc)
    request_id = uuid.uuid4().hex[:16]
    if _redis_trouble(exc):  # the store is down, slow or failing over: retry
        log.warning(
            "session store unavailable, request id %s: %s: %s", request_id, type(exc).__name__, exc
        )
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"the session store is unavailable; retry (request id {request_id})",
        )
    if isinstance(exc, asyncio.TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    log.error("internal error, request id %s", request_id, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})"


def _record(service, name: str, code: grpc.StatusCode) -> None:
    hook = getattr(service, "record_call", None)
    if hook is not None:
        hook(name, code.name)


async def _abort(service, context, exc: BaseException, name: str):
    code, message = status_of(exc)
    _record(service, name, code)
    await context.abort(code, message)


def _refuse_malformed(request) -> None:
    if isinstance(request, Malformed):
        raise errors.InvalidArgument(
            f"request: not a valid {request.message_name} (malformed protobuf, or a string "
            "field that is not UTF-8)"
        )


def _span_name(service, method) -> str:
    return f"{type(service).__name__}/{method.__name__}"


def rpc(method):
    """Map errors raised by an async handler (unary or streaming) to gRPC statuses."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                with telemetry.server_span(_span_name(self, method), context) as reply:
                    if reply:
                        await context.send_initial_metadata(reply)
                    _refuse_malformed(request)
                    async for item in method(self, request, context):
                        yield item
                _record(self, method.__name__, grpc.StatusCode.OK)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never a crash
                await _abort(self, context, exc, method.__name__)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            with telemetry.server_span(_span_name(self, method), context) as reply:
                if reply:
                    await context.send_initial_metadata(reply)
                _refuse_malformed(request)
                response = await method(self, request, context)
            _record(self, method.__name__, grpc.StatusCode.OK)
            return response
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never a crash
            await _abort(self, context, exc, method.__name__)

    return unary_wrapper
