"""Helpers of the command-line tests: run `harbor-async` in a child process, build small suites, read job folders."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from harbor_async.suites import example_suite_path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = "csv-column-sum"


def harbor_async(*args: str, env: dict | None = None, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m harbor_async ARGS`` to completion (the child inherits the test session's sandbox folders)."""
    return subprocess.run(
        [sys.executable, "-m", "harbor_async", *args],
        capture_output=True, text=True, cwd=cwd, timeout=timeout, env={**os.environ, **(env or {})},
    )  # fmt: skip


def spawn(*args: str, env: dict | None = None) -> subprocess.Popen:
    """``python -m harbor_async ARGS`` in the background, its output in pipes."""
    return subprocess.Popen(
        [sys.executable, "-m", "harbor_async", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, **(env or {})},
    )  # fmt: skip


def make_suite(root: Path, fast: list[str], slow: list[str] = (), sleep: int = 600) -> Path:
    """A suite of copies of one bundled task; the ``slow`` ones' oracle sleeps ``sleep`` s before answering."""
    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    for name in [*fast, *slow]:
        shutil.copytree(example_suite_path() / "tasks" / TEMPLATE, tasks / name)
    for name in slow:
        solve = tasks / name / "solution" / "solve.sh"
        lines = solve.read_text().splitlines(keepends=True)
        solve.write_text(lines[0] + f"sleep {sleep}\n" + "".join(lines[1:]))
    return root


def make_fast(suite: Path, names: list[str]) -> None:
    """Take the sleep out of these tasks' oracle solutions."""
    for name in names:
        solve = suite / "tasks" / name / "solution" / "solve.sh"
        solve.write_text("".join(line for line in solve.read_text().splitlines(keepends=True) if not line.startswith("sleep ")))


def records(job: Path) -> list[dict]:
    """Every line of a job folder's ``episodes.jsonl``."""
    path = job / "episodes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def spawn_started(*args: str, episodes: int, timeout: float = 120) -> subprocess.Popen:
    """:func:`spawn` with debug logs, returned once ``episodes`` sandboxes have started (their start logged ok).

    Its stderr is read by a thread from then on (:func:`interrupt` gives all of it).
    """
    proc = spawn(*args, "--log-level", "debug")
    stream, proc.stderr = proc.stderr, None  # communicate() leaves it to the reader
    lines: list[str] = []

    def read() -> None:
        for line in stream:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.stderr_lines, proc.stderr_reader = lines, reader  # type: ignore[attr-defined]

    def started() -> int:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before its sandboxes started: {''.join(lines)[-3000:]}")
        return sum("phase=start" in line and "outcome=ok" in line for line in list(lines))

    wait_for(lambda: started() >= episodes, timeout, f"{episodes} started sandboxes")
    return proc


def interrupt(proc: subprocess.Popen, signals: list[signal.Signals], gap: float = 0.3, timeout: float = 120):
    """Send ``signals`` ``gap`` seconds apart; wait for the exit; return (code, stdout, stderr, seconds to exit)."""
    for i, sig in enumerate(signals):
        if i:
            time.sleep(gap)
        if proc.poll() is None:
            proc.send_signal(sig)
    start = time.monotonic()
    out, err = proc.communicate(timeout=timeout)
    seconds = time.monotonic() - start
    reader = getattr(proc, "stderr_reader", None)
    if reader is not None:  # spawn_started's: its thread read stderr
        reader.join(timeout)
        err = "".join(proc.stderr_lines)
    return proc.returncode, out, err, seconds


#: A one-step task's task.toml with Harbor's usual budgets (tests that write their own task folders).
TASK_TOML = """schema_version = "1.4"

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 300.0
"""
