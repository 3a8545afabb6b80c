"""The adaptive start window: how many sandbox starts may be in flight at once.

Cloud providers answer a burst of creates with 429s, quota errors or a
growing start latency. The window works as TCP's congestion window does (an
AIMD limiter): it opens while starts succeed within their latency target
(one more start per success below the slow-start threshold, one more per
window's worth of successes above it) and halves on a throttle: a rate-limit
answer, a quota answer, or a *latency breach*.

- **Latency target:** ``latency_factor`` (3) times the uncongested start
  latency, which is the lowest median of any block of ``block`` (16)
  consecutive successful starts so far (TCP Vegas' "base RTT", made robust to
  a heavy tail by taking blocks' medians).
- **Latency breach:** a block whose median exceeds the target. A single slow
  start (the heavy tail every provider has) is no signal; a block of them is
  a queue building at the provider.

A quota answer halves the window as a rate limit does, but keeps the
slow-start threshold: a quota counts live sandboxes, not creates per second,
so the window grows back by one per success as soon as stops free places,
where after a rate limit it grows by one per window's worth (on a quota-bound
profile, halving the threshold too cost 22% of the goodput against fixed
starts: docs/benchmarks.md).

One decrease per round trip: a throttle seen by a start that began before the
last decrease does not decrease again (the burst it belonged to was already
answered). The window never exceeds ``ceiling`` (the static limits: live
sandboxes, or none). Below 1 (down to 1/16) it paces: one start at a time,
each beginning a smoothed start latency divided by the window after the one
before, so that a provider whose create rate is below one start per start
latency (E2B's Hobby plan: 1 per second) is still met; it grows back by 1/16
per success to 1. Other start failures (a crashed
daemon, a provider's 503) neither open nor close it: the retry policy owns
them.

Everything runs on one event loop (the engine's, or the cluster budget
actor's); an injected ``clock`` makes it testable without sleeping.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import anyio

#: The first window: starts in flight before any has succeeded.
INITIAL_WINDOW = 8
#: Successful starts per latency block.
LATENCY_BLOCK = 16
#: The latency target as a multiple of the uncongested median.
LATENCY_FACTOR = 3.0
#: The share of the window kept on a throttle.
DECREASE = 0.5
#: The smallest window: below 1, starts go one at a time, paced (see :class:`StartWindow`).
MIN_WINDOW = 1 / 16
#: The weight of a new start latency in the smoothed one that paces starts below a window of 1.
LATENCY_WEIGHT = 1 / 8


class StartOutcome(Enum):
    """How one start attempt ended, as the window reads it."""

    OK = "ok"
    THROTTLED = "throttled"  # a rate-limit answer
    QUOTA = "quota"  # a quota answer: the provider's live sandboxes, not its create rate
    FAILED = "failed"  # anything else: no signal about the provider's load


@dataclass
class StartTicket:
    """One start attempt's place in the window (from :meth:`StartWindow.acquire`)."""

    began: float
    epoch: int
    window: int
    key: str | None = None  # the cluster budget's name for it


class StartWindow:
    """An AIMD limit on the starts in flight (see the module's docstring).

    Args:
        ceiling: the most starts in flight ever (``None``: no static limit).
        initial: the window before the first success.
        latency_factor: the latency target over the uncongested median.
        block: successful starts per latency block.
        clock: the time source (default: the running loop's ``anyio.current_time``).
    """

    def __init__(
        self,
        ceiling: int | None = None,
        *,
        initial: int = INITIAL_WINDOW,
        latency_factor: float = LATENCY_FACTOR,
        block: int = LATENCY_BLOCK,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if initial < 1 or block < 1 or latency_factor <= 1:
            raise ValueError("initial and block must be >= 1, latency_factor > 1")
        self._cap = math.inf if ceiling is None else float(ceiling)
        self._window = min(float(initial), self._cap)
        self._threshold = self._cap  # slow start until the first throttle
        self._factor = latency_factor
        self._clock = clock or anyio.current_time
        self._block: list[float] = []
        self._block_size = block
        self._baseline: float | None = None
        self._epoch = 0
        self.in_flight = 0
        self.throttles = 0
        self.breaches = 0
        self.peak = int(self._window)
        self._waiters: deque[anyio.Event] = deque()
        self._latency: float | None = None  # smoothed successful start latency (s)
        self._next_start = -math.inf  # when paced: the earliest the next start may begin

    @property
    def window(self) -> int:
        """The starts allowed in flight now."""
        return max(1, int(self._window))

    @property
    def latency_target(self) -> float | None:
        """Seconds a start may take before its block counts as a breach (``None``: no block yet)."""
        return None if self._baseline is None else self._baseline * self._factor

    async def acquire(self) -> StartTicket:
        """Wait until a start may begin (first come, first served; cancellable)."""
        if self.in_flight >= self.window or self._waiters:
            event = anyio.Event()
            self._waiters.append(event)
            try:
                await event.wait()
            except BaseException:
                if event in self._waiters:
                    self._waiters.remove(event)
                elif event.is_set():  # woken, then cancelled: pass the turn on
                    self.in_flight -= 1
                    self._wake()
                raise
        else:
            self.in_flight += 1
        try:
            await self._pace()
        except BaseException:
            self.in_flight -= 1
            self._wake()
            raise
        return StartTicket(self._clock(), self._epoch, self.window)

    async def _pace(self) -> None:
        """Below a window of 1: wait until a smoothed latency divided by the window has passed since the last start."""
        if self._window >= 1.0 or self._latency is None:
            return
        now = self._clock()
        begin = max(now, self._next_start)
        self._next_start = begin + self._latency / self._window
        if begin > now:
            await anyio.sleep(begin - now)

    def release(
        self, ticket: StartTicket, outcome: StartOutcome, latency: float | None = None, *, latency_signal: bool = True
    ) -> None:
        """End ``ticket``'s start with ``outcome``; the window opens or closes by it.

        ``latency``: the start's own seconds, where the caller measured them
        (past its create turn); by default the time since :meth:`acquire`.
        ``latency_signal=False``: the latency says nothing about a provider's
        queue (a sandbox on this machine, slower as the machine is busier, which
        fewer starts at once would not make faster): it paces, never breaches.
        """
        self.in_flight -= 1
        if outcome is StartOutcome.OK:
            self._on_success(self._clock() - ticket.began if latency is None else latency, latency_signal)
        elif outcome in (StartOutcome.THROTTLED, StartOutcome.QUOTA):
            self.throttles += 1
            self._decrease(ticket, slow_start=outcome is StartOutcome.QUOTA)
        self._wake()

    def _on_success(self, latency: float, signal: bool) -> None:
        self._latency = latency if self._latency is None else self._latency + LATENCY_WEIGHT * (latency - self._latency)
        if signal:
            self._block.append(latency)
        if signal and len(self._block) >= self._block_size:
            median = statistics.median(self._block)
            self._block.clear()
            if self._baseline is None or median < self._baseline:
                self._baseline = median
            elif median > self._baseline * self._factor:
                self.breaches += 1
                self._decrease(None)
                return
        if self._window < 1.0:
            self._window += MIN_WINDOW  # paced: back to one at a time in 1/16 steps
        elif self._window < self._threshold:
            self._window += 1.0
        else:
            self._window += 1.0 / self._window
        self._window = min(self._window, self._cap)
        self.peak = max(self.peak, self.window)

    def _decrease(self, ticket: StartTicket | None, *, slow_start: bool = False) -> None:
        """Halve the window; ``slow_start`` (a quota answer): keep the threshold, so it grows back by one per success."""
        if ticket is not None and ticket.epoch < self._epoch:
            return  # that burst was answered already
        self._epoch += 1
        self._window = max(MIN_WINDOW, self._window * DECREASE)
        if not slow_start:
            self._threshold = self._window

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.window:
            self.in_flight += 1
            self._waiters.popleft().set()

    def snapshot(self) -> dict[str, float | int | None]:
        """The window's state for records, metrics and benchmarks."""
        return {
            "window": self.window,
            "paced_rate": None if self._window >= 1.0 or not self._latency else round(self._window / self._latency, 4),
            "in_flight": self.in_flight,
            "peak": self.peak,
            "throttles": self.throttles,
            "latency_breaches": self.breaches,
            "latency_target_s": self.latency_target,
        }

