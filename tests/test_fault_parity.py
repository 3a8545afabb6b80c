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
