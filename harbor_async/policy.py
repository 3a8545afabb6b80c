"""Timeouts, retry policy and limits: the knobs of the engine, with sound defaults."""

from __future__ import annotations

import errno
import functools
import math
import re
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field, replace

import anyio
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from harbor_async.errors import BackendError, SandboxError


@dataclass(frozen=True)
class Timeouts:
    """Per-phase time budgets in seconds (``None``: no limit for that phase).

    ``agent`` bounds a model-free Harbor agent's run (the oracle's solve.sh);
    ``slot`` bounds the wait for a live-sandbox slot before a start.

    ``episode`` bounds the whole life of a sandbox, from the start request to the
    verifier's reward; every phase gets the smaller of its own budget and what is
    left of the episode. ``stop`` is separate: teardown always gets its own budget,
    even after the episode deadline has passed.
    """

    start: float | None = 600.0
    exec: float | None = 180.0
    agent: float | None = 1800.0
    verify: float | None = 600.0
    stop: float | None = 120.0
    slot: float | None = 600.0
    episode: float | None = None
    timeout_multiplier: float = 1.0
    agent_timeout_multiplier: float | None = None
    verifier_timeout_multiplier: float | None = None
    environment_build_timeout_multiplier: float | None = None

    def __post_init__(self) -> None:
        for name in ("start", "exec", "agent", "verify", "stop", "slot", "episode"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"timeout {name!r} must be a positive number of seconds or None, got {value!r}")
        for name in (
            "timeout_multiplier",
            "agent_timeout_multiplier",
            "verifier_timeout_multiplier",
            "environment_build_timeout_multiplier",
        ):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value!r}")

    def for_task(self, task: Any) -> Timeouts:
        """The budgets for one Harbor task, as ``harbor run`` computes them.

        A task's ``[agent] timeout_sec``, ``[verifier] timeout_sec`` and
        ``[environment] build_timeout_sec`` replace the agent, verify and start
        budgets when the task's ``task.toml`` actually sets them (Harbor fills
        unset fields with its own defaults; those are ignored here, so the
        engine's budgets apply). Each budget is then multiplied by its phase's
        multiplier, else by ``timeout_multiplier``.
        """
        config = task.config
        agent = _task_value(config.agent, "timeout_sec", self.agent)
        verify = _task_value(config.verifier, "timeout_sec", self.verify)
        start = _task_value(config.environment, "build_timeout_sec", self.start)
        base = self.timeout_multiplier
        return replace(
            self,
            agent=_scaled(agent, self.agent_timeout_multiplier or base),
            verify=_scaled(verify, self.verifier_timeout_multiplier or base),
            start=_scaled(start, self.environment_build_timeout_multiplier or base),
            exec=_scaled(self.exec, base),
            episode=_scaled(self.episode, base),
            timeout_multiplier=1.0,
            agent_timeout_multiplier=None,
            verifier_timeout_multiplier=None,
            environment_build_timeout_multiplier=None,
        )


def _task_value(section: Any, field_name: str, default: float | None) -> float | None:
    """A timeout the task's TOML set explicitly, else ``default``."""
    if section is not None and field_name in getattr(section, "model_fields_set", ()):
        value = getattr(section, field_name)
        if value is not None:
            return float(value)
    return default


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


# Errors that say the task or the configuration is wrong, or that the process
# itself is in trouble, or that the code has a bug: retrying cannot help.
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    ImportError,
    BackendError,
    ValueError,
    TypeError,
    NotImplementedError,
    MemoryError,
    LookupError,  # KeyError, IndexError
    AttributeError,
    NameError,
    AssertionError,
    RecursionError,
    SyntaxError,
)
#: ``OSError`` numbers of a full disk or quota: the next attempt would fail the same way.
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_PERMANENT_WORDS = re.compile(
    r"quota|not found|no such image|manifest unknown|pull access denied|"
    r"invalid|unauthori[sz]ed|forbidden|permission denied|build failed",
    re.IGNORECASE,
)


def is_transient(exc: BaseException) -> bool:
    """Whether a start failure is worth retrying.

    Harbor's backends raise many error types; a failure is permanent when its
    type or message says the task, image, credentials or quota are wrong, and
    transient otherwise (network blips, daemon hiccups, slow providers).
    """
    from harbor.environments.base import SandboxBuildFailedError

    if not isinstance(exc, Exception):  # cancellation, KeyboardInterrupt, SystemExit
        return False
    if isinstance(exc, SandboxError):
        return False
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return False
    if isinstance(exc, (SandboxBuildFailedError, *_PERMANENT_TYPES)):
        return False
    if getattr(exc, "transient", None) is not None:
        return bool(exc.transient)
    return not _PERMANENT_WORDS.search(str(exc))


def _stop_at(deadline: Callable[[], float]) -> Callable[[Any], bool]:
    """A tenacity stop condition: stop once the deadline has passed."""
    return lambda retry_state: anyio.current_time() >= deadline()


def _capped_at(deadline: Callable[[], float], wait: Callable[[Any], float]) -> Callable[[Any], float]:
    """A tenacity wait that never sleeps past ``deadline`` (the stop then ends the retries)."""
    return lambda retry_state: max(0.0, min(wait(retry_state), deadline() - anyio.current_time()))


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff for sandbox creation.

    Only the start phase is retried: an exec may have had side effects in the
    sandbox, so it is never repeated behind the caller's back.
    """

    attempts: int = 3
    initial_wait: float = 0.5
    max_wait: float = 10.0
    max_total: float | None = 120.0

    def retrying(self, deadline: float | Callable[[], float] = math.inf) -> AsyncRetrying:
        """A tenacity ``AsyncRetrying`` that sleeps with anyio (asyncio or trio).

        ``deadline`` (``anyio.current_time()`` clock, or a callable read at each
        decision, for a deadline that may be renewed): no attempt begins past
        it, and no backoff sleeps past it.
        """
        if not callable(deadline):
            deadline = functools.partial(float, deadline)
        stop = stop_after_attempt(max(1, self.attempts)) | _stop_at(deadline)
        if self.max_total is not None:
            stop = stop | stop_after_delay(self.max_total)
        return AsyncRetrying(
            stop=stop,
            wait=_capped_at(deadline, wait_random_exponential(multiplier=self.initial_wait, max=self.max_wait)),
            retry=retry_if_exception(is_transient),
            sleep=anyio.sleep,
            reraise=True,
        )


@dataclass(frozen=True)
class Limits:
    """Concurrency limits (``None``: unlimited).

    ``live_sandboxes`` counts a sandbox from its create call until its stop is
    confirmed, so a slow teardown still holds its slot. ``concurrent_execs``
    bounds the commands, uploads, downloads, agent runs and verifier runs in
    flight across all sandboxes.
    """

    live_sandboxes: int | None = 64
    creates_per_second: float | None = None
    concurrent_execs: int | None = None


@dataclass
class RateLimiter:
    """Spaces calls at least ``1 / rate`` seconds apart, first come first served."""

    rate: float | None
    _lock: anyio.Lock = field(default_factory=anyio.Lock, init=False)
    _next: float = field(default=-math.inf, init=False)

    async def wait(self) -> None:
        """Wait for this caller's turn."""
        if not self.rate:
            return
        async with self._lock:
            now = anyio.current_time()
            if self._next > now:
                await anyio.sleep(self._next - now)
                now = self._next
            self._next = now + 1.0 / self.rate
