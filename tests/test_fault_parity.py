"""The same fault through `run`, `eval` and the shim gives the same record (class, reward, judged).

The cluster worker's side of the same comparison is in tests/test_cluster_sharding.py (its Ray
cluster is shared by that module). Faults are injected by the simulated backend; the agent is
the oracle (`run`), the scripted server's solver (`eval`) and a `bash` tool call (the shim).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harbor_async.jobs import JobFolder
from harbor_async.records import EpisodeRecord
from harbor_async.suites import example_suite_path
from harbor_async.tasks import load_suite

REPO = Path(__file__).resolve().parent.parent
TASK = load_suite(example_suite_path()).tasks[0]

#: fault name -> (the simulated backend's options, timeout settings, the outcome every entry point must record)
FAULTS: dict[str, tuple[dict[str, Any], dict[str, float], tuple[str | None, float | None, bool]]] = {
    "start fails for good": ({"start_permanent_failure_rate": 1.0}, {}, ("infrastructure", None, False)),
    "verifier fails": ({"verify_failure_rate": 1.0}, {}, ("verifier", 0.0, True)),
    "verifier times out": ({"verify_latency": 30.0}, {"verifier_timeout_multiplier": 0.01}, ("verifier", 0.0, True)),
    "no fault": ({}, {}, (None, 1.0, True)),
}


def outcome(record: EpisodeRecord) -> tuple[str | None, float | None, bool]:
    """What the comparison is about: who is blamed, the reward, and whether the model was judged."""
    return record.error_class, record.reward, record.judged


def run_record(tmp_path: Path, backend: dict[str, Any], timeouts: dict[str, float], *extra: str) -> EpisodeRecord:
    """The record `harbor-async run` writes for the fault (oracle agent, one task)."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in timeouts.items()]
    ek = [f"--ek={key}={value}" for key, value in backend.items()]
    done = subprocess.run(
        [sys.executable, "-m", "harbor_async", "run", "-p", str(example_suite_path()), "-i", TASK.name, "-e",
         "simulated", *ek, *flags, "-o", str(tmp_path), "--job-name", "run", "-q", *extra],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr[-2000:]
    (record,) = JobFolder.open(tmp_path / "run").records()
    return record


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_gives_one_record_through_run_eval_and_the_shim(fault: str, tmp_path: Path) -> None:
    import shim
    from harbor_async.evaluation import evaluate_sync
    from tests.scripted_server import ScriptedServer

    backend, timeouts, expected = FAULTS[fault]
    records = {"run": run_record(tmp_path, backend, timeouts)}

    with ScriptedServer() as server:
        result = evaluate_sync(
            ["solver"], str(example_suite_path()), base_url=server.base_url, jobs_dir=tmp_path, job_name="eval",
            include=[TASK.name], environment_type="simulated", environment_kwargs=backend, **timeouts,
        )  # fmt: skip
    (records["eval"],) = result.records

    env = shim.HarborBashEnv("simulated", environment_kwargs=backend, job_dir=tmp_path / "shim", **timeouts)
    try:
        env.reset(task_dir=str(TASK.task_dir))
        env.bash(command="bash solution/solve.sh")  # what the oracle and the solver do; an error text on a failed start
        reward = env.reward
    finally:
        env.close()
    records["shim"] = env.record
    assert reward == env.record.reward  # what TRL reads is what the record says
    (written,) = JobFolder.open(tmp_path / "shim").records()  # and the job folder has it, as run's and eval's have
    assert written.to_dict() == env.record.to_dict()

    assert {name: outcome(r) for name, r in records.items()} == dict.fromkeys(records, expected)
    summaries = {"run": json.loads((tmp_path / "run" / "summary.json").read_text()), "eval": result.summary}
    assert {name: s["not_judged"] for name, s in summaries.items()} == dict.fromkeys(summaries, int(not expected[2]))
    phases = {name: [s.phase for s in r.phases] for name, r in records.items()}
    assert phases["run"][0] == phases["eval"][0] == phases["shim"][0] == "start"
    assert {p[-1] for p in phases.values()} == {"stop"}


def _interrupt_when(proc: subprocess.Popen, ready, what: str) -> str:
    import signal
    import time

    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, f"{what}: {proc.communicate()[1][-2000:]}"
        time.sleep(0.05)
    time.sleep(2.0)  # into the agent phase (the simulated start takes no time); the record's phases show it
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    return err


@pytest.mark.slow
def test_an_interruption_mid_agent_gives_one_record_through_run_eval_and_the_shim(tmp_path: Path) -> None:
    """SIGINT to `run` and `eval`, close() to the shim, while the agent is at work: cancelled, not judged, everywhere."""
    import threading

    import shim
    from tests.scripted_server import ScriptedServer

    base = [sys.executable, "-m", "harbor_async"]
    where = ["-p", str(example_suite_path()), "-i", TASK.name, "-e", "simulated", "--ek", "exec_latency=60", "-o", str(tmp_path)]
    proc = subprocess.Popen([*base, "run", *where, "--job-name", "run", "-q"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _interrupt_when(proc, lambda: (tmp_path / "run" / "harbor-async.json").exists(), "run")
    records = {"run": JobFolder.open(tmp_path / "run").records()[0]}

    with ScriptedServer(slow_seconds=60) as server:
        proc = subprocess.Popen(
            [*base, "eval", "-m", "slow", "--base-url", server.base_url, *where, "--job-name", "eval"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _interrupt_when(proc, lambda: server.requests["slow"] >= 1, "eval")
    records["eval"] = JobFolder.open(tmp_path / "eval").records()[0]

    # The shim's harness prepares the sandbox with commands of its own: the slow command is the tool call's.
    env = shim.HarborBashEnv("local", job_dir=tmp_path / "shim")
    env.reset(task_dir=str(TASK.task_dir))
    assert env.bash(command="true") == "(empty output, rc=0)"  # the sandbox is ready: the agent is at work
    answers: list[str] = []
    tool = threading.Thread(target=lambda: answers.append(env.bash(command="sleep 60")))
    tool.start()
    tool.join(timeout=2.0)
    assert tool.is_alive()  # mid-command
    env.close()  # what a trainer stopped mid-rollout does
    tool.join(timeout=60)
    assert answers and not tool.is_alive()
    records["shim"] = env.record
    assert JobFolder.open(tmp_path / "shim").records()[0].to_dict() == env.record.to_dict()

    assert {name: outcome(r) for name, r in records.items()} == dict.fromkeys(records, ("cancelled", None, False))
    assert all("agent" in [s.phase for s in r.phases] for r in records.values()), "interrupted before the agent ran"
