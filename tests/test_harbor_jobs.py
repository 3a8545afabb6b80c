"""Harbor's own tools read our job folders: ``harbor view`` (through its HTTP API) and ``harbor job regrade``.

A ``run`` job, an ``eval`` sweep of two models and a job of Harbor's own
``harbor run`` sit in one jobs folder; Harbor's viewer lists every trial of each
with its reward and serves a trial's agent log and verifier output. The folders
validate with Harbor's ``JobResult`` and ``TrialResult``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_async.jobs.folder import JobFolder
from harbor_async.suites import example_suite_path
from tests.cli_helpers import REPO, harbor_async, records
from tests.scripted_server import ScriptedServer

pytestmark = pytest.mark.slow

HARBOR = Path(sys.executable).with_name("harbor")
LOCAL = "harbor_async.backends.local:LocalEnvironment"
TASKS = ["csv-column-sum", "csv-max-price"]


def _suite(root: Path) -> Path:
    for name in TASKS:
        shutil.copytree(example_suite_path() / "tasks" / name, root / "tasks" / name)
    return root


def _harbor(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(REPO)}
    return subprocess.run([str(HARBOR), *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)


def _get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=30) as response:
        return json.loads(response.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def harbor_view(jobs: Path) -> Iterator[str]:
    """Harbor's own ``harbor view`` over ``jobs``, up and answering; yields its base URL."""
    port = _free_port()
    viewer = subprocess.Popen(
        [str(HARBOR), "view", str(jobs), "--port", str(port), "--host", "127.0.0.1", "--no-build", "--jobs"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(base, "/api/health")
                break
            except OSError:
                assert viewer.poll() is None and time.monotonic() < deadline, "harbor view did not come up"
                time.sleep(0.3)
        yield base
    finally:
        viewer.terminate()
        viewer.wait(timeout=30)


def _validate(job: Path, trials: int) -> None:
    """The folder as Harbor's models read it: a JobResult and one TrialResult (and TrialConfig) per trial."""
    from harbor.models.job.config import JobConfig
    from harbor.models.job.result import JobResult
    from harbor.models.trial.config import TrialConfig
    from harbor.models.trial.result import TrialResult

    JobConfig.model_validate_json((job / "config.json").read_text())
    result = JobResult.model_validate_json((job / "result.json").read_text())
    assert result.n_total_trials == trials and result.stats.n_completed_trials == trials and result.finished_at
    folders = [p for p in job.iterdir() if (p / "result.json").is_file()]
    assert len(folders) == trials
    for folder in folders:
        trial = TrialResult.model_validate_json((folder / "result.json").read_text())
        TrialConfig.model_validate_json((folder / "config.json").read_text())
        assert trial.trial_name == folder.name and trial.verifier_result is not None
        assert trial.environment_setup and trial.agent_execution and trial.verifier  # timings, from the record's spans


def test_harbor_view_lists_our_run_and_eval_jobs_as_it_lists_its_own(tmp_path: Path) -> None:
    suite, jobs = _suite(tmp_path / "suite"), tmp_path / "jobs"
    where = ["-e", "local", "--ek", f"sandbox_root={tmp_path / 'sb'}"]
    done = harbor_async("run", "-p", str(suite), *where, "-o", str(jobs), "--job-name", "ours")
    assert done.returncode == 0, done.stderr[-3000:]
    with ScriptedServer(suite / "tasks") as server:
        done = harbor_async(
            "eval", "-p", str(suite), *where, "-m", "solver", "-m", "half", "-k", "2", "-o", str(jobs),
            "--job-name", "sweep", "--base-url", server.base_url,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    done = _harbor("run", "-p", str(suite / "tasks"), "-e", LOCAL, "-a", "oracle", "-o", str(jobs), "--job-name", "theirs", "-y", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _validate(jobs / "ours", 2)
    _validate(jobs / "sweep", 8)

    # a sweep is one job with one eval per model, Harbor's agent__model__dataset key, with metrics and pass@k
    evals = json.loads((jobs / "sweep" / "result.json").read_text())["stats"]["evals"]
    means = {key.split("__")[1]: entry["metrics"][0]["mean"] for key, entry in evals.items()}
    assert means == {"solver": 1.0, "half": 0.5}
    assert all(entry["pass_at_k"]["2"] is not None for entry in evals.values())
    # our own readers still read the same folder
    assert len(JobFolder(jobs / "sweep").records()) == 8 and JobFolder(jobs / "sweep").settings_path.name == "harbor-async.json"

    with harbor_view(jobs) as base:
        listed = {job["name"]: job for job in _get(base, "/api/jobs")["items"]}
        assert {"ours", "sweep", "theirs"} <= set(listed)
        for name, trials in (("ours", 2), ("sweep", 8), ("theirs", 2)):
            job = listed[name]
            assert job["n_total_trials"] == trials and job["n_completed_trials"] == trials and job["started_at"]
            items = _get(base, f"/api/jobs/{name}/trials")["items"]
            assert len(items) == trials
            assert all(item["reward"] is not None and item["started_at"] and item["finished_at"] for item in items)
            trial = items[0]["name"]
            verifier = _get(base, f"/api/jobs/{name}/trials/{trial}/verifier-output")
            assert "expected=" in verifier["stdout"]  # the test script's own output
            if name != "sweep":
                assert _get(base, f"/api/jobs/{name}/trials/{trial}/agent-logs")["oracle"] is not None
        assert {item["reward"] for item in _get(base, "/api/jobs/ours/trials")["items"]} == {1.0}
        by_model = {}
        for item in _get(base, "/api/jobs/sweep/trials")["items"]:
            by_model.setdefault(item["model_name"], []).append(item["reward"])
        assert sorted(by_model) == ["half", "solver"] and set(by_model["solver"]) == {1.0}
        # an eval trial's conversation, as Harbor's trajectory: the model's tool calls and what they returned
        sweep_trial = _get(base, "/api/jobs/sweep/trials")["items"][0]["name"]
        steps = _get(base, f"/api/jobs/sweep/trials/{sweep_trial}/trajectory")["steps"]
        calls = [step for step in steps if step.get("tool_calls")]
        assert calls and calls[0]["observation"]["results"][0]["content"] is not None


SEPARATE = Path(__file__).resolve().parent / "corpus" / "separate-verifier"


def test_harbor_job_regrade_rescores_our_job(tmp_path: Path) -> None:
    """``harbor job regrade`` re-runs a separate verifier on the artifacts our trial folder kept."""
    suite, jobs = tmp_path / "suite", tmp_path / "jobs"
    shutil.copytree(SEPARATE, suite / "separate-verifier")
    done = harbor_async("run", "-p", str(suite), "-e", "local", "--ek", f"sandbox_root={tmp_path / 'sb'}", "-o", str(jobs), "--job-name", "ours")
    assert done.returncode == 0, done.stderr[-3000:]
    (trial,) = [p for p in (jobs / "ours").iterdir() if (p / "artifacts").is_dir()]

    def regraded(name: str) -> dict:
        """``harbor job regrade`` of our job into ``regraded/NAME``: the one trial's rewards."""
        regrade = _harbor(
            "job", "regrade", str(jobs / "ours"), "-p", str(suite / "separate-verifier"), "-e", LOCAL,
            "-o", str(tmp_path / "regraded"), "--job-name", name, "-y", cwd=tmp_path,
        )  # fmt: skip
        assert regrade.returncode == 0, regrade.stdout[-3000:] + regrade.stderr[-3000:]
        (result,) = (tmp_path / "regraded" / name).glob("*__*/result.json")
        return json.loads(result.read_text())["verifier_result"]["rewards"]

    assert regraded("again") == {"reward": 1.0}
    # and it judged what our trial folder kept: without the artifact, the same regrade scores 0
    (trial / "artifacts" / "logs" / "artifacts" / "answer.txt").write_text("41\n")
    assert regraded("tampered") == {"reward": 0.0}


@pytest.mark.range
def test_a_rerun_replaces_its_trial_folder_and_harbor_config_is_not_our_settings(tmp_path: Path) -> None:
    """A resume's rerun of an episode replaces the earlier trial folder, so the job counts each episode once."""
    from harbor_async.backends import resolve_backend
    from harbor_async.core.records import EpisodeRecord
    from harbor_async.jobs.settings import JobSettings

    job = JobFolder.create(tmp_path, "j", JobSettings().to_dict())
    suite = _suite(tmp_path / "suite")
    job.keep_harbor_layout(JobSettings(), resolve_backend("local"), 1, suite)
    failed = EpisodeRecord(task="csv-column-sum", task_path="tasks/csv-column-sum", trial="csv-column-sum__aaaaaaa",
                           error_class="infrastructure", error_type="SandboxStartError", error="no room")  # fmt: skip
    job.append(failed)
    assert (job.path / failed.trial / "exception.txt").read_text().startswith("SandboxStartError: no room")
    rerun = EpisodeRecord(task="csv-column-sum", task_path="tasks/csv-column-sum", trial="csv-column-sum__bbbbbbb", reward=1.0, rewards={"reward": 1})
    job.append(rerun)
    job.write_summary({})
    assert not (job.path / failed.trial).exists() and (job.path / rerun.trial / "result.json").is_file()
    stats = json.loads((job.path / "result.json").read_text())["stats"]
    assert stats["n_completed_trials"] == 1 and stats["n_errored_trials"] == 0
    # config.json is Harbor's JobConfig now: never read as our settings
    (job.path / "harbor-async.json").unlink()
    assert JobFolder(job.path).settings_path is None


def test_a_link_in_a_sandboxs_logs_never_reaches_the_job_folder(tmp_path: Path) -> None:
    """Harbor's viewer follows links when it serves a trial's files: none is kept, however the logs came."""
    from harbor_async.jobs.harbor_layout import keep_trial_logs

    sandbox_trial = tmp_path / "sandbox-trial"
    (sandbox_trial / "verifier" / "deep").mkdir(parents=True)
    (sandbox_trial / "verifier" / "test-stdout.txt").symlink_to("/etc/passwd")
    (sandbox_trial / "verifier" / "deep" / "out").symlink_to("/")
    (sandbox_trial / "verifier" / "reward.txt").write_text("1\n")
    keep_trial_logs(sandbox_trial, tmp_path / "job" / "t__1")
    kept = tmp_path / "job" / "t__1" / "verifier"
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*")) == ["deep", "reward.txt"]
    assert (sandbox_trial / "verifier").is_dir()  # made again for the next step


def test_harbors_metrics_leave_out_what_nobody_judged(tmp_path: Path) -> None:
    """Harbor's Mean counts an unjudged trial as 0; ours leaves it out, and a job with none judged has no metric."""
    jobs = tmp_path / "jobs"
    common = ["-e", "simulated", "-l", "3", "-k", "4", "-o", str(jobs)]
    harbor_async("run", *common, "--job-name", "some", "--ek", "start_permanent_failure_rate=0.5", "--ek", "seed=1")
    harbor_async("run", *common, "--job-name", "none", "--ek", "start_permanent_failure_rate=1.0")
    found = {r["reward"] for r in records(jobs / "some")}
    assert found == {None, 1.0}  # the test means something only with both
    (some,) = json.loads((jobs / "some" / "result.json").read_text())["stats"]["evals"].values()
    assert some["metrics"] == [{"mean": 1.0}]  # Harbor's own Mean would give less than 1
    assert all(value == 1.0 for value in some["pass_at_k"].values())
    (none,) = json.loads((jobs / "none" / "result.json").read_text())["stats"]["evals"].values()
    assert none["metrics"] == [] and none["pass_at_k"] == {}  # not a mean of 0.0
    # and Harbor's own viewer, through its API, shows no result for the job nobody was judged in, 1.0 for the other
    with harbor_view(jobs) as base:
        listed = {job["name"]: job for job in _get(base, "/api/jobs")["items"]}
        metrics = {name: [m for e in listed[name]["evals"].values() for m in e["metrics"]] for name in ("some", "none")}
        assert metrics == {"some": [{"mean": 1.0}], "none": []}, metrics
        rewards = {item["reward"] for item in _get(base, "/api/jobs/none/trials")["items"]}
        assert rewards == {None}  # no trial of it shows 0.0


@pytest.mark.range  # beside each end's own harbor run
def test_our_trial_files_are_harbors_for_the_same_outcomes(tmp_path: Path) -> None:
    """The same two tasks under `harbor run` and `harbor-async run` (local): one solved, one whose test leaves no
    reward. Each trial folder has Harbor's files (lock.json, trial.log, artifacts/manifest.json); the unrewarded
    trial has no verifier_result and Harbor's RewardFileNotFoundError in both; and the job's mean counts it as the
    0 it is (judged), as Harbor's does, while episodes.jsonl keeps our class."""
    from harbor.models.job.lock import TrialLock
    from harbor.models.trial.result import TrialResult

    suite = tmp_path / "suite"
    shutil.copytree(example_suite_path() / "tasks" / "csv-column-sum", suite / "tasks" / "solved")
    shutil.copytree(example_suite_path() / "tasks" / "csv-column-sum", suite / "tasks" / "no-reward")
    (suite / "tasks" / "no-reward" / "tests" / "test.sh").write_text("#!/bin/bash\necho 'no reward written'\n")
    jobs = tmp_path / "jobs"
    done = harbor_async("run", "-p", str(suite), "-e", "local", "--ek", f"sandbox_root={tmp_path / 'sb'}", "-o", str(jobs), "--job-name", "ours")
    assert done.returncode == 0, done.stderr[-3000:]
    done = _harbor("run", "-p", str(suite / "tasks"), "-e", LOCAL, "-a", "oracle", "-o", str(jobs), "--job-name", "theirs", "-y", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def trials(job: str) -> dict[str, tuple[TrialResult, Path]]:
        found = {}
        for folder in (jobs / job).iterdir():
            if (folder / "result.json").is_file():
                trial = TrialResult.model_validate_json((folder / "result.json").read_text())
                found[trial.task_name.split("/")[-1]] = (trial, folder)
        return found

    ours, theirs = trials("ours"), trials("theirs")
    assert set(ours) == set(theirs) == {"solved", "no-reward"}
    for task in ("solved", "no-reward"):
        (mine, my_folder), (harbors, their_folder) = ours[task], theirs[task]
        outcome = lambda t: (t.verifier_result is None, t.exception_info.exception_type if t.exception_info else None)  # noqa: E731
        assert outcome(mine) == outcome(harbors), (task, outcome(mine), outcome(harbors))
        for name in ("lock.json", "trial.log", "artifacts/manifest.json"):
            assert (their_folder / name).is_file() and (my_folder / name).is_file(), (task, name)
        lock = TrialLock.model_validate_json((my_folder / "lock.json").read_text())
        theirs_lock = TrialLock.model_validate_json((their_folder / "lock.json").read_text())
        assert lock.task.digest == theirs_lock.task.digest  # the same task content, hashed by Harbor's own code
    assert outcome(ours["no-reward"][0]) == (True, "RewardFileNotFoundError")
    import re

    for found in (ours, theirs):  # trial folders named as Harbor names them: the task folder, 7 of ShortUUID's letters
        assert all(re.fullmatch(rf"{task}__[0-9A-Za-z]{{7}}", folder.name) for task, (_, folder) in found.items()), found
    assert "RewardFileNotFoundError" in (ours["no-reward"][1] / "trial.log").read_text()
    (evals,) = json.loads((jobs / "ours" / "result.json").read_text())["stats"]["evals"].values()
    (their_evals,) = json.loads((jobs / "theirs" / "result.json").read_text())["stats"]["evals"].values()
    assert evals["metrics"] == [{"mean": 0.5}]  # the failed verification is the model's 0
    from importlib.metadata import version

    from packaging.version import Version

    # Harbor 0.25's mean counts it as 0 too; 0.26 leaves a trial without a reward out (docs/backends.md says so)
    theirs_mean = [{"mean": 0.5}] if Version(version("harbor")) < Version("0.26") else [{"mean": 1.0}]
    assert their_evals["metrics"] == theirs_mean
    by_task = {r["task"]: r for r in records(jobs / "ours")}
    assert (by_task["no-reward"]["error_class"], by_task["no-reward"]["reward"]) == ("verifier", 0.0)  # ours, kept
