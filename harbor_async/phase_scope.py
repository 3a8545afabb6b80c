"""One phase of a sandbox (start, exec, verify, stop...): bounded by its budget, timed, recorded and logged.

A plain class rather than ``asynccontextmanager`` around ``anyio.fail_after``:
every exec enters one on the loop thread, and the two generator-based context
managers, their generators and their frames cost about three times as much as
this (``harbor-async bench overhead`` holds one loop thread's sandboxes at
about one exec a second each). The semantics are ``fail_after``'s: a
``TimeoutError`` when the scope's deadline (as it is at exit: a renewed
episode deadline moves it) has passed and the scope caught its own
cancellation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import TracebackType
from typing import Any

import anyio

from harbor_async.errors import EpisodeDeadlineError, Phase


class PhaseScope:
    """``async with`` one phase of ``sandbox``; yields a callable returning the seconds it took so far.

    With ``wrap``, an ``Exception`` from the phase (its timeout included)
    becomes the sandbox's typed error for the phase, chained to it; without,
    it goes through as it is. A cancellation from outside is never wrapped
    and is not recorded as the phase's failure. The sandbox is typed
    loosely: this module must not import :mod:`harbor_async.sandbox`.
    """

    __slots__ = ("_begin", "_budget", "_limit", "_phase", "_sandbox", "_scope", "_wrap")

    def __init__(self, sandbox: Any, phase: Phase, budget: float | None, wrap: bool) -> None:
        self._sandbox = sandbox
        self._phase = phase
        self._budget = budget
        self._wrap = wrap
        self._limit = math.inf
        self._begin = 0.0
        self._scope: anyio.CancelScope | None = None

    def elapsed(self) -> float:
        """Seconds since the phase began."""
        return anyio.current_time() - self._begin

    async def __aenter__(self) -> Callable[[], float]:
        sandbox, phase = self._sandbox, self._phase
        limit = self._limit = sandbox._budget(phase, self._budget)
        begin = self._begin = anyio.current_time()
        if limit <= 0:
            if phase is not Phase.STOP and sandbox._deadline <= begin:
                exc: BaseException = EpisodeDeadlineError(
                    phase, sandbox.task_name, sandbox.id, "the episode deadline has passed",
                    start_attempt=max(sandbox.start_attempts, 1),
                )  # fmt: skip
            else:
                exc = TimeoutError(f"the {phase.value} budget is {limit:.3g} s")
            self._finish(exc)  # raises
        scope = self._scope = anyio.CancelScope(deadline=begin + limit, shield=phase is Phase.STOP)
        scope.__enter__()
        if phase is Phase.START:
            sandbox._start_phase = (scope, begin, self._budget)
        return self.elapsed

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self._phase is Phase.START:
            self._sandbox._start_phase = None
        scope = self._scope
        assert scope is not None
        try:
            swallowed = bool(scope.__exit__(exc_type, exc, tb))
        except BaseException as raised:  # what the scope's exit raised replaces the body's exception
            self._finish(raised)
            raise
        error = exc
        if swallowed:  # the scope caught its own cancellation: past its deadline, that is the timeout
            error = TimeoutError() if scope.cancelled_caught and anyio.current_time() >= scope.deadline else None
        self._finish(error)  # raises the typed error when it wraps
        if error is None:
            return swallowed
        if error is not exc:
            raise error
        return False

    def _finish(self, error: BaseException | None) -> None:
        """Record and log the phase; with ``wrap``, raise the typed error for an ``Exception``."""
        sandbox, phase = self._sandbox, self._phase
        if error is None:
            outcome = "ok"
        elif isinstance(error, anyio.get_cancelled_exc_class()):
            outcome = "cancelled"  # the caller gave up; not the phase's failure
        else:
            outcome = "timeout" if isinstance(error, TimeoutError) else type(error).__name__
        try:
            if error is not None and self._wrap and isinstance(error, Exception):
                raise sandbox._as_error(phase, error, budget=self._limit) from error
            if error is not None and self._scope is None:  # the phase never began: nothing else raises it
                raise error
        finally:
            seconds = anyio.current_time() - self._begin
            sandbox.times.add(phase, seconds)
            if outcome != "cancelled":
                sandbox.context.stats.record(phase.value, seconds, outcome == "ok")
            log = sandbox._log
            if outcome in ("ok", "cancelled"):
                if log.is_enabled_for("debug"):  # the exec path's event: build it only when it is kept
                    log.debug("phase", phase=phase.value, start_attempt=max(sandbox.start_attempts, 1),
                              seconds=round(seconds, 4), outcome=outcome)  # fmt: skip
            else:
                log.warning("phase", phase=phase.value, start_attempt=max(sandbox.start_attempts, 1),
                            seconds=round(seconds, 4), outcome=outcome)  # fmt: skip
