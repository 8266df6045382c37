"""Domain errors, each mapped to one gRPC status code in one place (specdec.grpc_util)."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class; the message names the offending field."""


class InvalidArgument(SpecdecError, ValueError):
    pass


class StaleBase(SpecdecError):
    """The worker's cached prefix does not match the request's base (FAILED_PRECONDITION)."""


class NotFound(SpecdecError):
    pass


class Exhausted(SpecdecError):
    """Capacity is full (RESOURCE_EXHAUSTED)."""


class Unavailable(SpecdecError):
    pass
