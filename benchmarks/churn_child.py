"""The churn benchmark's control: the same starts, kills and transfers, in a process of their own.

``python -m benchmarks.churn_child SECONDS WIDTH KINDS``: the machine is as busy
as under the in-process churn, but nothing of it runs on the measured loop
thread or takes its process's GIL. Prints the counts as JSON when done.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import anyio

from benchmarks.churn import churn_files, run_churners
from harbor_async.core.logs import configure_logging
from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_suite


async def main(seconds: float, width: int, kinds: tuple[str, ...]) -> dict[str, int]:
    task = load_suite(example_suite_path()).tasks[0]
    counts = {"starts": 0, "kills": 0, "transfers": 0, "errors": 0}
    with tempfile.TemporaryDirectory() as scratch:
        files = churn_files(Path(scratch))
        async with Engine(limits=Limits(live_sandboxes=None)) as engine:
            await run_churners(engine, task, files, time.monotonic() + seconds, counts, width, kinds)
    return counts


if __name__ == "__main__":
    configure_logging("error")  # its timeouts are the point: not worth a warning each
    seconds, width, kinds = float(sys.argv[1]), int(sys.argv[2]), tuple(sys.argv[3].split(","))
    print(json.dumps(anyio.run(main, seconds, width, kinds)))
