"""CPython's cyclic collector, given room while engines hold many sandboxes.

Why: every live sandbox keeps a few objects in flight on the loop (an exec's
scope, the timer and future of whatever it awaits, the coroutines between).
They live for about a second, so with CPython's default young-generation
threshold (a collection every 700 net new tracked objects) each survives a
dozen young collections and is walked again by every middle one, then
promoted to the oldest generation that full collections walk. With 10,000
live sandboxes the middle generation held 90,000 such objects (each of its
collections paused every thread for 35–57 ms, every 1.5 s) and the full
collections walked 570,000 (0.3–0.5 s): the probe of ``harbor-async bench
overhead`` missed its 20 ms p99 on those pauses, not on the loop's CPU.

So while engines in this process hold sandboxes (launched and not yet
stopped, those waiting for a live slot included), the young threshold is at
least :data:`PER_SANDBOX` times their number (10,000 sandboxes: 100,000): the
in-flight objects then die before a collection walks them, and collections
come when garbage really accumulates. Nothing changes while that is below
the threshold in force (70 sandboxes under CPython 3.12's default of 700);
the older generations' thresholds are left alone, and so is a collector
switched off (a young threshold of 0). The threshold in force before the
first sandbox (a user's own setting included, or one set meanwhile by
someone else, unless it equals the one set here) comes back when the last
one is gone. ``HARBOR_ASYNC_GC_TUNING=0`` turns this off (from the next
launch or stop).
"""

from __future__ import annotations

import gc
import os
import threading

#: Young-generation threshold per live sandbox while engines hold them.
PER_SANDBOX = 10
#: ``0`` leaves CPython's thresholds alone.
ENV = "HARBOR_ASYNC_GC_TUNING"


class CollectorTuning:
    """The process's count of live sandboxes and the young threshold it warrants (engines on any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live = 0
        self._base: int | None = None  # the threshold to give back, while one of ours is in force
        self._ours: int | None = None  # the threshold this set last

    @property
    def live(self) -> int:
        """Live sandboxes counted."""
        return self._live

    def add(self) -> None:
        """Count one more live sandbox."""
        with self._lock:
            self._live += 1
            self._apply()

    def remove(self) -> None:
        """Count one fewer live sandbox."""
        with self._lock:
            self._live = max(0, self._live - 1)
            self._apply()

    def _apply(self) -> None:
        young, *older = gc.get_threshold()
        if self._ours is not None and young != self._ours:  # changed by someone else: that is the base now
            self._base, self._ours = young, None
        base = self._base if self._base is not None else young
        tuned = base != 0 and os.environ.get(ENV, "1") != "0"  # a threshold of 0: automatic collection is off
        wanted = max(base, PER_SANDBOX * self._live) if tuned else base
        if wanted != young:
            gc.set_threshold(wanted, *older)
        self._base, self._ours = (None, None) if wanted == base else (base, wanted)


#: The process's one tuning, shared by every engine.
TUNING = CollectorTuning()
