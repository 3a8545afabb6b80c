"""structlog set-up: console or JSON lines on stderr; called by command lines only.

The library never configures logging: the ``harbor-async`` commands and the
benchmarks call :func:`configure_logging`. Each setting is taken from the
argument (a command-line flag), else ``HARBOR_ASYNC_LOG_LEVEL`` /
``HARBOR_ASYNC_LOG_FORMAT``, else the default (``warning``, ``console``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from harbor_async.errors import HarborAsyncError

LEVEL_ENV = "HARBOR_ASYNC_LOG_LEVEL"
FORMAT_ENV = "HARBOR_ASYNC_LOG_FORMAT"
DEFAULT_LEVEL = "warning"
DEFAULT_FORMAT = "console"
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("console", "json")


class LogSettingError(HarborAsyncError, ValueError):
    """A log level or format that does not exist (from a flag or the environment)."""


def log_settings(level: str | None = None, fmt: str | None = None) -> tuple[str, str]:
    """The level and format to use: the argument, else the environment variable, else the default.

    Raises:
        LogSettingError: naming the setting, where it came from and the choices.
    """
    chosen = []
    for value, env, default, choices, what in (
        (level, LEVEL_ENV, DEFAULT_LEVEL, LEVELS, "log level"),
        (fmt, FORMAT_ENV, DEFAULT_FORMAT, FORMATS, "log format"),
    ):
        source = "given"
        if value is None or not value.strip():
            value, source = os.environ.get(env, ""), f"from ${env}"
            if not value.strip():
                value, source = default, "default"
        value = value.strip().lower()
        if value not in choices:
            raise LogSettingError(f"{what} {value!r} ({source}) is not one of {', '.join(choices)}")
        chosen.append(value)
    return chosen[0], chosen[1]


_level: int | None = None  # the level configure_logging set, if it did


@contextmanager
def quieter(level: str = "error") -> Iterator[None]:
    """Within the block, drop log events below ``level`` (for what the caller reports itself)."""
    previous = _level
    wanted = logging.getLevelNamesMapping()[level.upper()]
    if previous is None or previous >= wanted:
        yield
        return
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(wanted))
    try:
        yield
    finally:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(previous))


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
    """Configure structlog for this process (no-op if configured, unless ``force``).

    See :func:`log_settings` for where the level and format come from.

    Raises:
        LogSettingError: an unknown level or format.
    """
    if structlog.is_configured() and not force:
        return
    level, fmt = log_settings(level, fmt)
    global _level
    _level = logging.getLevelNamesMapping()[level.upper()]
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
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )
