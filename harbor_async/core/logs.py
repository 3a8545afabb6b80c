"""Logging: structlog events carried by the standard library's ``logging``.

The library never configures logging. Its loggers (:func:`get_logger`) hand
each event to a stdlib logger under ``harbor_async``, so an application's own
``logging`` set-up decides levels and handlers; with none, Python prints
warnings and errors to stderr as it does for any library.

Applications that want this project's console or JSON lines call
:func:`configure_logging` (the command line and the benchmarks do): it puts one
handler on the ``harbor_async`` logger and picks the renderer. Each setting is
taken from the argument (a command-line flag), else ``HARBOR_ASYNC_LOG_LEVEL``
/ ``HARBOR_ASYNC_LOG_FORMAT``, else the default (``warning``, ``console``).
After it, each job folder opened (:func:`log_to_job`) takes LiteLLM's own
output (a Harbor agent's model client) into its ``harbor-async.log``, off the
progress bar.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from harbor_async.core.errors import LogSettingError
from harbor_async.core.printing import escape_fields

ROOT_LOGGER = "harbor_async"
LEVEL_ENV = "HARBOR_ASYNC_LOG_LEVEL"
FORMAT_ENV = "HARBOR_ASYNC_LOG_FORMAT"
DEFAULT_LEVEL = "warning"
DEFAULT_FORMAT = "console"
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("console", "json")
#: LiteLLM's loggers (terminus-2's model client): in a command's job, they write to the job's log, not the terminal.
LITELLM_LOGGERS = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy")
#: Harbor's own loggers (its agents' "Unknown Error in LLM interaction", ...): in the job's log too, at INFO and above.
HARBOR_LOGGERS = ("harbor",)
#: The job folder's log of LiteLLM's records (made only when one is logged).
JOB_LOG_NAME = "harbor-async.log"


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at write time.

    Test runners and notebooks swap ``sys.stderr``; a stream captured at
    configure time may be closed by the time a sandbox logs.
    """

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it
        pass


class _Renderer:
    """The last processor of every library logger: console text unless JSON was asked for."""

    def __init__(self) -> None:
        self.use("console")

    def use(self, fmt: str) -> None:
        self._render = (
            structlog.processors.JSONRenderer()
            if fmt == "json"
            else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        )

    def __call__(self, logger: Any, method: str, event_dict: dict[str, Any]) -> tuple[tuple[str | bytes], dict[str, Any]]:
        # A log line may carry a task's, a sandbox's or a model's strings: no control character reaches a terminal.
        event_dict = escape_fields(event_dict)
        # The event itself rides along on the LogRecord (``record.event_dict``) for handlers that want fields.
        fields = dict(event_dict)
        return (self._render(logger, method, event_dict),), {"extra": {"event_dict": fields}}


_renderer = _Renderer()
_handler: logging.Handler | None = None

# One chain for every logger: a sandbox's logger must not build its own.
_PROCESSORS: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.processors.format_exc_info,
    _renderer,
]


class _LevelCheckedLogger(structlog.stdlib.BoundLogger):
    """A stdlib-carried structlog logger that drops an event below the level before any processor runs.

    Every exec logs its phase at debug: with the processors first (as
    ``filter_by_level`` in the chain would have it) a dropped event still paid
    for the context merge and the event dict, about 6 µs of the loop thread.
    The check is ``filter_by_level``'s own, so the levels users see are the same.
    """

    def _proxy_to_logger(self, method_name: str, event: str | None = None, *event_args: str, **event_kw: Any) -> Any:
        logger = self._logger
        if logger.disabled or _LEVELS[method_name] < logger.getEffectiveLevel():
            return None
        return super()._proxy_to_logger(method_name, event, *event_args, **event_kw)

    def is_enabled_for(self, method_name: str) -> bool:  # type: ignore[override]  # a level name here; structlog's takes a number
        """Whether an event of level ``method_name`` (``"debug"``...) would be logged now."""
        return not self._logger.disabled and _LEVELS[method_name] >= self._logger.getEffectiveLevel()


# structlog's method names (``exception`` logs at error) to stdlib levels.
_LEVELS = {name: logging.getLevelNamesMapping()[name.upper()] for name in ("critical", "error", "warning", "info", "debug", "notset")}
_LEVELS |= {"exception": logging.ERROR, "warn": logging.WARNING}


_ROOT = logging.getLogger(ROOT_LOGGER)


def enabled_for(method_name: str) -> bool:
    """Whether a logger of :func:`get_logger`'s default name would log an event of level ``method_name`` now.

    The check of ``is_enabled_for`` without a bound logger: for code that makes its logger only once it logs.
    """
    return not _ROOT.disabled and _LEVELS[method_name] >= _ROOT.getEffectiveLevel()


def get_logger(name: str = ROOT_LOGGER, **context: Any) -> Any:
    """A structlog logger of the library, bound to ``context``, carried by stdlib logger ``name``.

    An event below the stdlib logger's effective level costs a level check only.
    """
    return _LevelCheckedLogger(logging.getLogger(name), _PROCESSORS, dict(context))


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


@contextmanager
def quieter(level: str = "error") -> Iterator[None]:
    """Within the block, drop the library's log events below ``level`` (for what the caller reports itself)."""
    logger = logging.getLogger(ROOT_LOGGER)
    previous = logger.level
    wanted = logging.getLevelNamesMapping()[level.upper()]
    if logger.getEffectiveLevel() >= wanted:
        yield
        return
    logger.setLevel(wanted)
    try:
        yield
    finally:
        logger.setLevel(previous)


def configure_logging(level: str | None = None, fmt: str | None = None, *, force: bool = False) -> None:
    """Send the library's events to stderr as console text or JSON lines (for applications).

    From then on each job folder opened sends LiteLLM's own output to its log (see :func:`log_to_job`).
    A no-op when already configured, unless ``force``.

    Raises:
        LogSettingError: an unknown level or format.
    """
    global _handler, _job_logs
    if _handler is not None and not force:
        return
    level, fmt = log_settings(level, fmt)
    _job_logs = True
    _renderer.use(fmt)
    logger = logging.getLogger(ROOT_LOGGER)
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = _CurrentStderrHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(level.upper())
    logger.propagate = False


# ── LiteLLM's output, in the job's log ─────────────────────────────────────

_job_logs = False  # set by configure_logging: a program that configures its own logging keeps LiteLLM's as it is
_job_handler: logging.FileHandler | None = None


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


class _OffTheConsole(logging.Filter):
    """On a LiteLLM logger: takes off the console handler LiteLLM adds when it is imported after :func:`log_to_job`."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        for handler in [h for h in self.logger.handlers if _is_console(h)]:
            self.logger.removeHandler(handler)
        _quiet_litellm()
        return True


def _quiet_litellm() -> None:
    """LiteLLM's "Give Feedback / Get Help" lines and verbose prints are ``print()`` calls, not records: off (once imported)."""
    litellm: Any = sys.modules.get("litellm")
    if litellm is not None:
        litellm.suppress_debug_info = True
        litellm.set_verbose = False


def log_to_job(job_dir: str | os.PathLike[str]) -> Path | None:
    """Send LiteLLM's and Harbor's log records to ``job_dir/harbor-async.log`` instead of stderr, where they would print over the progress bar.

    Called as a job folder is made or opened (:mod:`harbor_async.jobs.folder`); a
    no-op (``None``) unless :func:`configure_logging` ran, as the commands run
    it: the library never configures logging for a program of its own. LiteLLM's
    and Harbor's loggers (:data:`LITELLM_LOGGERS`, :data:`HARBOR_LOGGERS`; INFO and above) lose their console handler (also one that
    a later import of LiteLLM adds) and stop propagating; LiteLLM's own printed
    hints are turned off (``litellm.suppress_debug_info``). The file is made at
    the first record. A later job replaces an earlier one's file. Returns the log's path.
    """
    global _job_handler
    if not _job_logs:
        return None
    path = Path(job_dir) / JOB_LOG_NAME
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)  # Harbor sets its loggers to DEBUG: its debug records would fill the file
    for name in (*LITELLM_LOGGERS, *HARBOR_LOGGERS):
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if h is _job_handler or _is_console(h)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False
        if not any(isinstance(f, _OffTheConsole) for f in logger.filters):
            logger.addFilter(_OffTheConsole(logger))
    if _job_handler is not None:
        _job_handler.close()
    _job_handler = handler
    _quiet_litellm()
    return path
