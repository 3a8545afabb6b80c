"""Signals mid-batch: every finished episode's record kept, no sandbox left, exit 128 + signal."""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.cli_helpers import (
    harbor_async,
    interrupt,
    make_suite,
    records,
    spawn,
    spawn_started,
    wait_for,
)

FAST, SLOW = ["fast-a", "fast-b", "fast-c"], ["slow-a", "slow-b"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)], ids=["INT", "TERM", "HUP"]
)
def test_a_signal_mid_batch_keeps_the_finished_records_and_stops_every_sandbox(tmp_path, leak_probe, sig, code):
    suite = make_suite(tmp_path / "suite", FAST, SLOW)
    job = tmp_path / "jobs" / "j"
    proc = spawn("run", "-p", str(suite), "-o", str(tmp_path / "jobs"), "--job-name", "j", "-n", "5")
    wait_for(lambda: len(records(job)) >= 3, 120, "the three fast episodes' records")
    assert proc.poll() is None, "the batch ended before the signal: the slow tasks did not hold it"
    returncode, out, err, seconds = interrupt(proc, [sig])
    assert returncode == code, err
    assert seconds < 30, "stopping the sandboxes took too long"
    found = {r["task"]: r for r in records(job)}
    assert set(found) == set(FAST) | set(SLOW)
    assert all(found[t]["reward"] == 1.0 and found[t]["error_class"] is None for t in FAST)
    assert all(found[t]["error_class"] == "cancelled" and found[t]["reward"] is None for t in SLOW)
    assert all(found[t]["error_phase"] == "agent" for t in SLOW)  # the oracle was sleeping
    # The partial table and the resume hint; the summary says the job is incomplete.
    assert "slow-a" in out and "cancelled" in out and "fast-c" in out
    assert f"interrupted by {sig.name}" in err and f"--resume {job}" in err
    summary = json.loads((job / "summary.json").read_text())
    assert summary["complete"] is False and summary["interrupted_by"] == sig.name
    # The cancelled episodes are not judged: never a 0 in the mean, counted apart and rerun by a resume.
    assert summary["completed"] == 3 and summary["mean_reward"] == 1.0
    assert summary["not_judged"] == 2 and summary["not_judged_by_class"] == {"cancelled": 2}
    assert not leak_probe.bwrap_pids() and not leak_probe.sandbox_dirs()


@pytest.mark.slow
def test_a_second_signal_does_not_abort_the_cleanup(tmp_path):
    # Simulated sandboxes whose stop takes 2 s: the second SIGTERM comes while they stop.
    job = tmp_path / "jobs" / "j"
    proc = spawn_started(
        "run", "-e", "simulated", "--ek", "exec_latency=60", "--ek", "stop_latency=2", "-l", "3",
        "-o", str(tmp_path / "jobs"), "--job-name", "j", episodes=3,
    )  # fmt: skip  (the oracles are now running: each exec takes 60 s)
    returncode, _, err, seconds = interrupt(proc, [signal.SIGTERM, signal.SIGTERM], gap=0.5)
    assert returncode == 143, err
    assert "still stopping sandboxes" in err
    assert seconds >= 1.5, "the second signal cut the 2 s stops short"
    found = records(job)
    assert len(found) == 3 and all(r["error_class"] == "cancelled" for r in found)
    assert all(any(p["phase"] == "stop" and p["end"] - p["start"] >= 1.9 for p in r["phases"]) for r in found)


@pytest.mark.slow
def test_a_third_signal_forces_the_exit_and_names_what_is_left(tmp_path, leak_probe):
    job = tmp_path / "jobs" / "j"
    proc = spawn_started(
        "run", "-e", "simulated", "--ek", "exec_latency=60", "--ek", "stop_latency=60", "-l", "2",
        "-o", str(tmp_path / "jobs"), "--job-name", "j", episodes=2,
    )  # fmt: skip
    returncode, _, err, seconds = interrupt(proc, [signal.SIGINT, signal.SIGINT, signal.SIGINT], gap=0.5)
    assert returncode == 130, err
    assert seconds < 10, "the third signal did not force the exit"
    assert "harbor-async sandboxes reap" in err
    assert "2 sandbox(es) may be left" in err
    config = json.loads((job / "harbor-async.json").read_text())
    assert len(config["episodes"]) == 2
    # What it names is what `sandboxes reap` removes: here, the two sandboxes' trial folders.
    assert leak_probe.sandbox_dirs(), "a forced exit during the stops leaves the trial folders"
    left = re.search(r"may be left: (.+)", err).group(1).split(", ")
    labels = {sandbox.rsplit("-", 1)[0] for sandbox in left}  # a sandbox id is its run's label + a suffix
    assert len(labels) == 1  # scoped to this run: other runs' leftovers are not the test's to remove
    reaped = harbor_async("sandboxes", "reap", "--run-label", labels.pop())
    assert reaped.returncode == 0, reaped.stdout + reaped.stderr
    assert not leak_probe.sandbox_dirs()


TAKEN_ELSEWHERE = """
import signal, sys, threading, anyio
from harbor_async.core.interrupts import Interrupts
from harbor_async.engine.loop import run_loop


async def batch(interrupts: Interrupts) -> None:
    with anyio.CancelScope() as scope:
        interrupts.arm(scope.cancel)
        # What the kernel may do with a Ctrl-C: hand it to a thread that is not the main one.
        threading.Timer(0.5, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT)).start()
        await anyio.sleep(600)  # a batch whose episodes are all deep in long commands: no timer wakes the loop
        print("SLEPT", flush=True)
    print("CANCELLED" if scope.cancelled_caught else "NOT CANCELLED", flush=True)


with Interrupts() as interrupts:
    run_loop(batch, interrupts)
print(interrupts.exit_code, flush=True)
"""


@pytest.mark.uvloop_pass
def test_a_signal_another_thread_takes_still_stops_the_batch_at_once():
    """The batch's loop wakes for a signal that a worker thread took: plain asyncio slept on in its selector
    (until its next timer: here 600 s) and the Python handler, which runs on the main thread, never ran."""
    import subprocess
    import sys

    from tests.cli_helpers import REPO

    proc = subprocess.run([sys.executable, "-c", TAKEN_ELSEWHERE], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.stdout.split() == ["CANCELLED", "130"], proc.stderr[-3000:]
