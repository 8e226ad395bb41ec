"""The ``model`` a request names, checked the same way by the HTTP and gRPC APIs."""
from __future__ import annotations

from kvserve.errors import InvalidArgument


def check_model_name(requested: str | None, served: str) -> None:
    """No name (``None`` or empty) means the served model; any other name must be it."""
    if requested and requested != served:
        raise InvalidArgument(f"model: {requested!r} does not exist; this server serves {served!r}")
