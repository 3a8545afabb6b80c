"""Per-episode and per-job disk bounds of what a run copies to the host, and docker's ``storage_mb`` (issue 44, item 7).

The attacks are oracle solutions a model could write: sparse files (each
within its own transfer budget) in ``/logs/agent``, ``/logs/artifacts`` and a
declared artifact; a test script that floods ``/logs/verifier``; a container
that writes past its ``storage_mb``. Each task's tests pass (reward 1), so
without the bounds every attack scores 1.0 and the job folder grows.
The bounds are injected small (MiB), as ``Engine(disk_limits=...)``, and as run's and eval's flags.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harbor_async.core.records import episode_key
from harbor_async.engine.engine import Engine
from harbor_async.episodes.runner import FailureBudget, PlannedEpisode, run_suite
from harbor_async.jobs.folder import JobFolder
from harbor_async.tasks.suite import load_task
from harbor_async.verification.disk_bounds import (
    DiskLimits,
    JobDiskLimitError,
    apparent_size,
)
from tests.requirements import needs_bwrap

MiB = 2**20

TOML = """schema_version = "1.4"
artifacts = ["/app/out.bin"]

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 60.0

[environment]
build_timeout_sec = 120.0
{environment}
"""
PASS = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"
# Three sparse files of 6 MiB each (18 MiB apparent, nothing on disk): each well within a 512 MiB transfer.
DUMPER = """#!/bin/bash
mkdir -p /app /logs/artifacts
truncate -s 6M /app/out.bin /logs/artifacts/a.bin /logs/agent/oracle.txt
"""
QUIET = "#!/bin/bash\nmkdir -p /app && echo small > /app/out.bin\n"
FLOODING_TEST = "#!/bin/bash\ntruncate -s 12M /logs/verifier/flood.bin\necho 1 > /logs/verifier/reward.txt\n"


def make_task(root: Path, name: str, solve: str, test: str = PASS, environment: str = "") -> Path:
    task = root / name
    for folder in ("environment", "solution", "tests"):
        (task / folder).mkdir(parents=True)
    (task / "task.toml").write_text(TOML.format(environment=environment))
    (task / "instruction.md").write_text("Write /app/out.bin.\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text(solve)
    (task / "tests" / "test.sh").write_text(test)
    return task


def trial_size(job: Path, record) -> int:
    return apparent_size(job / record.trial)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def run_job(tasks, job: Path, limits: DiskLimits, backend: str = "local", **engine_kwargs):
    """The tasks as ``run`` runs them (one orchestration, the job's stop budget), records kept in ``job``."""
    folder = JobFolder.open(job) if (job / "episodes.jsonl").exists() else JobFolder.create(job.parent, job.name, {})
    budget = FailureBudget(None, "-", job)
    async with Engine(trials_dir=job, disk_limits=limits, **engine_kwargs) as engine:
        found = await run_suite(engine, tasks, backend, agent="oracle", concurrency=1, on_done=folder.append, budget=budget)
    folder.close()
    return found, budget, folder


@needs_bwrap
@pytest.mark.anyio
async def test_an_episode_past_its_disk_bound_is_the_agents_scored_failure(tmp_path: Path) -> None:
    tasks = [load_task(make_task(tmp_path / "suite", "dumper", DUMPER)), load_task(make_task(tmp_path / "suite", "quiet", QUIET))]
    job = tmp_path / "jobs" / "job"
    found, budget, _ = await run_job(tasks, job, DiskLimits(episode_mb=8))
    by_task = {r.task: r for r in found}
    dumper, quiet = by_task["dumper"], by_task["quiet"]
    # 18 MiB left for the host, each file within its own transfer budget: the episode's bound refused the rest,
    # and the agent's failure is scored (0, not infrastructure, not rerun).
    assert dumper.reward == 0.0 and dumper.error_class == "agent", dumper
    assert dumper.error_type == "AgentDiskLimitError" and "episode's bound of 8 MiB" in dumper.error
    assert not dumper.rerun
    assert trial_size(job, dumper) <= 8 * MiB
    # An episode within its bound is judged as ever.
    assert quiet.reward == 1.0 and quiet.error is None, quiet
    assert budget.error is None


@needs_bwrap
@pytest.mark.anyio
async def test_verifier_output_past_the_bound_is_the_verifiers_scored_failure(tmp_path: Path) -> None:
    tasks = [load_task(make_task(tmp_path / "suite", "flood", QUIET, FLOODING_TEST))]
    job = tmp_path / "jobs" / "job"
    [record], _, _ = await run_job(tasks, job, DiskLimits(episode_mb=8))
    assert record.reward == 0.0 and record.error_class == "verifier", record
    assert record.error_type == "VerifierDiskLimitError"
    assert trial_size(job, record) <= 8 * MiB


@pytest.mark.slow
@needs_bwrap
@pytest.mark.anyio
async def test_a_job_at_its_bound_stops_loudly_and_resumes(tmp_path: Path) -> None:
    # Four episodes of 4 MiB each (one sparse artifact; the others are small), one at a time, in a 10 MiB job.
    solve = "#!/bin/bash\nmkdir -p /app && truncate -s 4M /app/out.bin\n"
    tasks = [load_task(make_task(tmp_path / "suite", f"t{i}", solve)) for i in range(4)]
    job = tmp_path / "jobs" / "job"
    found, budget, folder = await run_job(tasks, job, DiskLimits(episode_mb=8, job_mb=10))
    # The third episode would pass the bound: its copy is refused, it is not judged (rerun), the job stops.
    assert isinstance(budget.error, JobDiskLimitError), budget.error
    assert "reached its bound of 10 MiB" in str(budget.error) and str(job) in str(budget.error)
    judged = [r for r in found if r.reward == 1.0 and r.error is None]
    assert len(judged) == 2, [(r.task, r.reward, r.error_class, r.error) for r in found]
    stopped = [r for r in found if r.error_type == "JobDiskLimitError"]
    assert stopped and all(r.rerun and r.reward is None and r.error_class == "cancelled" for r in stopped)
    assert not any(r.reward is not None and r.task == "t3" for r in found)  # never judged after the stop
    assert apparent_size(job) <= 10 * MiB
    # Resumed with room: only what was not judged runs, and every episode ends judged.
    latest = JobFolder.open(job).latest()
    todo = [t for t in tasks if (r := latest.get(episode_key(str(t.paths.task_dir), 0))) is None or r.rerun]
    assert [t.name for t in todo] == ["t2", "t3"]
    again, budget, _ = await run_job([PlannedEpisode(t) for t in todo], job, DiskLimits(episode_mb=8, job_mb=64))
    assert budget.error is None and all(r.reward == 1.0 for r in again), again
    final = JobFolder.open(job).latest()
    assert sorted(r.task for r in final.values() if r.reward == 1.0) == ["t0", "t1", "t2", "t3"]
    del folder


# ─── docker ──────────────────────────────────────────────────────────────────

STORAGE_HOG = """#!/bin/bash
mkdir -p /app && echo small > /app/out.bin
head -c 48M /dev/zero > /tmp/hog.bin   # 48 MiB really written, in a 16 MB sandbox
sleep 30                                # the watch ends it long before this
"""


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
@pytest.mark.anyio
async def test_docker_episode_and_storage_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harbor_async.backends.docker import storage

    monkeypatch.setattr(storage.WATCH, "interval", 0.5)
    suite = tmp_path / "suite"
    tasks = [
        load_task(make_task(suite, "dumper", DUMPER)),
        load_task(make_task(suite, "hog", STORAGE_HOG, environment="storage_mb = 16")),
        load_task(make_task(suite, "quiet", QUIET, environment="storage_mb = 16")),
    ]
    job = tmp_path / "jobs" / "job"
    found, budget, _ = await run_job(tasks, job, DiskLimits(episode_mb=8), backend="docker")
    by_task = {r.task: r for r in found}
    dumper, hog, quiet = by_task["dumper"], by_task["hog"], by_task["quiet"]
    assert dumper.reward == 0.0 and dumper.error_type == "AgentDiskLimitError", dumper
    assert trial_size(job, dumper) <= 8 * MiB
    enforced, _ = storage.daemon_quota()
    if not enforced:  # this machine's overlay2 on ext4: our watch killed it, the agent's scored failure
        assert hog.reward == 0.0 and hog.error_class == "agent" and hog.error_type == "AgentDiskLimitError", hog
        assert "storage_mb of 16" in hog.error
        assert hog.seconds["total"] < 30  # ended by the watch, not by its own sleep
    else:  # the daemon's quota: the write failed inside the container
        assert hog.reward == 1.0
    assert quiet.reward == 1.0 and quiet.error is None, quiet
    assert budget.error is None


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_doctor_says_who_bounds_docker_storage() -> None:
    from harbor_async.backends.docker.storage import daemon_quota
    from harbor_async.cli.machine_checks import FEATURES

    [check] = [c for c in FEATURES["docker"]() if c.name == "docker storage_mb"]
    enforced, how = daemon_quota()
    assert check.ok
    assert ("enforced by the daemon" if enforced else "bounded by harbor-async") in check.found
    assert how in check.found


# ─── the commands' flags ─────────────────────────────────────────────────────


@pytest.mark.slow
@needs_bwrap
def test_run_flags_set_the_bounds_and_a_resume_may_raise_the_jobs(tmp_path: Path) -> None:
    """``--job-disk-limit-mb``: the stop is one line naming the bound and the resume (exit 1); the resume may raise
    the job's bound (the results do not depend on it) but not the episode's (they do)."""
    import json

    from tests.cli_helpers import harbor_async, records

    solve = "#!/bin/bash\nmkdir -p /app && truncate -s 4M /app/out.bin\n"
    for i in range(2):
        make_task(tmp_path / "suite", f"t{i}", solve)
    job = tmp_path / "jobs" / "job"
    argv = ["run", "-p", str(tmp_path / "suite"), "-n", "1", "-o", str(job.parent), "--job-name", job.name]
    stopped = harbor_async(*argv, "--job-disk-limit-mb", "2", "-q")
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "reached its bound of 2 MiB" in stopped.stderr and f"--resume {job}" in stopped.stderr, stopped.stderr
    assert "Fix the server" not in stopped.stderr
    summary = json.loads((job / "summary.json").read_text())
    assert "reached its bound of 2 MiB" in summary["stopped_by"]
    assert apparent_size(job) <= 2 * MiB
    conflict = harbor_async("run", "--resume", str(job), "--episode-disk-limit-mb", "16")
    assert conflict.returncode == 2 and "--episode-disk-limit-mb" in conflict.stderr, conflict.stderr
    resumed = harbor_async("run", "--resume", str(job), "--job-disk-limit-mb", "64", "-q")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    latest = {r["task"]: r for r in records(job)}
    assert {t: r["reward"] for t, r in latest.items()} == {"t0": 1.0, "t1": 1.0}
