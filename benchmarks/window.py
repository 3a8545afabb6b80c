"""What one thread and CPython's collector did during a measured window.

The capacity ramp judges a size on the probe's p99; this says why a size
missed: a loop thread busy most of the window (every call queues behind the
load) or collector pauses longer than the bound (every thread waits, the GIL
held). The thread's CPU time is read from its own CPU-time clock
(``pthread_getcpuclockid``: nanoseconds, where the kernel's per-thread tick
counters would read a short window's few milliseconds as zero), the pauses
from ``gc.callbacks``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from types import TracebackType


@dataclass
class WindowUsage:
    """One window's figures."""

    seconds: float = 0.0
    #: CPU seconds the thread ran (user + system) over the window's wall seconds.
    busy: float = 0.0
    #: Garbage collections in the window (any generation, any thread), their longest pause and how many ran past the bound.
    collections: int = 0
    longest_collection_ms: float = 0.0
    collections_over_bound: int = 0


class UsageWindow:
    """``with UsageWindow(thread.ident, bound_s) as window: ...``, then ``window.usage``."""

    def __init__(self, ident: int, bound_s: float) -> None:
        self._clock = time.pthread_getcpuclockid(ident)  # the thread's CPU time, readable from any thread
        self._bound_s = bound_s
        self._began_at = 0.0
        self._cpu_at = 0.0
        self._collection_began = 0.0
        self.usage = WindowUsage()

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._collection_began = time.perf_counter()
            return
        pause = time.perf_counter() - self._collection_began
        usage = self.usage
        usage.collections += 1
        usage.longest_collection_ms = max(usage.longest_collection_ms, round(pause * 1e3, 2))
        usage.collections_over_bound += pause > self._bound_s

    def __enter__(self) -> UsageWindow:
        self._cpu_at = time.clock_gettime(self._clock)
        gc.callbacks.append(self._on_collection)
        self._began_at = time.perf_counter()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        seconds = time.perf_counter() - self._began_at
        gc.callbacks.remove(self._on_collection)
        self.usage.seconds = round(seconds, 3)
        self.usage.busy = round((time.clock_gettime(self._clock) - self._cpu_at) / seconds, 3) if seconds > 0 else 0.0
