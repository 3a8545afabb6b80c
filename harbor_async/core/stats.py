"""Engine statistics: counters and per-phase latency percentiles.

Latencies go into one quantile sketch per phase (DataDog's DDSketch, with a
collapsing store of at most :data:`SKETCH_BINS` bins at 1 % relative accuracy):
memory per phase and the time of a snapshot stay constant however many
samples a long training run records.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from ddsketch import LogCollapsingLowestDenseDDSketch

from harbor_async.core.usage import ResourceUsage

#: Relative accuracy of the latency percentiles.
SKETCH_ACCURACY = 0.01
#: Bins a sketch keeps at most (its memory bound); the lowest collapse first.
SKETCH_BINS = 1024


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated; 0.0 when empty."""
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]


@dataclass(frozen=True)
class PhaseStats:
    """Latency summary of one phase, in seconds."""

    count: int
    failures: int
    p50: float
    p95: float
    p99: float
    max: float


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's counters.

    ``live`` counts sandboxes holding a slot (from the create call until the
    stop is confirmed); ``peak_live`` is its highest value so far.
    ``sandbox_seconds`` and ``cpu_seconds`` add up what the stopped sandboxes
    used; ``memory_peak_bytes`` is the highest peak of any of them
    (:mod:`harbor_async.core.usage`).
    """

    live: int
    peak_live: int
    launched: int
    started: int
    failed: int
    cancelled: int
    retried: int
    stopped: int
    stop_failures: int
    throttled: int = 0
    start_window: dict[str, Any] | None = None
    sandbox_seconds: float = 0.0
    cpu_seconds: float = 0.0
    memory_peak_bytes: int = 0
    phases: dict[str, PhaseStats] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)


class StatsRecorder:
    """Mutable counters behind :class:`EngineStats`; used on the loop only."""

    def __init__(self) -> None:
        self.live = 0
        self.peak_live = 0
        self.launched = 0
        self.started = 0
        self.failed = 0
        self.cancelled = 0
        self.retried = 0
        self.stopped = 0
        self.stop_failures = 0
        self.throttled = 0  # start attempts answered with a rate limit or a quota
        self.sandbox_seconds = 0.0
        self.cpu_seconds = 0.0
        self.memory_peak_bytes = 0
        self._sketches: dict[str, LogCollapsingLowestDenseDDSketch] = {}
        self._max: dict[str, float] = defaultdict(float)
        self._failures: dict[str, int] = defaultdict(int)

    def add_live(self, delta: int) -> None:
        """Count a slot taken (+1) or given back (-1)."""
        self.live += delta
        self.peak_live = max(self.peak_live, self.live)

    def add_usage(self, sandbox_seconds: float, usage: ResourceUsage | None) -> None:
        """Count what one stopped sandbox used."""
        self.sandbox_seconds += sandbox_seconds
        if usage is not None:
            self.cpu_seconds += usage.cpu_seconds or 0.0
            self.memory_peak_bytes = max(self.memory_peak_bytes, usage.memory_peak_bytes or 0)

    def record(self, phase: str, seconds: float, ok: bool) -> None:
        """Record one phase's duration and outcome."""
        sketch = self._sketches.get(phase)
        if sketch is None:
            sketch = self._sketches[phase] = LogCollapsingLowestDenseDDSketch(SKETCH_ACCURACY, bin_limit=SKETCH_BINS)
        sketch.add(max(seconds, 0.0))
        self._max[phase] = max(self._max[phase], seconds)
        if not ok:
            self._failures[phase] += 1

    def snapshot(self, start_window: dict[str, Any] | None = None) -> EngineStats:
        """An immutable copy of the counters with percentiles computed (and the budget's start window)."""
        phases = {
            phase: PhaseStats(
                count=int(sketch.count),
                failures=self._failures[phase],
                p50=_quantile(sketch, 0.50),
                p95=_quantile(sketch, 0.95),
                p99=_quantile(sketch, 0.99),
                max=self._max[phase],
            )
            for phase, sketch in self._sketches.items()
            if sketch.count
        }
        return EngineStats(
            live=self.live,
            peak_live=self.peak_live,
            launched=self.launched,
            started=self.started,
            failed=self.failed,
            cancelled=self.cancelled,
            retried=self.retried,
            stopped=self.stopped,
            stop_failures=self.stop_failures,
            throttled=self.throttled,
            start_window=start_window,
            sandbox_seconds=self.sandbox_seconds,
            cpu_seconds=self.cpu_seconds,
            memory_peak_bytes=self.memory_peak_bytes,
            phases=phases,
        )


def _quantile(sketch: LogCollapsingLowestDenseDDSketch, q: float) -> float:
    value = sketch.get_quantile_value(q)
    return float(value) if value is not None else 0.0
