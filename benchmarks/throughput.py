"""Sandbox throughput: N episodes (start, exec, verify, stop) at concurrency C on one backend.

Reports episodes per second, per-phase latency percentiles from the engine's
stats, the peak number of live sandboxes, and the peak memory per live sandbox
(resident memory of this process's growth plus every process it spawned, plus
Docker containers of this run, divided by the sandboxes live at that moment).

On the local backend it also measures the floor in the same run: the same
``bwrap`` binary making the same kinds of namespaces (user, PID, mount, IPC,
UTS, network, cgroup) around the host's root and running ``true``
(:data:`FLOOR_ARGS`), and reports its p50 and the ratio of the start p50 to it;
at a concurrency above 1, also with that many bare bwraps at once (a start at
concurrency 8 on two cores waits for CPU, and so does a bare bwrap).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from harbor_async.tasks.suite import load_suite


@dataclass
class ThroughputResult:
    """One throughput run's figures."""

    backend: str
    episodes: int
    concurrency: int
    seconds: float
    episodes_per_second: float
    failures: int
    peak_live: int
    peak_memory_per_sandbox_mib: float | None
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    #: p50 of a bare ``bwrap ... true`` in the same run, ms (local backend only; None elsewhere or without bwrap)
    bwrap_floor_p50_ms: float | None = None
    #: start p50 / that floor
    start_over_floor: float | None = None
    #: the floor's command line
    bwrap_floor_argv: list[str] | None = None
    #: p50 of the same bare ``bwrap`` with ``concurrency`` of them running at once, ms (None at concurrency 1)
    bwrap_floor_concurrent_p50_ms: float | None = None
    #: start p50 / that floor: the start against bubblewrap's own cost on a machine as busy
    start_over_concurrent_floor: float | None = None

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)


#: The floor: bubblewrap's own cost of a sandbox (the namespaces the local backend makes, the
#: host's root read-only, /proc and /dev) with nothing of ours around it, running ``true``.
FLOOR_ARGS = (
    "--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0",
    "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true",
)  # fmt: skip


def bwrap_floor(samples: int = 30, concurrency: int = 1) -> tuple[float, list[str]] | None:
    """The p50 (ms) of ``bwrap FLOOR_ARGS`` runs, and the argv; None without bwrap (or if it fails).

    ``concurrency`` threads each time ``samples`` runs back to back, so that
    ``concurrency`` bwraps run at once, as the episodes' starts do.
    """
    binary = shutil.which("bwrap")  # the one the local backend runs (keeper.find_tools)
    if binary is None:
        return None
    argv = [binary, *FLOOR_ARGS]

    def series() -> list[float] | None:
        times = []
        for _ in range(samples):
            begin = time.perf_counter()
            if subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True).returncode != 0:
                return None
            times.append(time.perf_counter() - begin)
        return times

    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda _: series(), range(concurrency)))
    if any(times is None for times in runs):
        return None
    return statistics.median(t for times in runs for t in times or ()) * 1e3, argv


def _docker_memory_mib(run_label: str) -> float:
    """Memory used by this run's containers (0 when Docker is absent)."""
    try:
        out = subprocess.run(
            ["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0.0
    total = 0.0
    units = {"B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
    for line in out.splitlines():
        name, _, usage = line.partition(" ")
        if run_label.lower() not in name.lower():
            continue
        used = usage.split("/")[0].strip()
        for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
            if used.endswith(unit):
                total += float(used[: -len(unit)]) * factor
                break
    return total


class MemorySampler:
    """Samples memory while sandboxes are live; keeps the largest per-sandbox figure."""

    def __init__(self, engine: Engine, backend: str) -> None:
        import psutil

        self._psutil = psutil
        self._engine = engine
        self._docker = backend == "docker"
        self._me = psutil.Process()
        self._baseline = self._me.memory_info().rss
        self.per_sandbox_mib: float | None = None

    def _sample(self) -> tuple[int, float]:
        live = len(self._engine.live_sandboxes())
        rss = max(0, self._me.memory_info().rss - self._baseline)
        for child in self._me.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except self._psutil.Error:  # it ended while we looked
                pass
        mib = rss / 2**20
        if self._docker:
            mib += _docker_memory_mib(self._engine.run_label)
        return live, mib

    async def run(self, interval: float = 0.1) -> None:
        """Sample until cancelled."""
        while True:
            live, mib = await anyio.to_thread.run_sync(self._sample)
            if live:
                figure = mib / live
                self.per_sandbox_mib = max(self.per_sandbox_mib or 0.0, figure)
            await anyio.sleep(interval)


async def run_throughput(
    *,
    episodes: int = 64,
    concurrency: int = 16,
    backend: str = "local",
    suite: str | None = None,
    command: str = "echo hello",
    backend_kwargs: dict[str, Any] | None = None,
    sample_memory: bool = True,
    floor_samples: int = 30,
    adaptive_starts: bool = True,
    resource_telemetry: bool = True,
) -> ThroughputResult:
    """Run ``episodes`` episodes, ``concurrency`` at a time, and measure them (and, on local, the bwrap floor)."""
    tasks = load_suite(suite).tasks
    failures = 0
    limits = Limits(live_sandboxes=concurrency, adaptive_starts=adaptive_starts)
    async with Engine(limits=limits, backend_kwargs=backend_kwargs, resource_telemetry=resource_telemetry) as engine:
        # One episode first, so lazy imports and caches do not count as sandbox memory.
        async with engine.sandbox(tasks[0], backend) as sandbox:
            await sandbox.exec(command)
            await sandbox.verify()
        sampler = MemorySampler(engine, backend)
        limiter = anyio.CapacityLimiter(concurrency)

        async def episode(i: int) -> None:
            nonlocal failures
            async with limiter:
                try:
                    async with engine.sandbox(tasks[i % len(tasks)], backend) as sandbox:
                        await sandbox.exec(command)
                        await sandbox.verify()
                except Exception:  # counted; the benchmark measures the rest
                    failures += 1

        begin = anyio.current_time()
        async with anyio.create_task_group() as outer:
            if sample_memory:
                outer.start_soon(sampler.run)
            async with anyio.create_task_group() as tg:
                for i in range(episodes):
                    tg.start_soon(episode, i)
            outer.cancel_scope.cancel()
        seconds = anyio.current_time() - begin
        stats = engine.stats()
    # After the episodes (no sandbox of ours competes with it), in the same run and machine state.
    floor = concurrent = None
    if floor_samples and _is_local(backend):
        floor = await anyio.to_thread.run_sync(bwrap_floor, floor_samples)
        if concurrency > 1:
            concurrent = await anyio.to_thread.run_sync(bwrap_floor, floor_samples, concurrency)
    start = stats.phases.get("start")
    # Ratios from the floors as written: a reader dividing the file's own figures gets its ratios.
    floor_ms = round(floor[0], 3) if floor else None
    concurrent_ms = round(concurrent[0], 3) if concurrent else None
    # The warm-up episode is in the engine's counters; the rate and failures are not.
    return ThroughputResult(
        backend=backend,
        episodes=episodes,
        concurrency=concurrency,
        seconds=round(seconds, 4),
        episodes_per_second=round(episodes / seconds, 3),
        failures=failures,
        peak_live=stats.peak_live,
        peak_memory_per_sandbox_mib=(
            round(sampler.per_sandbox_mib, 2) if sampler.per_sandbox_mib is not None else None
        ),
        phases={
            name: {"p50": p.p50, "p95": p.p95, "p99": p.p99, "count": p.count}
            for name, p in stats.phases.items()
        },
        bwrap_floor_p50_ms=floor_ms,
        start_over_floor=round(start.p50 * 1e3 / floor_ms, 2) if floor_ms and start is not None else None,
        bwrap_floor_argv=floor[1] if floor else None,
        bwrap_floor_concurrent_p50_ms=concurrent_ms,
        start_over_concurrent_floor=(
            round(start.p50 * 1e3 / concurrent_ms, 2) if concurrent_ms and start is not None else None
        ),
    )


def _is_local(backend: str) -> bool:
    from harbor_async.backends import resolve_backend

    return resolve_backend(backend).import_path == "harbor_async.backends.local:LocalEnvironment"
