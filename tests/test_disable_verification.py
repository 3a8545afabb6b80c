"""harbor run's --disable-verification: the agents run and their artifacts are collected, no verifier runs, and
every episode is recorded not judged (no reward, in no score, never rerun) — never a 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_helpers import harbor_async, make_suite, records
from tests.test_step_integrity import make_task


def _run(tmp_path: Path, name: str, *args: str, code: int = 0) -> tuple[Path, list[dict]]:
    done = harbor_async("run", "-e", "local", "-o", str(tmp_path / "jobs"), "--job-name", name, *args)
    assert done.returncode == code, done.stdout + done.stderr
    return tmp_path / "jobs" / name, records(tmp_path / "jobs" / name)


@pytest.mark.slow
def test_no_verifier_runs_and_nothing_is_judged_or_rerun(tmp_path):
    suite = make_suite(tmp_path / "suite", ["t1", "t2"])
    flags = ["-p", str(suite), "--artifact", "/workdir/answer.txt"]
    _, verified = _run(tmp_path, "verified", *flags)
    assert [r["reward"] for r in verified] == [1.0, 1.0]  # the oracle: judged 1 when the verifier runs
    job, found = _run(tmp_path, "off", *flags, "--disable-verification")
    assert len(found) == 2
    for record in found:
        assert record["reward"] is None and record["verification_disabled"] and record["error_class"] is None
        trial = job / record["trial"]
        assert (trial / "artifacts" / "workdir" / "answer.txt").read_text().strip()  # the agent ran; collected
        assert not (trial / "verifier" / "reward.txt").exists()  # no verifier ran
        result = json.loads((trial / "result.json").read_text())
        assert result["verifier_result"] is None and result["exception_info"] is None  # as Harbor writes it
    summary = json.loads((job / "summary.json").read_text())
    assert summary["mean_reward"] is None and summary["not_judged_by_class"] == {"verification_disabled": 2}, summary
    resumed = harbor_async("run", "--resume", str(job))
    assert resumed.returncode == 0, resumed.stderr
    assert len(records(job)) == 2  # nothing to rerun: the job asked for no verdict
    shown = harbor_async("run", *flags, "-e", "local", "--disable-verification", "--print-config")
    assert json.loads(shown.stdout)["verifier"]["disable"] is True
    (tmp_path / "job.json").write_text(shown.stdout)
    _, again = _run(tmp_path, "config", "-c", str(tmp_path / "job.json"))
    assert [r["verification_disabled"] for r in again] == [True, True]


@pytest.mark.slow
def test_every_step_of_a_multi_step_task_runs_its_agent(tmp_path):
    make_task(tmp_path / "suite", "steps", killer=False)
    job, (record,) = _run(tmp_path, "steps", "-p", str(tmp_path / "suite"), "--disable-verification", "--artifact", "/app")
    assert record["reward"] is None and record["verification_disabled"], record
    assert [s["name"] for s in record["steps"]] == ["one", "two"] and all(s["reward"] is None for s in record["steps"])
    collected = job / record["trial"] / "steps" / "two" / "artifacts" / "app"
    assert (collected / "two.txt").read_text().strip() == "wrong"  # step two's agent ran after step one's
