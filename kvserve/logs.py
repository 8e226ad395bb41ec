"""structlog set-up: coloured key=value on a terminal, one JSON object per line otherwise."""
from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStdout:
    """Whatever ``sys.stdout`` is when a line is written (a test runner swaps it)."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Configures structlog and the stdlib root logger (which grpc and uvicorn use)."""
    if json is None:
        json = not sys.stdout.isatty()
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(level=numeric, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStdout()),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
