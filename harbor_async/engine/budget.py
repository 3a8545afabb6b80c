"""Sandbox budgets: how many sandboxes may live, how fast they may be created, how many execs run.

A budget is what a sandbox asks before it exists and tells when it is gone.
:class:`LocalBudget` holds the limits of one process (the default). A cluster
budget (``budget="ray"``) leases the same three things from one actor shared
by every process on every node; both implement :class:`Budget`.
"""

from __future__ import annotations

import math
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

import anyio

from harbor_async.core.policy import Limits, RateLimiter
from harbor_async.engine.start_window import StartOutcome, StartTicket, StartWindow


@runtime_checkable
class Budget(Protocol):
    """What the engine's sandboxes ask of a budget, on the loop thread.

    ``acquire_live`` returns once ``owner`` holds one live-sandbox slot and is
    cancellable while it waits; ``release_live`` gives it back (once per
    acquire); ``begin_start`` waits for a place in the adaptive start window
    (``None``: no window) and ``end_start`` gives it back with how the attempt
    ended; ``create_turn`` waits for the create rate; ``exec_slot`` returns
    an async context holding one concurrent-exec slot; ``start_window``
    is the window's state (``None``: no window).
    """

    live_limit: int | None

    async def acquire_live(self, owner: Any) -> None: ...

    def release_live(self, owner: Any) -> None: ...

    async def begin_start(self) -> StartTicket | None: ...

    def end_start(
        self, ticket: StartTicket | None, outcome: StartOutcome, latency: float, latency_signal: bool = True
    ) -> None: ...

    def start_window(self) -> dict[str, Any] | None: ...

    async def create_turn(self) -> None: ...

    def exec_slot(self) -> AbstractAsyncContextManager[Any]: ...


#: The unlimited exec slot: one shared, stateless ``nullcontext``. A fresh one per exec lives as long as
#: the command, long enough for CPython's collector to promote it to the generation its full collections walk.
_NO_SLOT = nullcontext()


class LocalBudget:
    """The limits of one process: a capacity limiter, a start window, a rate limiter, an exec limiter.

    Create it on the loop that uses it (anyio primitives belong to one loop).
    """

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.live_limit = limits.live_sandboxes
        self._live = anyio.CapacityLimiter(limits.live_sandboxes or math.inf)
        self._rate = RateLimiter(limits.creates_per_second)
        self._starts = StartWindow(limits.live_sandboxes) if limits.adaptive_starts else None
        self._execs = anyio.CapacityLimiter(limits.concurrent_execs) if limits.concurrent_execs else None

    async def acquire_live(self, owner: Any) -> None:
        """Wait for a live slot for ``owner``."""
        await self._live.acquire_on_behalf_of(owner)

    def release_live(self, owner: Any) -> None:
        """Give ``owner``'s live slot back."""
        self._live.release_on_behalf_of(owner)

    async def begin_start(self) -> StartTicket | None:
        """Wait for a place in the start window (``None`` at once without one)."""
        return None if self._starts is None else await self._starts.acquire()

    def end_start(
        self, ticket: StartTicket | None, outcome: StartOutcome, latency: float, latency_signal: bool = True
    ) -> None:
        """Give ``ticket``'s place back; the window learns from ``outcome`` and ``latency`` (see :meth:`StartWindow.release`)."""
        if ticket is not None and self._starts is not None:
            self._starts.release(ticket, outcome, latency, latency_signal=latency_signal)

    def start_window(self) -> dict[str, Any] | None:
        """The start window's state (``None``: adaptive starts are off)."""
        return None if self._starts is None else self._starts.snapshot()

    async def create_turn(self) -> None:
        """Wait for the create rate."""
        await self._rate.wait()

    def exec_slot(self) -> AbstractAsyncContextManager[Any]:
        """An async context holding one concurrent-exec slot (a no-op when unlimited)."""
        return self._execs if self._execs is not None else _NO_SLOT
