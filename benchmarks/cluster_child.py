"""One process of the cluster benchmark: SANDBOXES simulated sandboxes held at once under the shared cap.

Usage: python -m benchmarks.cluster_child ADDRESS CAP SANDBOXES HOLD_SECONDS
Prints one JSON line: seconds until all were live, and errors.
"""

from __future__ import annotations

import json
import sys
import time

import anyio

from harbor_async.cluster import ray_budget
from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_suite


async def main(address: str, cap: int, sandboxes: int, hold: float) -> None:
    tasks = load_suite(example_suite_path()).tasks
    budget = ray_budget.factory(address=address, max_live=cap)
    errors: list[str] = []
    live = 0
    all_live = anyio.Event()
    t0 = time.perf_counter()
    seconds_to_all_live: float | None = None

    async def one(i: int) -> None:
        nonlocal live, seconds_to_all_live
        try:
            async with engine.sandbox(tasks[i % len(tasks)], "simulated"):
                live += 1
                if live == sandboxes:
                    seconds_to_all_live = time.perf_counter() - t0
                    all_live.set()
                with anyio.move_on_after(hold):
                    await all_live.wait()
                await anyio.sleep(0.5)
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    async with Engine(limits=Limits(live_sandboxes=None), budget=budget) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(sandboxes):
                tg.start_soon(one, i)
    print(
        json.dumps(
            {
                "seconds_to_all_live": seconds_to_all_live,
                "total_seconds": time.perf_counter() - t0,
                "errors": errors[:5],
                "error_count": len(errors),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
