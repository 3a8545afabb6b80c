"""A corpus of the job folders the project writes when things go wrong, made by the real commands.

Each is a job a user opens ``report`` or ``view`` on when they need it most:
stopped by the failure budget, model-server failures only, interrupted by
SIGINT, no episode at all, resumed, and one written by the previous release
(its settings at version 3 and its summary and records without the keys added
since). Built once per test module (a few seconds on the simulated backend).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from harbor_async.jobs.folder import JobFolder
from tests.cli_helpers import REPO, harbor_async
from tests.scripted_server import ScriptedServer

#: Summary keys and record keys this release added over the previous one (a previous release's job lacks them).
NEWER_SUMMARY_KEYS = ("not_judged", "not_judged_by_class", "complete", "planned_episodes", "stopped_by", "usage")
NEWER_RECORD_KEYS = ("steps", "usage", "trial", "finish_reason", "start_attempts")


def _interrupted(jobs: Path) -> Path:
    """``run`` on slow starts, sent SIGINT once its job folder exists: every episode cancelled."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "harbor_async", "run", "-e", "simulated", "--ek", "start_latency=30", "-l", "3", "-n", "3",
         "-o", str(jobs), "--job-name", "interrupted"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (jobs / "interrupted" / "episodes.jsonl").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(1.0)  # the episodes are starting
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    return jobs / "interrupted"


def _previous_release(job: Path, into: Path) -> Path:
    """``job`` as the previous release wrote it: settings version 3, no summary or record keys added since."""
    shutil.copytree(job, into)
    settings = json.loads((into / "harbor-async.json").read_text())
    settings["version"] = 3
    (into / "harbor-async.json").write_text(json.dumps(settings))
    summary = json.loads((into / "summary.json").read_text())
    (into / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k not in NEWER_SUMMARY_KEYS}))
    lines = (into / "episodes.jsonl").read_text().splitlines()
    old = [json.dumps({k: v for k, v in json.loads(line).items() if k not in NEWER_RECORD_KEYS}) for line in lines if line]
    (into / "episodes.jsonl").write_text("\n".join(old) + "\n")
    return into


def make_failure_corpus(jobs: Path) -> dict[str, Path]:
    """name -> job folder, each written by the real commands (the previous release's: rewritten from one)."""
    corpus: dict[str, Path] = {}
    with ScriptedServer(slow_seconds=0) as server:
        base = ["-e", "simulated", "--base-url", server.base_url, "--model-retries", "0", "-o", str(jobs)]
        stopped = harbor_async("eval", "-m", "always-500", "-l", "3", "-n", "1", "--max-model-server-failures", "2", *base, "--job-name", "stopped")
        assert stopped.returncode == 3, stopped.stderr[-2000:]
        corpus["stopped by the failure budget"] = jobs / "stopped"
        failed = harbor_async("eval", "-m", "always-500", "-l", "2", "--max-model-server-failures", "0", *base, "--job-name", "server-failures")
        assert failed.returncode == 1, failed.stderr[-2000:]
        corpus["model-server failures only"] = jobs / "server-failures"
    corpus["interrupted"] = _interrupted(jobs)
    empty = JobFolder.create(jobs, "empty", {"command": "run", "episodes": []})
    empty.write_summary({"episodes": 0, "completed": 0, "not_judged": 0, "planned_episodes": 0, "complete": True})
    empty.close()
    corpus["zero episodes"] = jobs / "empty"
    argv = ["run", "-e", "simulated", "--ek", "start_permanent_failure_rate=1.0", "-l", "2", "-o", str(jobs), "--job-name", "resumed"]
    assert harbor_async(*argv).returncode == 1
    again = harbor_async("run", "--resume", str(jobs / "resumed"))
    assert again.returncode == 1 and "resuming" in again.stderr, again.stderr[-2000:]
    corpus["resumed"] = jobs / "resumed"
    unverified = harbor_async("run", "-e", "simulated", "-l", "2", "--disable-verification", "-o", str(jobs), "--job-name", "unverified")
    assert unverified.returncode == 0, unverified.stderr[-2000:]
    corpus["verification disabled"] = jobs / "unverified"
    corpus["previous release"] = _previous_release(jobs / "server-failures", jobs / "previous-release")
    return corpus
