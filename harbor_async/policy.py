"""Timeouts, retry policy and limits: the knobs of the engine, with sound defaults."""

from __future__ import annotations

import errno
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import anyio
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from harbor.environments.base import SandboxBuildFailedError

from harbor_async.errors import (
    BackendError,
    BackendStartError,
    EpisodeDeadlineError,
    FailureClass,
    InvalidTaskError,
    ModelServerError,
    Phase,
    SandboxCancelledError,
    SandboxError,
    SettingError,
    TaskDefinitionError,
    VerifierFailure,
)


@dataclass(frozen=True)
class Timeouts:
    """Per-phase time budgets in seconds (``None``: no limit for that phase).

    ``agent`` bounds the agent's run (the oracle's solve.sh; a rollout's tool
    time; an evaluation's loop) when the task's ``[agent] timeout_sec`` does not:
    ``None`` by default, as Harbor (no limit unless the task sets one);
    ``slot`` bounds the wait for a live-sandbox slot before a start.

    ``episode`` bounds the whole life of a sandbox, from the start request to the
    verifier's reward; every phase gets the smaller of its own budget and what is
    left of the episode. ``stop`` is separate: teardown always gets its own budget,
    even after the episode deadline has passed.
    """

    start: float | None = 600.0
    exec: float | None = 180.0
    agent: float | None = None
    verify: float | None = 600.0
    stop: float | None = 120.0
    slot: float | None = 600.0
    episode: float | None = None
    timeout_multiplier: float = 1.0
    agent_timeout_multiplier: float | None = None
    verifier_timeout_multiplier: float | None = None
    environment_build_timeout_multiplier: float | None = None
    agent_setup_timeout_multiplier: float | None = None  # a Harbor agent's setup (Harbor's flag of that name)

    def __post_init__(self) -> None:
        for name in ("start", "exec", "agent", "verify", "stop", "slot", "episode"):
            _check_positive(name, getattr(self, name), "a positive number of seconds or None")
        for name in (
            "timeout_multiplier",
            "agent_timeout_multiplier",
            "verifier_timeout_multiplier",
            "environment_build_timeout_multiplier",
            "agent_setup_timeout_multiplier",
        ):
            _check_positive(name, getattr(self, name), "a positive number")

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


    def for_step(self, task: Any, step: Any | None) -> Timeouts:
        """The budgets of one step of a multi-step task (:meth:`for_task` with the step's own timeouts).

        A step's ``[steps.agent]``/``[steps.verifier]`` ``timeout_sec`` replaces the
        task's where the step sets it; ``None`` is the whole task.
        """
        if step is None:
            return self.for_task(task)
        config = task.config
        agent = step.agent if step.agent.timeout_sec is not None else config.agent
        verifier = step.verifier if "timeout_sec" in step.verifier.model_fields_set else config.verifier
        view = SimpleNamespace(agent=agent, verifier=verifier, environment=config.environment)
        return self.for_task(SimpleNamespace(config=view))


def _check_positive(name: str, value: Any, requirement: str) -> None:
    """A positive finite number, or ``None``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise SettingError(name, value, requirement)


def _check_count(name: str, value: Any) -> None:
    """A positive integer, or ``None``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SettingError(name, value, "a positive integer or None")


def _task_value(section: Any, field_name: str, default: float | None) -> float | None:
    """A timeout the task's TOML set explicitly, else ``default``."""
    if section is not None and field_name in getattr(section, "model_fields_set", ()):
        value = getattr(section, field_name)
        if value is not None:
            return float(value)
    return default


def _scaled(value: float | None, factor: float) -> float | None:
    if value is None:
        return None
    scaled = value * factor
    if not math.isfinite(scaled):  # a large task value times a large multiplier
        raise SettingError("timeout", scaled, f"finite after the multiplier ({value:g} s x {factor:g})")
    return scaled


@dataclass(frozen=True)
class ErrorRule:
    """What an error means for its episode (as Harbor's ``ErrorPolicy``).

    Attributes:
        failure: who the episode's failure is blamed on.
        retry: whether a sandbox start that failed with it is worth another attempt.
        graded: whether the episode still counts as the model's (scored, 0
            without a reward) or is left out and rerun by a resume.
    """

    failure: FailureClass
    retry: bool

    @property
    def graded(self) -> bool:
        """Whether the episode is the model's (see :attr:`FailureClass.scored`)."""
        return self.failure.scored


_INFRA_RETRY = ErrorRule(FailureClass.INFRASTRUCTURE, retry=True)
_INFRA = ErrorRule(FailureClass.INFRASTRUCTURE, retry=False)
_INVALID_TASK = ErrorRule(FailureClass.INVALID_TASK, retry=False)
#: A start failing with one of these fails the same way again: the task, image, configuration or
#: host is wrong, or the code has a bug.
_PERMANENT: tuple[type[BaseException], ...] = (
    BackendError, SandboxBuildFailedError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError,
    ValueError, TypeError, NotImplementedError, MemoryError, LookupError, AttributeError, NameError,
    AssertionError, RecursionError, SyntaxError,
)  # fmt: skip

#: The one error-policy table: the first row whose type (and phase, for sandbox
#: errors; ``None`` matches any) fits the error decides (a subclass's row comes
#: before its base's). Types only: a backend whose library raises an untyped
#: error turns it into a typed one in its own adapter
#: (:meth:`harbor_async.backends.BackendSpec.typed_error`), never here.
ERROR_POLICY: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], Phase | None, ErrorRule], ...] = (
    # Not errors of the episode: an interruption, an exit, a superseded start.
    (SandboxCancelledError, None, ErrorRule(FailureClass.CANCELLED, retry=False)),
    # The model's episode.
    (ModelServerError, None, ErrorRule(FailureClass.MODEL_SERVER, retry=False)),
    (VerifierFailure, None, ErrorRule(FailureClass.VERIFIER, retry=False)),
    (EpisodeDeadlineError, Phase.START, _INFRA),
    (EpisodeDeadlineError, None, ErrorRule(FailureClass.AGENT, retry=False)),
    # The task cannot be built as written (its Dockerfile, a COPY source that is not there).
    ((InvalidTaskError, TaskDefinitionError), None, _INVALID_TASK),
    (SandboxError, Phase.AGENT, ErrorRule(FailureClass.AGENT, retry=False)),
    # Sandbox errors of the other phases were already retried where that was safe.
    (SandboxError, None, _INFRA),
    # Raised by a backend while starting: permanent when the task, image,
    # configuration or host is wrong, or the code has a bug.
    (BackendStartError, None, _INFRA),  # its own ``transient`` decides, see rule_for
    (_PERMANENT, None, _INFRA),
    # Anything else from a backend: a network blip, a daemon hiccup, a slow provider.
    (Exception, None, _INFRA_RETRY),
    # Not an Exception: KeyboardInterrupt, SystemExit, a cancellation.
    (BaseException, None, ErrorRule(FailureClass.CANCELLED, retry=False)),
)

#: ``OSError`` numbers of a full disk or quota: the next attempt would fail the same way.
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def rule_for(exc: BaseException) -> ErrorRule:
    """The :data:`ERROR_POLICY` row that decides ``exc``."""
    transient = getattr(exc, "transient", None)  # typed metadata a backend's error carries, not its text
    if isinstance(exc, TaskDefinitionError):  # the task's own definition, whatever the backend
        return _INVALID_TASK
    if isinstance(exc, BackendStartError) or isinstance(transient, bool):
        return _INFRA_RETRY if transient else _INFRA
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return _INFRA
    phase = exc.phase if isinstance(exc, SandboxError) else None
    for kind, when, rule in ERROR_POLICY:
        if isinstance(exc, kind) and (when is None or when is phase):
            return rule
    raise AssertionError("unreachable: the table ends with BaseException and Exception rows")  # pragma: no cover


def failure_class(exc: BaseException) -> FailureClass:
    """Who ``exc`` is blamed on (see :class:`~harbor_async.errors.FailureClass`)."""
    return rule_for(exc).failure


def is_transient(exc: BaseException) -> bool:
    """Whether a start that failed with ``exc`` is worth retrying."""
    return rule_for(exc).retry


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

    def __post_init__(self) -> None:
        attempts = self.attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise SettingError("attempts", attempts, "an integer >= 1")
        for name in ("initial_wait", "max_wait", "max_total"):
            _check_positive(name, getattr(self, name), "a positive number of seconds")

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
    """Concurrency limits (``None``, every default: unlimited).

    ``live_sandboxes`` counts a sandbox from its create call until its stop is
    confirmed, so a slow teardown still holds its slot. ``concurrent_execs``
    bounds the commands, uploads, downloads, agent runs and verifier runs in
    flight across all sandboxes.
    """

    live_sandboxes: int | None = None
    creates_per_second: float | None = None
    concurrent_execs: int | None = None

    def __post_init__(self) -> None:
        _check_count("live_sandboxes", self.live_sandboxes)
        _check_count("concurrent_execs", self.concurrent_execs)
        _check_positive("creates_per_second", self.creates_per_second, "a positive number or None")


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
