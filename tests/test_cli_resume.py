"""`run --resume JOB_DIR`: after an interruption, only what is missing runs, and the summary is an uninterrupted run's."""

from __future__ import annotations

import json
import shutil
import signal

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
    assert summary == reference
    assert summary["complete"] and summary["episodes"] == 10 and summary["mean_reward"] == 1.0
    assert set(summary["pass_at_k"]) == {"1", "2"}


def test_resume_reruns_only_the_failures_a_resume_reruns(tmp_path):
    # Infrastructure failures are rerun; the verifier's are the model's and are kept.
    jobs = tmp_path / "jobs"
    first = harbor_async(
        "run", "-e", "tests.broken_backend:FailingStartEnvironment", "-l", "2", "-o", str(jobs), "--job-name", "j"
    )
    assert first.returncode == 1
    config = jobs / "j" / "config.json"
    data = json.loads(config.read_text())
    data["settings"]["env"] = "simulated"  # the backend was fixed: the failed starts are rerun
    data["settings"]["ek"] = {"verify_failure_rate": 1}
    config.write_text(json.dumps(data))
    second = harbor_async("run", "--resume", str(jobs / "j"))
    assert second.returncode == 0, second.stderr
    assert "0 of 2 episodes kept, 2 to run" in second.stderr
    data["settings"]["ek"] = {}
    config.write_text(json.dumps(data))
    third = harbor_async("run", "--resume", str(jobs / "j"))
    assert "2 of 2 episodes kept, 0 to run" in third.stderr  # verifier failures are not rerun
    summary = json.loads((jobs / "j" / "summary.json").read_text())
    assert summary["failures"] == {"verifier": 2} and summary["mean_reward"] == 0.0
    shutil.rmtree(jobs)
