"""Benchmark of the cluster budget: leases per second through the actor, the latency it adds to a
start, and 1,000 concurrent simulated sandboxes across 4 processes under one cap.

Usage: python -m benchmarks.cluster [--address ADDR] [--out benchmarks/results/cluster.json]

Without ``--address`` it starts a private local Ray instance (and ends it).
Writes one JSON file; see the README section "Past one machine".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# The private local instance needs no token (Ray would otherwise write one to ~/.ray);
# against a real cluster, set RAY_AUTH_MODE as that cluster requires.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import anyio

from benchmarks.provenance import begin, stamp
from harbor_async.cluster import ray_budget
from harbor_async.cluster.budget_actor import Caps, get_or_create
from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_suite

REPO = Path(__file__).resolve().parents[1]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def lease_latency(address: str, n: int = 1000) -> dict:
    """Sequential acquire+release of one live slot: the round trip a start pays."""
    budget = ray_budget.factory(address=address, max_live=10_000, name="bench-leases")(Limits(live_sandboxes=None))
    owners = [object() for _ in range(n)]
    times = []
    for owner in owners:
        t0 = time.perf_counter()
        await budget.acquire_live(owner)
        times.append((time.perf_counter() - t0) * 1000)
        budget.release_live(owner)
    budget.close()
    return {"n": n, "acquire_ms_p50": round(_pct(times, 0.5), 3), "acquire_ms_p95": round(_pct(times, 0.95), 3)}


async def lease_throughput(address: str, seconds: float = 5.0, tasks: int = 64) -> dict:
    """Leases granted per second with ``tasks`` concurrent acquire/release loops in one process."""
    budget = ray_budget.factory(address=address, max_live=10_000, name="bench-throughput")(Limits(live_sandboxes=None))
    count = 0
    stop_at = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal count
        while time.perf_counter() < stop_at:
            owner = object()
            await budget.acquire_live(owner)
            budget.release_live(owner)
            count += 1

    async with anyio.create_task_group() as tg:
        for _ in range(tasks):
            tg.start_soon(loop)
    budget.close()
    return {"concurrent_loops": tasks, "seconds": seconds, "leases_per_second": round(count / seconds, 1)}


async def start_latency(address: str | None, n: int = 200) -> list[float]:
    """Milliseconds from launch to started for ``n`` sequential simulated sandboxes (no backend latency)."""
    task = load_suite(example_suite_path()).tasks[0]
    factory = ray_budget.factory(address=address, max_live=10_000, name="bench-starts") if address else None
    times = []
    async with Engine(limits=Limits(live_sandboxes=None), budget=factory) as engine:
        for _ in range(n):
            t0 = time.perf_counter()
            sandbox = engine.launch(task, "simulated")
            await sandbox.wait_started()
            times.append((time.perf_counter() - t0) * 1000)
            await sandbox.stop()
    return times


def many_processes(
    address: str, processes: int = 4, per_process: int = 250, hold: float = 20.0, cap: int | None = None
) -> dict:
    """``processes`` processes each asking for ``per_process`` simulated sandboxes at once, under one cap
    (default: exactly what they ask for together; a smaller cap shows it holds)."""
    import ray

    cap = cap or processes * per_process
    actor = get_or_create(Caps(max_live=cap), address=address)
    ray.get(actor.reset_peaks.remote())
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.cluster_child", address, str(cap), str(per_process), str(hold)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
        )  # fmt: skip
        for _ in range(processes)
    ]
    results = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    stats = ray.get(actor.stats.remote())
    ray.kill(actor)
    return {
        "processes": processes,
        "sandboxes_per_process": per_process,
        "cap": cap,
        "peak_live_at_actor": stats["live_peak"],
        "live_after": stats["live_used"],
        "seconds_until_all_live_per_process": [round(r["seconds_to_all_live"] or -1, 2) for r in results],
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "errors": sum(r["error_count"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cluster.json")
    parser.add_argument("--per-process", type=int, default=250)
    args = parser.parse_args()
    begin()
    import ray

    if args.address is None:
        ray.init(num_cpus=2, include_dashboard=False, namespace="harbor-async", log_to_driver=False)
        address = ray.get_runtime_context().gcs_address
    else:
        ray.init(address=args.address, namespace="harbor-async", log_to_driver=False)
        address = args.address
    try:
        result: dict = {"ray": ray.__version__}
        result["lease_latency"] = anyio.run(lease_latency, address)
        result["lease_throughput"] = anyio.run(lease_throughput, address)
        local = anyio.run(start_latency, None)
        cluster = anyio.run(start_latency, address)
        result["start_latency_ms"] = {
            "local_budget_p50": round(statistics.median(local), 3),
            "ray_budget_p50": round(statistics.median(cluster), 3),
            "added_p50": round(statistics.median(cluster) - statistics.median(local), 3),
            "ray_budget_p95": round(_pct(cluster, 0.95), 3),
        }
        result["many_processes"] = many_processes(address, per_process=args.per_process)
        result["many_processes_cap_below_demand"] = many_processes(
            address, per_process=args.per_process, cap=args.per_process * 4 * 3 // 5, hold=3.0
        )
        for name in ("bench-leases", "bench-throughput", "bench-starts"):
            try:
                ray.kill(ray.get_actor(name, namespace="harbor-async"))
            except ValueError:
                pass
    finally:
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = stamp("cluster", result)  # the provenance's load after is read here, once the run is over
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
