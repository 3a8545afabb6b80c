"""structlog set-up: console or JSON lines on stderr, level from the environment.

``HARBOR_ASYNC_LOG_LEVEL`` (default ``warning``) and ``HARBOR_ASYNC_LOG_FORMAT``
(``console`` or ``json``) apply when the application has not configured
structlog itself.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at write time.

    Test runners and notebooks swap ``sys.stderr``; a stream captured at
    configure time may be closed by the time a sandbox logs.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None, fmt: str | None = None, *, force: bool = False) -> None:
    """Configure structlog for this process (no-op if configured, unless ``force``)."""
    if structlog.is_configured() and not force:
        return
    level = (level or os.environ.get("HARBOR_ASYNC_LOG_LEVEL", "warning")).upper()
    fmt = (fmt or os.environ.get("HARBOR_ASYNC_LOG_FORMAT", "console")).lower()
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be 'console' or 'json', got {fmt!r}")
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level]),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )
