"""Engine statistics: counters and per-phase latency percentiles."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field


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
    """

    live: int
    peak_live: int
    launched: int
    started: int
    failed: int
    retried: int
    stopped: int
    stop_failures: int
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
        self.retried = 0
        self.stopped = 0
        self.stop_failures = 0
        self._seconds: dict[str, list[float]] = defaultdict(list)
        self._failures: dict[str, int] = defaultdict(int)

    def add_live(self, delta: int) -> None:
        """Count a slot taken (+1) or given back (-1)."""
        self.live += delta
        self.peak_live = max(self.peak_live, self.live)

    def record(self, phase: str, seconds: float, ok: bool) -> None:
        """Record one phase's duration and outcome."""
        self._seconds[phase].append(seconds)
        if not ok:
            self._failures[phase] += 1

    def snapshot(self) -> EngineStats:
        """An immutable copy of the counters with percentiles computed."""
        phases = {
            phase: PhaseStats(
                count=len(values),
                failures=self._failures[phase],
                p50=percentile(values, 50),
                p95=percentile(values, 95),
                p99=percentile(values, 99),
                max=max(values),
            )
            for phase, values in self._seconds.items()
            if values
        }
        return EngineStats(
            live=self.live,
            peak_live=self.peak_live,
            launched=self.launched,
            started=self.started,
            failed=self.failed,
            retried=self.retried,
            stopped=self.stopped,
            stop_failures=self.stop_failures,
            phases=phases,
        )
