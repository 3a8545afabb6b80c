"""One process of the cluster budget tests: an engine leasing from the Ray budget actor.

Usage: python -m tests.cluster_child ADDRESS CAP EPISODES HOLD_SECONDS [LEASE_TIMEOUT] [BATCH]

Runs EPISODES episodes at once on the counting backend (each holds its
sandbox for HOLD_SECONDS) and prints one JSON line with what it saw. Prints
``started N`` lines as sandboxes start, so a test can kill it mid-run.
"""

from __future__ import annotations

import json
import os
import sys

import anyio

from harbor_async.cluster import ray_budget
from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_suite

BACKEND = "tests.cluster_backend:CountingEnvironment"


async def main(address: str, cap: int, episodes: int, hold: float, lease_timeout: float, batch: int | None) -> None:
    tasks = load_suite(example_suite_path()).tasks
    budget = ray_budget.factory(address=address, max_live=cap, lease_timeout=lease_timeout, batch=batch)
    started = 0
    errors: list[str] = []
    # HARA_BARRIER=1: every episode holds its sandbox until all of this process's
    # sandboxes are live at once, as a GRPO batch needs (the deadlock test).
    all_live = anyio.Event()
    barrier = os.environ.get("HARA_BARRIER") == "1"

    async def one(i: int) -> None:
        nonlocal started
        try:
            async with engine.sandbox(tasks[i % len(tasks)], BACKEND) as sandbox:
                started += 1
                print(f"started {started} {sandbox.id}", flush=True)
                if started == episodes:
                    all_live.set()
                if barrier:
                    await all_live.wait()
                await anyio.sleep(hold)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(exc).__name__}: {exc}")

    async with Engine(limits=Limits(live_sandboxes=None), budget=budget) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(episodes):
                tg.start_soon(one, i)
    print(json.dumps({"started": started, "errors": errors}), flush=True)


if __name__ == "__main__":
    address, cap, episodes, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    lease_timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 8.0
    batch = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "none" else None
    anyio.run(main, address, cap, episodes, hold, lease_timeout, batch)
