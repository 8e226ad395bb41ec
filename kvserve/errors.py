"""Domain errors every service raises; ``kvserve.server`` maps them to gRPC status codes.

This module imports no grpc, so domain modules can raise these without
depending on the transport.
"""
from __future__ import annotations


class KVServeError(Exception):
    """Base class; ``code`` names the ``grpc.StatusCode`` member the interceptor uses."""

    code = "INTERNAL"


class InvalidArgument(KVServeError, ValueError):
    """Malformed input: the message names the field."""

    code = "INVALID_ARGUMENT"


class NotFound(KVServeError, KeyError):
    """An unknown pool, session, sequence or request id."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; keep it plain
        return str(self.args[0]) if self.args else ""


class AlreadyExists(KVServeError):
    """An id that must be new is taken."""

    code = "ALREADY_EXISTS"


class PermissionDenied(KVServeError):
    """A client touched what another session owns."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(KVServeError):
    """No room: a full queue, or a request that can never fit."""

    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(KVServeError):
    """The operation is refused in the current state (e.g. reset while in use)."""

    code = "FAILED_PRECONDITION"


class Unavailable(KVServeError):
    """A dependency (kvmanager, executor) cannot be reached."""

    code = "UNAVAILABLE"


class DeadlineExceeded(KVServeError):
    """A request outlived its timeout (the gateway's --request-timeout, or the gRPC deadline)."""

    code = "DEADLINE_EXCEEDED"


class StaleStep(KVServeError):
    """A step ordered for another instance of an executor (it restarted since): refused whole,
    so that nothing of the new, empty KV cache is saved as another's KV."""

    code = "ABORTED"


class StepRefused(KVServeError):
    """A dependency refused a step this request was in (its input, not an outage):
    only the requests of that step fail (HTTP 500, gRPC INTERNAL), naming the reason."""

    code = "INTERNAL"


class IncompatibleDependency(KVServeError):
    """A dependency answers but cannot serve with this gateway (another tokenizer)."""

    code = "FAILED_PRECONDITION"


class StartupError(Exception):
    """A service cannot start (port in use, missing model); the CLI prints it as one line and exits 1."""
