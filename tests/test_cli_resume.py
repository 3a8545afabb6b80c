"""`run --resume JOB_DIR`: after an interruption, only what is missing runs, and the summary is an uninterrupted run's."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from tests.cli_helpers import (
    harbor_async,
    interrupt,
    make_fast,
    make_suite,
    records,
    spawn,
    wait_for,
)

FAST, SLOW = ["fast-a", "fast-b", "fast-c"], ["slow-a", "slow-b"]


@pytest.mark.slow
def test_resume_after_an_interruption_reproduces_an_uninterrupted_run(tmp_path):
    suite = make_suite(tmp_path / "suite", FAST, SLOW)
    jobs = tmp_path / "jobs"
    job = jobs / "interrupted"
    proc = spawn("run", "-p", str(suite), "-o", str(jobs), "--job-name", "interrupted", "-n", "5", "-k", "2")
    wait_for(lambda: len(records(job)) >= 6, 120, "the fast episodes' records")
    code, _, err, _ = interrupt(proc, [signal.SIGTERM])
    assert code == 143, err
    before = records(job)
    finished = {(r["task"], r["attempt"]): r["sandbox"] for r in before if r["error_class"] is None}
    assert len(finished) == 6 and {r["error_class"] for r in before} == {None, "cancelled"}

    make_fast(suite, SLOW)
    resumed = harbor_async("run", "--resume", str(job), "-n", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert "6 of 10 episodes kept, 4 to run" in resumed.stderr
    after = records(job)
    # Finished episodes were not run again: one record each, the same sandbox.
    for (task, attempt), sandbox in finished.items():
        mine = [r for r in after if r["task"] == task and r["attempt"] == attempt]
        assert len(mine) == 1 and mine[0]["sandbox"] == sandbox
    assert len(after) == len(before) + 4
    # Nothing left to do: a second resume runs nothing and changes nothing.
    again = harbor_async("run", "--resume", str(job))
    assert again.returncode == 0 and "10 of 10 episodes kept, 0 to run" in again.stderr
    assert len(records(job)) == len(after)

    whole = harbor_async("run", "-p", str(suite), "-o", str(jobs), "--job-name", "whole", "-n", "5", "-k", "2")
    assert whole.returncode == 0, whole.stderr
    summary = json.loads((job / "summary.json").read_text())
    reference = json.loads((jobs / "whole" / "summary.json").read_text())
    # the seconds billed are measured (and the interrupted run's attempts count too): all else is the same
    assert summary.pop("sandbox_seconds") > 0 and reference.pop("sandbox_seconds") > 0
    assert summary == reference
    assert summary["complete"] and summary["episodes"] == 10 and summary["mean_reward"] == 1.0
    assert set(summary["pass_at_k"]) == {"1", "2"}


@pytest.mark.slow
def test_resume_reruns_only_the_failures_a_resume_reruns(tmp_path):
    # Infrastructure failures are rerun; the verifier's are the model's and are kept.
    jobs = tmp_path / "jobs"
    first = harbor_async(
        "run", "-e", "tests.broken_backend:FailingStartEnvironment", "-l", "2", "-o", str(jobs), "--job-name", "j"
    )
    assert first.returncode == 1
    config = jobs / "j" / "harbor-async.json"
    data = json.loads(config.read_text())
    data["environment_type"] = "simulated"  # the backend was fixed: the failed starts are rerun
    data["environment_kwargs"] = {"verify_failure_rate": 1}
    config.write_text(json.dumps(data))
    second = harbor_async("run", "--resume", str(jobs / "j"))
    assert second.returncode == 0, second.stderr
    assert "0 of 2 episodes kept, 2 to run" in second.stderr
    data["environment_kwargs"] = {}
    config.write_text(json.dumps(data))
    third = harbor_async("run", "--resume", str(jobs / "j"))
    assert "2 of 2 episodes kept, 0 to run" in third.stderr  # verifier failures are not rerun
    summary = json.loads((jobs / "j" / "summary.json").read_text())
    assert summary["failures"] == {"verifier": 2} and summary["mean_reward"] == 0.0
    shutil.rmtree(jobs)


@pytest.mark.slow
def test_a_job_folder_of_the_previous_release_resumes(tmp_path):
    """config.json with run's nested settings, records naming tasks by absolute path: kept, the rest runs."""
    suite = make_suite(tmp_path / "suite", FAST)
    tasks = sorted((suite / "tasks").iterdir())
    job = tmp_path / "jobs" / "old"
    job.mkdir(parents=True)
    episodes = [{"task": t.name, "task_path": str(t), "attempt": 0} for t in tasks]
    legacy = {
        "command": "run", "created_at": "2026-11-30T10:00:00+00:00", "episodes": episodes,
        "settings": {"source": str(suite / "tasks"), "env": "simulated", "agent": "oracle", "n_attempts": 1,
                     "ek": {}, "multipliers": {"all": None, "agent": None, "verifier": None, "environment_build": None},
                     "episode_timeout": None, "start_timeout": None, "dataset": None},
    }  # fmt: skip
    (job / "config.json").write_text(json.dumps(legacy))
    kept = {"task": tasks[0].name, "task_path": str(tasks[0]), "attempt": 0, "reward": 1.0, "phases": [], "version": 1}
    (job / "episodes.jsonl").write_text(json.dumps(kept) + "\n")
    done = harbor_async("run", "--resume", str(job))
    assert done.returncode == 0, done.stderr
    assert "1 of 3 episodes kept, 2 to run" in done.stderr
    new = records(job)[1:]
    assert sorted(r["task_path"] for r in new) == [t.name for t in tasks[1:]]  # today's records: paths in the suite
    summary = json.loads((job / "summary.json").read_text())
    assert summary["episodes"] == 3 and summary["complete"] is True
