"""One phase of a sandbox (start, exec, verify, stop...): bounded by its budget, timed, recorded and logged.

A plain class rather than ``asynccontextmanager`` around ``anyio.fail_after``:
every exec enters one on the loop thread, and the two generator-based context
managers, their generators and their frames cost about three times as much as
this (``harbor-async bench overhead`` holds one loop thread's sandboxes at
about one exec a second each). The semantics are ``fail_after``'s: a
``TimeoutError`` when the scope's deadline (as it is at exit: a renewed
episode deadline moves it) has passed and the scope caught its own
cancellation.

A phase with a long budget (an exec's 180 s) arms no timer of its own when it
begins: it joins a per-loop bucket of the phases whose deadlines fall in the
same :data:`ARM_AHEAD` (one second), and that bucket's one timer arms
their exact deadlines one to two seconds before them. Almost every exec ends
long before, so it never puts a timer on asyncio's heap only to cancel it
(cancelled timers stay on the heap, which asyncio rebuilds as a fresh list
once half of it is cancelled: at thousands of execs a second that churn is
what the garbage collector then walks).
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import anyio

from harbor_async.core.errors import EpisodeDeadlineError, Phase
from harbor_async.core.logs import enabled_for

#: Seconds before its deadline that a long phase's own timer is armed; shorter budgets arm theirs at once.
ARM_AHEAD = 1.0


class _DeadlineBuckets:
    """One event loop's long phases, by when their timers are due to be armed; one timer per ARM_AHEAD seconds."""

    __slots__ = ("buckets",)  # never the loop: it keys the weak mapping these sit in

    def __init__(self) -> None:
        self.buckets: dict[int, set[PhaseScope]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, phase: PhaseScope, deadline: float) -> int:
        grain = ARM_AHEAD
        key = math.floor(deadline / grain) - 1  # fires at ``key * grain``: 1 to 2 grains before the deadline
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = set()
            loop.call_at(key * grain, self._arm, key)
        bucket.add(phase)
        return key

    def discard(self, phase: PhaseScope, key: int) -> None:
        bucket = self.buckets.get(key)
        if bucket is not None:
            bucket.discard(phase)

    def _arm(self, key: int) -> None:
        for phase in self.buckets.pop(key, ()):
            phase._arm()

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self.buckets.values())


def now() -> float:
    """``anyio.current_time()``, read straight from a running asyncio loop (that is anyio's own clock there).

    anyio finds the backend (through sniffio) on every call, a fifth of an
    exec's time on the loop thread, which reads the clock four times.
    """
    loop = asyncio._get_running_loop()
    return loop.time() if loop is not None else anyio.current_time()


_buckets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _DeadlineBuckets] = weakref.WeakKeyDictionary()


def waiting_phases(loop: asyncio.AbstractEventLoop) -> int:
    """How many of ``loop``'s phases wait, with no timer of their own, for their bucket to arm it."""
    buckets = _buckets.get(loop)
    return len(buckets) if buckets is not None else 0


class PhaseScope:
    """``async with`` one phase of ``sandbox``; yields a callable returning the seconds it took so far.

    With ``wrap``, an ``Exception`` from the phase (its timeout included)
    becomes the sandbox's typed error for the phase, chained to it; without,
    it goes through as it is. A cancellation from outside is never wrapped
    and is not recorded as the phase's failure. The sandbox is typed
    loosely: this module must not import :mod:`harbor_async.engine.sandbox`.
    """

    __slots__ = ("_begin", "_budget", "_buckets", "_deadline", "_key", "_limit", "_phase", "_sandbox", "_scope", "_wrap")

    def __init__(self, sandbox: Any, phase: Phase, budget: float | None, wrap: bool) -> None:
        self._sandbox = sandbox
        self._phase = phase
        self._budget = budget
        self._wrap = wrap
        self._limit = math.inf
        self._begin = 0.0
        self._scope: anyio.CancelScope | None = None
        self._deadline = math.inf  # a long phase's deadline, before its bucket arms it on the scope
        self._buckets: _DeadlineBuckets | None = None  # the bucket it waits in: ``_buckets.buckets[_key]``
        self._key = 0

    def elapsed(self) -> float:
        """Seconds since the phase began."""
        return now() - self._begin

    # What ``async with`` yields: the scope itself (no bound method to allocate and keep per exec).
    __call__ = elapsed

    async def __aenter__(self) -> Callable[[], float]:
        sandbox, phase = self._sandbox, self._phase
        limit = self._limit = sandbox._budget(phase, self._budget)
        begin = self._begin = now()
        if limit <= 0:
            if phase is not Phase.STOP and sandbox._deadline <= begin:
                exc: BaseException | None = EpisodeDeadlineError(
                    phase, sandbox.task_name, sandbox.id, "the episode deadline has passed",
                    start_attempt=max(sandbox.start_attempts, 1),
                )  # fmt: skip
            else:
                exc = TimeoutError(f"the {phase.value} budget is {limit:.3g} s")
            try:
                self._finish(exc)  # raises
            finally:
                exc = None  # no cycle through this frame (see __aexit__)
        deadline = begin + limit
        loop = asyncio._get_running_loop() if limit > 2 * ARM_AHEAD and phase is not Phase.START else None
        if loop is None:  # a short budget, a start (its deadline can be renewed on the scope), or not asyncio
            scope = self._scope = anyio.CancelScope(deadline=deadline, shield=phase is Phase.STOP)
        else:
            scope = self._scope = anyio.CancelScope(shield=phase is Phase.STOP)
        scope.__enter__()
        if loop is not None and math.isfinite(deadline):
            buckets = _buckets.get(loop)
            if buckets is None:
                buckets = _buckets[loop] = _DeadlineBuckets()
            self._deadline = deadline
            self._key = buckets.add(loop, self, deadline)
            self._buckets = buckets
        if phase is Phase.START:
            sandbox._start_phase = (scope, begin, self._budget)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self._phase is Phase.START:
            self._sandbox._start_phase = None
        scope = self._scope
        assert scope is not None
        if self._buckets is not None:
            self._buckets.discard(self, self._key)
            self._buckets = None
        try:
            try:
                swallowed = bool(scope.__exit__(exc_type, exc, tb))
            except BaseException as raised:  # what the scope's exit raised replaces the body's exception
                self._finish(raised)
                raise
            error = exc
            if swallowed:  # the scope caught its own cancellation: past its deadline, that is the timeout
                deadline = min(scope.deadline, self._deadline)
                error = TimeoutError() if scope.cancelled_caught and now() >= deadline else None
            self._finish(error)  # raises the typed error when it wraps
            if error is None:
                return swallowed
            if error is not exc:
                raise error
            return False
        finally:
            # An exception raised through here has this frame on its traceback: were the frame to keep
            # it (or its cause) in a local, that cycle would wait for the collector, its frames with it.
            exc = error = tb = None

    def _arm(self) -> None:
        """The bucket's timer: put the exact deadline on the scope (anyio arms its timer, or cancels if past)."""
        self._buckets = None
        if self._scope is not None:
            self._scope.deadline = self._deadline

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
                typed = sandbox._as_error(phase, error, budget=self._limit)
                if typed is error:  # typed already (a nested phase's): its own cause stays, never itself
                    raise error
                raise typed from error
            if error is not None and self._scope is None:  # the phase never began: nothing else raises it
                raise error
        finally:
            seconds = now() - self._begin
            sandbox.times.add(phase, seconds)
            if outcome != "cancelled":
                sandbox.context.stats.record(phase.value, seconds, outcome == "ok")
            if outcome in ("ok", "cancelled"):
                if enabled_for("debug"):  # the exec path's event: build it (and the sandbox's logger) only when kept
                    sandbox._log.debug("phase", phase=phase.value, start_attempt=max(sandbox.start_attempts, 1),
                                       seconds=round(seconds, 4), outcome=outcome)  # fmt: skip
            else:
                sandbox._log.warning("phase", phase=phase.value, start_attempt=max(sandbox.start_attempts, 1),
                                     seconds=round(seconds, 4), outcome=outcome)  # fmt: skip
            error = typed = None  # what this raises must not be kept by its own traceback's frame (see __aexit__)
