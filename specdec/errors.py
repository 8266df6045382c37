"""The project's own errors: what a caller did wrong or what is not available right now.

Each maps to one gRPC status code in one place (`specdec.serving.rpc`), with its message
(which names the offending field) passed to the client. Anything else raised in a handler is
our bug: INTERNAL with a generic message, details only in the log. Plain Python, no imports,
so every layer may raise these.
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class of the errors a client may see; the message names the offending field."""


class InvalidArgument(SpecdecError, ValueError):
    """The request is malformed or out of range (INVALID_ARGUMENT)."""


class StaleBase(SpecdecError):
    """The worker's cached prefix does not match the request's base (FAILED_PRECONDITION)."""


class Conflict(SpecdecError):
    """The request contradicts what already exists, e.g. a reused session id with another
    prompt (FAILED_PRECONDITION)."""


class OutOfRange(SpecdecError):
    """An offset past what exists, e.g. resume_from beyond the generated tokens
    (OUT_OF_RANGE)."""


class NotFound(SpecdecError):
    """The named session does not exist (NOT_FOUND)."""


class Exhausted(SpecdecError):
    """Capacity is full (RESOURCE_EXHAUSTED)."""


class Unavailable(SpecdecError):
    """A tier needed for the request is down; retry, possibly elsewhere (UNAVAILABLE)."""
