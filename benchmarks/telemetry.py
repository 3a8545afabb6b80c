"""What resource telemetry costs per episode: throughput with it on and off, and the reading's own time.

Each round runs the same episodes (start, one command, verify, stop) twice on
a real backend, once with ``resource_telemetry`` on and once off (the order
alternates), and reports the ratio of their episodes per second. The reading's
own latency comes from the engine's stats (the ``usage`` phase: the time from
asking the backend to its answer, at each stop), so the cost per episode is
measured directly as well as through the throughput, which this noisy machine
blurs by a few percent.
"""

from __future__ import annotations

import statistics
from typing import Any

import anyio


def run_telemetry(env: str, *, repeats: int = 3, episodes: int = 48, concurrency: int = 8) -> dict[str, Any]:
    """``repeats`` rounds of on/off on backend ``env``; ratios are telemetry-on over off episodes per second."""
    from benchmarks.throughput import run_throughput

    rounds: list[dict[str, Any]] = []
    for repeat in range(repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)
        result: dict[bool, Any] = {}
        for on in order:
            result[on] = anyio.run(
                lambda o=on: run_throughput(
                    episodes=episodes, concurrency=concurrency, backend=env, sample_memory=False, floor_samples=0,
                    resource_telemetry=o,
                )  # fmt: skip
            )
        usage = result[True].phases.get("usage", {})
        rounds.append({
            "on_eps": result[True].episodes_per_second,
            "off_eps": result[False].episodes_per_second,
            "ratio": round(result[True].episodes_per_second / result[False].episodes_per_second, 4),
            "reading_p50_ms": round(usage.get("p50", 0.0) * 1e3, 3),
            "reading_p99_ms": round(usage.get("p99", 0.0) * 1e3, 3),
            "readings": usage.get("count", 0),
            "readings_off": result[False].phases.get("usage", {}).get("count", 0),  # 0: off reads nothing
            "stop_p50_on_ms": round(result[True].phases["stop"]["p50"] * 1e3, 3),
            "stop_p50_off_ms": round(result[False].phases["stop"]["p50"] * 1e3, 3),
            "failures": result[True].failures + result[False].failures,
        })  # fmt: skip
    summary = {
        "ratio_median": statistics.median(r["ratio"] for r in rounds),
        "ratio_min": min(r["ratio"] for r in rounds),
        "ratio_max": max(r["ratio"] for r in rounds),
        "reading_p50_ms_median": statistics.median(r["reading_p50_ms"] for r in rounds),
        "reading_p99_ms_median": statistics.median(r["reading_p99_ms"] for r in rounds),
        "stop_p50_added_ms_median": statistics.median(r["stop_p50_on_ms"] - r["stop_p50_off_ms"] for r in rounds),
    }
    return {
        "env": env, "episodes": episodes, "concurrency": concurrency, "repeats": repeats,
        "rounds": rounds, "summary": summary,
    }  # fmt: skip
