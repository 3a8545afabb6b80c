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
from harbor.environments.base import SandboxBuildFailedError
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from harbor_async.core.errors import (
    AgentSetupError,
    BackendError,
    BackendStartError,
    EpisodeDeadlineError,
    EpisodeInterruptedError,
    FailureClass,
    InvalidTaskError,
    LaunchError,
    ModelServerError,
    NetworkPhaseError,
    Phase,
    SandboxCancelledError,
    SandboxError,
    SettingError,
    TaskDefinitionError,
    VerifierFailure,
    is_throttle,
    throttle_in,
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
    """What an error means for its episode (Harbor's ``ErrorPolicy``: cause, retry, grade).

    Attributes:
        failure: who the episode's failure is blamed on (Harbor's ``cause``).
        retry: whether a sandbox start that failed with it is worth another attempt.
        graded: whether the episode still counts as the model's (scored, 0
            without a reward) or is left out and rerun by a resume (Harbor's
            ``grade``). A record keeps only the class, so the two must agree
            (:attr:`FailureClass.scored`): a rule that says otherwise is refused.
    """

    failure: FailureClass
    retry: bool
    graded: bool

    def __post_init__(self) -> None:
        if self.graded is not self.failure.scored:
            raise ValueError(f"a {self.failure.value} failure is {'' if self.failure.scored else 'not '}graded")


@dataclass(frozen=True)
class ErrorRow:
    """One row of :data:`ERROR_POLICY`: the errors it covers and the rule for them.

    Attributes:
        kind: the exception type(s) the row covers (a subclass's row comes before its base's).
        rule: what such an error means.
        phase: for a :class:`~harbor_async.core.errors.SandboxError`, the phase it
            happened in (``None``: any phase, or not a sandbox error).
        when: a typed predicate the error must also meet (an attribute its type
            declares, an ``errno``); never its text.
    """

    kind: type[BaseException] | tuple[type[BaseException], ...]
    rule: ErrorRule
    phase: Phase | None = None
    when: Callable[[BaseException], bool] | None = None

    def covers(self, exc: BaseException, phase: Phase | None) -> bool:
        """Whether this row decides ``exc`` (raised in ``phase``, for a sandbox error)."""
        return (
            isinstance(exc, self.kind)
            and (self.phase is None or self.phase is phase)
            and (self.when is None or self.when(exc))
        )


_CANCELLED = ErrorRule(FailureClass.CANCELLED, retry=False, graded=False)
_MODEL_SERVER = ErrorRule(FailureClass.MODEL_SERVER, retry=False, graded=False)
_VERIFIER = ErrorRule(FailureClass.VERIFIER, retry=False, graded=True)
_AGENT = ErrorRule(FailureClass.AGENT, retry=False, graded=True)
_INVALID_TASK = ErrorRule(FailureClass.INVALID_TASK, retry=False, graded=False)
_INFRA = ErrorRule(FailureClass.INFRASTRUCTURE, retry=False, graded=False)
_INFRA_RETRY = ErrorRule(FailureClass.INFRASTRUCTURE, retry=True, graded=False)

#: A start failing with one of these fails the same way again: the task, image, configuration or
#: host is wrong, or the code has a bug.
_PERMANENT: tuple[type[BaseException], ...] = (
    BackendError, SandboxBuildFailedError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError,
    ValueError, TypeError, NotImplementedError, MemoryError, LookupError, AttributeError, NameError,
    AssertionError, RecursionError, SyntaxError,
)  # fmt: skip

#: ``OSError`` numbers of a full disk or quota: the next attempt would fail the same way.
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def _says_transient(exc: BaseException) -> bool:
    """A :class:`BackendStartError` whose type says another attempt may work (its ``transient``, True by default)."""
    return bool(getattr(exc, "transient", True))


def _declared_transient(exc: BaseException) -> bool:
    """Another backend's error whose type declares ``transient = True`` (typed metadata, not its text)."""
    return getattr(exc, "transient", None) is True


def _declared_permanent(exc: BaseException) -> bool:
    """Another backend's error whose type declares ``transient = False``."""
    return getattr(exc, "transient", None) is False


def disk_full(exc: BaseException) -> bool:
    """An ``OSError`` of a full disk or quota (``ENOSPC``, ``EDQUOT``)."""
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL


#: The one error-policy table, and the only place that maps an error to a failure class, a retry and a grade:
#: :func:`rule_for` walks it in order and the first row that covers the error decides (type, and phase for
#: sandbox errors, and a typed predicate where a row has one). Types only: a backend whose library raises an
#: untyped error turns it into a typed one in its own adapter
#: (:meth:`harbor_async.backends.BackendSpec.typed_error`), never here; an outcome the engine reaches itself
#: (an interrupted episode, a harness setup that failed, a final step without a reward) is raised as one of the
#: typed errors of :mod:`harbor_async.core.errors` and comes through here too.
#:
#: Where the rows differ from Harbor's ``models/trial/error_policy.py`` (keyed by exception type name, with
#: a cause, a retry and a grade per name), on purpose:
#:
#: - Harbor retries ``AddTestsDirError`` and ``DownloadVerifierDirError`` as ``sandbox_failed`` (retried, not
#:   graded). Here a ``/tests`` or ``/logs/verifier`` the sandbox no longer has as a folder after the agent ran
#:   (:class:`~harbor_async.core.errors.VerifierPathError`, raised by the local backend; on other backends an
#:   ``AddTestsDirError`` after which the sandbox shows a file or a link there), or a verifier folder the
#:   sandbox filled past the transfer bounds or emptied, is the sandbox's own doing: the sandbox raises a
#:   :class:`~harbor_async.core.errors.VerifierFailure` for it, a failed verification scored 0 (an agent cannot void
#:   its own episode by breaking the folders). Any other failure of those transfers (an ``AddTestsDirError``
#:   while the folders are folders, or the sandbox does not answer) is the backend's: infrastructure, not graded, and not retried (a verify is never
#:   repeated behind the caller's back; a resume reruns the episode).
#: - Harbor grades model-provider errors (``MODEL_PROVIDER_FAILED``, ``grade=True`` for rate limits, server
#:   errors, bad requests) and retries the transient ones. Here a
#:   :class:`~harbor_async.core.errors.ModelServerError` is ``model_server``: not graded (the model was not
#:   judged), rerun by a resume, never retried inside the episode.
#: - Harbor retries ``SandboxBuildFailedError``; here a build that failed is not retried (it fails the same
#:   way again), and an environment the backend found wrong as written
#:   (:class:`~harbor_async.core.errors.TaskDefinitionError`) is ``invalid_task``, a category Harbor does not have.
#: - Harbor's unknown errors are ``unclassified``, retried and graded; here an unknown error is
#:   infrastructure: retried at a start, never graded.
ERROR_POLICY: tuple[ErrorRow, ...] = (
    # The task's own definition, whatever the backend (before the backends' start errors it may also be).
    ErrorRow(TaskDefinitionError, _INVALID_TASK),
    # A backend's start error: its type says whether another attempt may work (transient = True by default;
    # the permanent subclasses set it False: a missing image, a failed build, a refused container).
    ErrorRow(BackendStartError, _INFRA_RETRY, when=_says_transient),
    ErrorRow(BackendStartError, _INFRA),
    # Another backend's typed error that declares the same attribute.
    ErrorRow(BaseException, _INFRA_RETRY, when=_declared_transient),
    ErrorRow(BaseException, _INFRA, when=_declared_permanent),
    # A full disk or quota: the next attempt fails the same way.
    ErrorRow(OSError, _INFRA, when=disk_full),
    # Not errors of the episode: an interruption, an exit, a superseded start, a closed episode.
    ErrorRow((SandboxCancelledError, EpisodeInterruptedError), _CANCELLED),
    # The model's server failed: the model was not judged.
    ErrorRow(ModelServerError, _MODEL_SERVER),
    # The model's episode.
    ErrorRow(VerifierFailure, _VERIFIER),
    ErrorRow(EpisodeDeadlineError, _INFRA, phase=Phase.START),
    ErrorRow(EpisodeDeadlineError, _AGENT),
    ErrorRow(AgentSetupError, _AGENT),
    # The task cannot be built as written (its Dockerfile, a COPY source that is not there).
    ErrorRow(InvalidTaskError, _INVALID_TASK),
    ErrorRow(SandboxError, _AGENT, phase=Phase.AGENT),
    # Sandbox errors of the other phases were already retried where that was safe.
    ErrorRow(SandboxError, _INFRA),
    # The engine could not schedule the start, or apply the network policy: not worth another attempt.
    ErrorRow((LaunchError, NetworkPhaseError), _INFRA),
    # Raised by a backend while starting: permanent when the task, image, configuration or host is wrong, or
    # the code has a bug.
    ErrorRow(_PERMANENT, _INFRA),
    # Anything else from a backend: a network blip, a daemon hiccup, a slow provider.
    ErrorRow(Exception, _INFRA_RETRY),
    # Not an Exception: KeyboardInterrupt, SystemExit, a cancellation.
    ErrorRow(BaseException, _CANCELLED),
)


def rule_for(exc: BaseException) -> ErrorRule:
    """The rule of the first :data:`ERROR_POLICY` row that covers ``exc``."""
    phase = exc.phase if isinstance(exc, SandboxError) else None
    for row in ERROR_POLICY:
        if row.covers(exc, phase):
            return row.rule
    raise AssertionError("unreachable: the table ends with a BaseException row")  # pragma: no cover


def failure_class(exc: BaseException) -> FailureClass:
    """Who ``exc`` is blamed on (see :class:`~harbor_async.core.errors.FailureClass`)."""
    return rule_for(exc).failure


def is_transient(exc: BaseException) -> bool:
    """Whether a start that failed with ``exc`` is worth retrying."""
    return rule_for(exc).retry


def is_invalid_task(exc: BaseException) -> bool:
    """Whether the table blames ``exc`` on the task's own definition (``invalid_task``)."""
    return rule_for(exc).failure is FailureClass.INVALID_TASK


def is_infrastructure(exc: BaseException) -> bool:
    """Whether the table blames ``exc`` on the infrastructure (the backend, the host, a sandbox limit)."""
    return rule_for(exc).failure is FailureClass.INFRASTRUCTURE


def _stop_at(deadline: Callable[[], float]) -> Callable[[Any], bool]:
    """A tenacity stop condition: stop once the deadline has passed."""
    return lambda retry_state: anyio.current_time() >= deadline()


#: Throttled attempts one start may make (each also within the start's time budget and ``max_total``).
THROTTLED_ATTEMPTS = 32


class _AttemptsBesideThrottles(stop_base):
    """A tenacity stop: ``attempts`` failed attempts, not counting a provider's throttles (up to ``cap`` of them).

    A rate-limit or quota answer says the provider is busy, not that the start
    failed: it is retried (after the provider's ``Retry-After``, where given)
    until the start's time budget or ``cap`` throttles, whichever comes first.
    One per :meth:`RetryPolicy.retrying` call (it counts that start's throttles).
    """

    def __init__(self, attempts: int, cap: int) -> None:
        self.attempts, self.cap, self.throttles = attempts, cap, 0

    def __call__(self, retry_state: Any) -> bool:
        outcome = retry_state.outcome
        if outcome is not None and outcome.failed and is_throttle(outcome.exception()):
            self.throttles += 1
        return retry_state.attempt_number - self.throttles >= self.attempts or self.throttles >= self.cap


def _after_retry_after(wait: Callable[[Any], float]) -> Callable[[Any], float]:
    """A tenacity wait of at least the seconds a provider's throttle asked for."""

    def waited(retry_state: Any) -> float:
        outcome = retry_state.outcome
        error = outcome.exception() if outcome is not None and outcome.failed else None
        throttle = throttle_in(error) if error is not None else None
        return max(wait(retry_state), (throttle.retry_after if throttle is not None else None) or 0.0)

    return waited


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
        attempts = _AttemptsBesideThrottles(max(1, self.attempts), THROTTLED_ATTEMPTS)
        stop = attempts | _stop_at(deadline)  # type: ignore[operator]  # tenacity takes any callable stop
        if self.max_total is not None:
            stop = stop | stop_after_delay(self.max_total)
        jitter = wait_random_exponential(multiplier=self.initial_wait, max=self.max_wait)
        return AsyncRetrying(
            stop=stop,
            wait=_capped_at(deadline, _after_retry_after(jitter)),
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
    flight across all sandboxes. ``adaptive_starts`` bounds the starts in
    flight by an AIMD window below ``live_sandboxes``
    (:mod:`harbor_async.engine.start_window`): it opens while starts succeed in
    time and halves on rate-limit and quota answers and on a latency breach.
    """

    live_sandboxes: int | None = None
    creates_per_second: float | None = None
    concurrent_execs: int | None = None
    adaptive_starts: bool = True

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
