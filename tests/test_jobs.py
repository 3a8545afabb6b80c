"""Job folders: records flushed per episode, torn lines survived, resume picks what a resume reruns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harbor_async.core.records import EpisodeRecord, PhaseSpan
from harbor_async.jobs.folder import EPISODES_NAME, JobFolder, JobFolderError


def record(task: str, attempt: int = 0, error_class: str | None = None, reward: float | None = 1.0) -> EpisodeRecord:
    return EpisodeRecord(
        task=task, task_path=f"/suite/{task}", attempt=attempt, reward=reward, error_class=error_class,
        phases=[PhaseSpan("start", 0.0, 0.1)],
    )  # fmt: skip


def test_each_append_is_on_disk_before_the_next(tmp_path):
    job = JobFolder.create(tmp_path, "j", {"settings": {}})
    job.append(record("a"))
    # Another process reads it while the writer still holds the file open.
    seen = subprocess.run(
        [sys.executable, "-c", f"print(len(open({str(job.path / EPISODES_NAME)!r}).read().splitlines()))"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert seen.stdout.strip() == "1"
    job.append(record("b"))
    job.close()
    assert [r.task for r in job.records()] == ["a", "b"]
    assert job.records()[0].phases == [PhaseSpan("start", 0.0, 0.1)]


def test_a_torn_last_line_is_skipped_and_the_latest_record_wins(tmp_path):
    job = JobFolder.create(tmp_path, "j", {})
    job.append(record("a", error_class="cancelled", reward=None))
    job.append(record("b"))
    job.append(record("a"))
    job.close()
    with open(job.path / EPISODES_NAME, "a") as fh:
        fh.write('{"task": "c", "rew')  # a writer killed mid-line
    latest = JobFolder.open(job.path).latest()
    assert [r.task for r in latest.values()] == ["a", "b"]
    assert latest["::/suite/a::0"].reward == 1.0


def test_pending_is_what_is_missing_and_what_a_resume_reruns(tmp_path):
    job = JobFolder.create(tmp_path, "j", {})
    for task, cls in (("ok", None), ("infra", "infrastructure"), ("cancel", "cancelled"), ("verifier", "verifier"), ("agent", "agent")):
        job.append(record(task, error_class=cls, reward=None if cls in ("infrastructure", "cancelled") else 0.0))
    job.close()
    keys = [f"::/suite/{t}::0" for t in ("ok", "infra", "cancel", "verifier", "agent", "missing")]
    assert job.pending(keys) == ["::/suite/infra::0", "::/suite/cancel::0", "::/suite/missing::0"]


def test_a_job_folder_is_checked_before_use(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(JobFolderError, match="cannot write the job folder"):
        JobFolder.create(blocker / "jobs", "j", {})
    job = JobFolder.create(tmp_path, "j", {"x": 1})
    job.append(record("a"))
    job.close()
    with pytest.raises(JobFolderError, match="--resume"):
        JobFolder.create(tmp_path, "j", {})
    with pytest.raises(JobFolderError, match="not a job folder"):
        JobFolder.open(tmp_path / "elsewhere")
    assert JobFolder.open(tmp_path / "j").config == {"x": 1}
    job.write_summary({"mean_reward": 1.0})
    assert json.loads((job.path / "summary.json").read_text()) == {"mean_reward": 1.0, "sandbox_seconds": 0.0}  # no record: none billed
