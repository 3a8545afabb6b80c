"""A process to kill -9 in the middle of a batch of sandboxes (used by the reaper tests).

    python tests/engine_child.py --backend docker --count 6 --ready 3 [--exec "sleep 600"]

Launches ``--count`` sandboxes of the bundled suite at once; as soon as
``--ready`` of them run (each then starts ``--exec`` in the background, if
given), prints one line ``READY <run label> <id>,<id>,...`` (every launched
sandbox's id) and waits forever: the others are still starting when it is killed.
"""

from __future__ import annotations

import argparse
import selectors
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import anyio

from harbor_async.core.policy import RetryPolicy, Timeouts
from harbor_async.engine.engine import Engine
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_suite


def read_ready(proc: subprocess.Popen[str], timeout: float) -> list[str]:
    """The child's ``READY <label> <ids>`` line, split (fails after ``timeout``)."""
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if selector.select(timeout=max(deadline - time.monotonic(), 0.01)):
            line = proc.stdout.readline()
            if line.startswith("READY"):
                return line.split()
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"the engine child never got ready (exit {proc.poll()})")


class Killed(NamedTuple):
    """What :func:`kill_mid_batch` saw of the killed child."""

    label: str
    ids: list[str]
    pid: int
    returncode: int


def kill_mid_batch(*args: str, timeout: float, env: dict[str, str] | None = None) -> Killed:
    """Run this script with ``args`` and SIGKILL it once it is ready."""
    proc = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    try:
        _, label, ids = read_ready(proc, timeout=timeout)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    return Killed(label, ids.split(","), proc.pid, proc.returncode)


async def main(args: argparse.Namespace) -> None:
    tasks = load_suite(example_suite_path()).tasks
    async with Engine(timeouts=Timeouts(exec=None), retry=RetryPolicy(attempts=1)) as engine:
        sandboxes = [engine.launch(tasks[i % len(tasks)], args.backend) for i in range(args.count)]
        running = 0
        enough = anyio.Event()

        async def up(sandbox) -> None:
            nonlocal running
            await sandbox.wait_started()
            if args.exec:
                engine._tg.start_soon(sandbox.exec, args.exec)
                await anyio.sleep(0.3)  # let the command start
            running += 1
            if running >= args.ready:
                enough.set()

        async with anyio.create_task_group() as tg:
            for sandbox in sandboxes:
                tg.start_soon(up, sandbox)
            await enough.wait()
            print("READY", engine.run_label, ",".join(s.id for s in sandboxes), flush=True)
            await anyio.sleep(3600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="local")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--ready", type=int, default=2)
    parser.add_argument("--exec", default="")
    anyio.run(main, parser.parse_args(sys.argv[1:]))
