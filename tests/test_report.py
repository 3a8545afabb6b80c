"""The report without a browser: its figures, its file (self-contained, escaped), the CLI and the view server.

The browser checks are in test_report_browser.py.
"""

from __future__ import annotations

import html
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from harbor_async.cli import app
from harbor_async.core.records import EpisodeRecord
from harbor_async.jobs.folder import EPISODES_NAME, SETTINGS_NAME, JobFolder
from harbor_async.report import (
    ReportSourceError,
    default_output,
    load_source,
    render,
    write_report,
)
from harbor_async.report.analysis import SOLVED, UNSOLVED, analyze
from harbor_async.report.pack import script_json, unpack_episode
from harbor_async.report.server import ReportServer
from tests.test_report_jobs import EVIL, make_job

REPO = Path(__file__).resolve().parent.parent
BLOB = re.compile(r'<script type="application/x-gzip-base64" id="ep-(\d+)">([A-Za-z0-9+/=]+)</script>')
SWEEP = [("ckpt/step-100", "step-100"), ("ckpt/step-200", "step-200"), ("ckpt/step-1000", "step-1000")]


def _data(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.DOTALL)
    assert found, "no report data in the page"
    return json.loads(found.group(1))


def test_analysis_agrees_with_scoring(tmp_path: Path) -> None:
    job = make_job(tmp_path, tasks=10, attempts=4, seed=3)  # a seed whose job has infrastructure failures
    records = list(JobFolder(job).latest().values())
    a = analyze(records)
    # The summary's headline numbers, computed here from the records themselves.
    judged = [0.0 if r.reward is None else r.reward for r in records if not r.rerun]  # infrastructure's are not judged
    assert len(judged) < len(records)  # the job has some, or the next lines could not tell them from zeros
    assert a.summary["episodes"] == 40 and a.summary["mean_reward"] == pytest.approx(float(np.mean(judged)))
    assert a.summary["completed"] == len(judged) and a.summary["not_judged"] == 40 - len(judged)
    assert a.summary["failures"] == dict(sorted(Counter(r.error_class for r in records if r.error_class).items()))
    assert not a.sweep and len(a.groups) == 1
    assert sum(a.outcomes.values()) == len(records) == 40
    assert a.outcomes.get(SOLVED, 0) == sum(r.score >= 1.0 for r in records if not r.rerun)
    # The percentiles of one phase, against numpy on the records' own spans.
    agent = [sum(p.seconds for p in r.phases if p.phase == "agent") for r in records if any(p.phase == "agent" for p in r.phases)]
    row = next(p for p in a.phases if p["phase"] == "agent")
    assert row["count"] == len(agent)
    assert row["p50"] == pytest.approx(float(np.percentile(agent, 50)))
    assert row["p99"] == pytest.approx(float(np.percentile(agent, 99)))
    assert [p["phase"] for p in a.phases] == ["start", "agent", "verify", "stop"]
    # One task row per task; its failed count is every episode not solved.
    assert len(a.tasks) == 10
    for t in a.tasks:
        rs = [r for r in records if r.task_path == t["path"]]
        assert t["n"] == len(rs)
        assert t["failed"] == sum(1 for r in rs if r.rerun or r.score < 1.0)
        scored = [0.0 if r.reward is None else r.reward for r in rs if not r.rerun]
        assert t["mean"] == (pytest.approx(float(np.mean(scored))) if scored else None)


def test_sweep_groups_by_checkpoint_with_paired_differences(tmp_path: Path) -> None:
    job = make_job(tmp_path, tasks=8, attempts=2, models=SWEEP)
    records = list(JobFolder(job).latest().values())
    a = analyze(records)
    assert a.sweep
    assert [g.label for g in a.groups] == ["step-100", "step-200", "step-1000"]  # natural order, not text order
    by_ckpt = {c: [r for r in records if r.checkpoint == c] for _, c in SWEEP}
    last_scores = [r.score for r in by_ckpt["step-1000"]]
    assert a.groups[2].summary["mean_reward"] == pytest.approx(float(np.mean(last_scores)))

    def task_means(rs):  # each task's mean reward, computed here
        means: dict[str, list[float]] = {}
        for r in rs:
            means.setdefault(r.task_path, []).append(r.score)
        return {k: float(np.mean(v)) for k, v in means.items()}

    first, final = task_means(by_ckpt["step-100"]), task_means(by_ckpt["step-1000"])
    expected = float(np.mean([final[k] - first[k] for k in first]))
    last = a.differences[-1]
    assert last["label"] == "step-1000" and last["base"] == "step-100"
    assert last["difference"] == pytest.approx(expected)
    low, high = last["ci"]
    assert low <= expected <= high  # a bootstrap interval around the difference
    assert {row["path"]: row["diff"] for row in last["per_task"]} == pytest.approx({k: final[k] - first[k] for k in first})
    rows = a.difference_rows()
    assert len(rows) == 8 and all(len(r["diffs"]) == 2 for r in rows)
    assert [r["diffs"][-1] for r in rows] == sorted(r["diffs"][-1] for r in rows)  # worst first


def test_report_is_one_self_contained_file(tmp_path: Path) -> None:
    job = make_job(tmp_path, tasks=6, attempts=2)
    page = render(job)
    assert page.startswith("<!DOCTYPE html>")
    # Nothing is fetched: no external script, stylesheet, image, font or frame.
    assert not re.search(r'(src|href)\s*=\s*"(?!data:|#)', page), "a resource outside the file"
    assert "<link rel=\"stylesheet\"" not in page and "@import" not in page and "url(http" not in page
    assert "default-src 'none'" in page
    # The inlined code cannot end its own <script>/<style> element early.
    for asset in (REPO / "harbor_async" / "report" / "static").iterdir():
        text = asset.read_text().lower()
        assert "</script" not in text and "</style" not in text and "<!--" not in text, asset.name
    assert page.count('<img src="data:image/svg+xml;base64,') == 2  # outcomes and phases charts
    # Every episode is embedded, compressed, and decodes to its record.
    records = list(JobFolder(job).latest().values())
    blobs = dict(BLOB.findall(page))
    assert len(blobs) == len(records) == 12
    for i, record in enumerate(records):
        details = unpack_episode(blobs[str(i)])
        assert details["transcript"] == (record.transcript or [])
        assert details["rewards"] == record.rewards and details["verifier_output"] == record.verifier_output
    data = _data(page)
    assert len(data["episodes"]) == 12 and len(data["tasks"]) == 6


def test_everything_is_escaped(tmp_path: Path) -> None:
    evil_task = "evil<b>task</b>"
    job = make_job(tmp_path, tasks=3, attempts=1, evil_task=evil_task)
    config = json.loads((job / SETTINGS_NAME).read_text())
    config["note"] = "</script><script>alert(1)</script>"
    (job / SETTINGS_NAME).write_text(json.dumps(config))
    page = render(job)
    # The only <script> elements are the page's own code and its inert data blocks.
    scripts = re.findall(r"<script\b[^>]*>", page)
    assert all('nonce="' in s or 'type="application/' in s for s in scripts), scripts
    assert page.count("</script>") == len(scripts)
    assert EVIL not in page and "<script>alert(1)</script>" not in page and "<b>task</b>" not in page
    assert html.escape(config["note"], quote=False) in page  # config.json shown as text
    # The task name reaches the page's script as JSON text, which JavaScript reads back unchanged.
    assert any(t["task"] == evil_task for t in _data(page)["tasks"])
    assert script_json({"x": "</script><!--"}) == '{"x":"\\u003c/script\\u003e\\u003c!--"}'


@pytest.mark.slow
def test_benchmark_results_report(tmp_path: Path) -> None:
    source = load_source(REPO / "benchmarks" / "results")
    kinds = sorted({r.data["benchmark"] for r in source.results})
    assert {"grpo-step", "overhead", "throughput"} <= set(kinds)  # and the trainer, docker-step and cluster results
    out = write_report(REPO / "benchmarks" / "results", tmp_path / "bench.html")
    page = out.read_text()
    for result in source.results:
        assert f">{result.name} <span" in page
    saved = sum(1 for r in source.results if r.plot)
    assert page.count('src="data:image/png;base64,') == saved  # the saved step-time plots
    assert page.count('src="data:image/svg+xml;base64,') >= 6  # throughput and latency of each throughput result
    single = load_source(REPO / "benchmarks" / "results" / "overhead.json")
    assert [r.name for r in single.results] == ["overhead"]
    assert default_output(REPO / "benchmarks" / "results" / "overhead.json").name == "overhead.html"


def test_unknown_paths_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ReportSourceError):
        load_source(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportSourceError):
        load_source(tmp_path / "empty")
    (tmp_path / "x.json").write_text('{"not": "a benchmark"}')
    with pytest.raises(ReportSourceError):
        load_source(tmp_path / "x.json")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "empty")])
    assert result.exit_code == 2


def test_report_of_a_running_job_shows_finished_episodes(tmp_path: Path) -> None:
    """No summary.json yet, a torn last line (a writer killed mid-line): the report shows what finished."""
    job = make_job(tmp_path, tasks=4, attempts=1)
    with open(job / EPISODES_NAME, "a") as fh:
        fh.write('{"task": "half-writ')
    page = render(job)
    assert "running or stopped" in page
    assert len(_data(page)["episodes"]) == 4


def test_report_of_a_job_with_no_episodes_yet(tmp_path: Path) -> None:
    job = JobFolder.create(tmp_path, "just-started", {"command": "eval"})
    page = render(job.path)
    assert "running or stopped" in page and _data(page)["episodes"] == []
    assert "No phase timings" in page


@pytest.mark.slow
def test_cli_report_of_a_real_run(tmp_path: Path, suite_root: Path) -> None:
    """A real `harbor-async run` on the bundled suite (local backend), then `harbor-async report` of its job folder."""
    job = tmp_path / "jobs" / "run-job"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    ran = subprocess.run(
        [
            sys.executable, "-m", "harbor_async", "run", str(suite_root), "-l", "4", "-n", "4",
            "-o", str(job.parent), "--job-name", job.name,
        ],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    made = subprocess.run(
        [sys.executable, "-m", "harbor_async", "report", str(job)], capture_output=True, text=True, timeout=120, env=env
    )
    assert made.returncode == 0, made.stderr[-2000:]
    page = (job / "report.html").read_text()
    data = _data(page)
    assert len(data["episodes"]) == 4
    assert all(e["o"] == SOLVED and e["d"] > 0 for e in data["episodes"])  # oracle solves all, with timings
    assert '<span class="badge kind">run</span>' in page
    assert "<td>verify</td>" in page  # per-phase timing from the records' seconds
    custom = CliRunner().invoke(app, ["report", str(job), "--output", str(tmp_path / "elsewhere.html")])
    assert custom.exit_code == 0, custom.output
    assert (tmp_path / "elsewhere.html").read_text().count("ep-") >= 4


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.status, answer.read().decode()


def test_view_server_rebuilds_when_a_record_is_appended(tmp_path: Path) -> None:
    job_path = make_job(tmp_path, tasks=3, attempts=1)
    server = ReportServer(job_path, port=0)
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        status, page = _get(url)
        assert status == 200 and len(_data(page)["episodes"]) == 3
        _, v1 = _get(url + "__version")
        assert f'data-version="{v1}"' in page and "__version" in page  # the live script polls it
        job = JobFolder.open(job_path)
        job.append(EpisodeRecord(task="task-late", model="test-model", reward=0.0, seconds={"agent": 1.0}))
        job.close()
        _, v2 = _get(url + "__version")
        assert v2 != v1
        _, page2 = _get(url)
        assert len(_data(page2)["episodes"]) == 4 and f'data-version="{v2}"' in page2
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get(url + "elsewhere")
        assert missing.value.code == 404
    finally:
        server.stop()


def test_view_server_answers_only_its_own_host(tmp_path: Path) -> None:
    """A rebound name (DNS rebinding: evil.example -> 127.0.0.1) gets nothing of the report."""
    server = ReportServer(make_job(tmp_path, tasks=2, attempts=1), port=0)
    url = server.start()
    port = server.server_address[1]
    try:
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", ""):
            request = urllib.request.Request(url, headers={"Host": host})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == 421 and b"episodes" not in refused.value.read()
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Host": host}), timeout=30) as answer:
                assert answer.status == 200
    finally:
        server.stop()


@pytest.mark.slow
def test_cli_view_serves_on_localhost(tmp_path: Path) -> None:
    """`harbor-async view JOB --port 0` in its own process: prints its address, serves the page, stops on SIGINT."""
    job = make_job(tmp_path, tasks=2, attempts=1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "harbor_async", "view", str(job), "--port", "0"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "serving" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "view exited before serving"
        found = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert found, line
        status, page = _get(found.group(0))
        assert status == 200 and len(_data(page)["episodes"]) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_outcome_names(tmp_path: Path) -> None:
    job = make_job(tmp_path, tasks=30, attempts=2, seed=5)
    a = analyze(list(JobFolder(job).latest().values()))
    assert set(a.outcomes) <= {SOLVED, UNSOLVED, "agent", "verifier", "infrastructure", "model_server", "cancelled"}
    assert "infrastructure" in a.outcomes and UNSOLVED in a.outcomes


def test_a_job_folder_of_the_previous_release_is_reported(tmp_path: Path) -> None:
    """Its settings file was config.json: the report still finds the job and shows its settings."""
    job = make_job(tmp_path, tasks=2, attempts=1)
    settings = json.loads((job / SETTINGS_NAME).read_text())
    (job / SETTINGS_NAME).unlink()
    (job / "config.json").write_text(json.dumps({**settings, "note": "written by the previous release"}))
    source = load_source(job)
    assert source.config["note"] == "written by the previous release" and len(source.records) == 2
    assert "written by the previous release" in render(job)


def test_a_resumed_job_of_the_previous_release_counts_each_episode_once(tmp_path: Path) -> None:
    """A run job of the previous release: records by absolute path, then today's rerun of one by its suite path."""
    job = tmp_path / "old-run"
    job.mkdir()
    suite = tmp_path / "suite" / "tasks"
    legacy = {"command": "run", "settings": {"source": str(suite), "env": "local"}, "episodes": []}
    (job / "config.json").write_text(json.dumps(legacy))
    old = [EpisodeRecord(task=t, task_path=str(suite / t), error_class="infrastructure" if t == "t1" else None,
                         reward=None if t == "t1" else 1.0) for t in ("t1", "t2")]  # fmt: skip
    rerun = EpisodeRecord(task="t1", task_path="t1", reward=1.0)
    (job / EPISODES_NAME).write_text("".join(json.dumps(r.to_dict()) + "\n" for r in [*old, rerun]))
    source = load_source(job)
    assert sorted((r.task_path, r.reward) for r in source.records) == [("t1", 1.0), ("t2", 1.0)]


def test_a_sweep_follows_the_command_lines_order_and_its_base(tmp_path: Path) -> None:
    # `-m weak-model -m good-model`: weak-model is the base, in the CLI's table, the CSV, the plot and here.
    job = make_job(tmp_path, tasks=6, attempts=2, models=[("weak-model", None), ("good-model", None)])
    settings = JobFolder(job).path / "harbor-async.json"
    config = json.loads(settings.read_text()) if settings.is_file() else {}
    config["models"] = ["weak-model", "good-model"]
    settings.write_text(json.dumps(config))
    (JobFolder(job).path / "config.json").unlink(missing_ok=True)
    page = render(job)
    groups = re.findall(r'<tr><td>([a-z-]+)</td><td>\d+</td>', page)
    assert groups[:2] == ["weak-model", "good-model"]  # not alphabetical (good < weak)
    assert "paired difference from weak-model (tasks run by both" in page  # the base is the first given
    assert _data(page)["groups"] == ["weak-model", "good-model"]


def test_an_incomplete_job_says_so_and_never_shows_an_unjudged_episode_as_zero(tmp_path: Path) -> None:
    job = make_job(tmp_path, tasks=10, attempts=4, seed=3)  # some infrastructure failures
    records = list(JobFolder(job).latest().values())
    summary = {"complete": False, "planned_episodes": 50, "interrupted_by": "SIGINT"}
    (job / "summary.json").write_text(json.dumps(summary))
    page = render(job)
    header = re.search(r'<span class="badge incomplete"[^>]*>(.*?)</span>', page)
    assert header and header.group(1) == f"incomplete: {len(records)} of 50 episodes, {50 - len(records)} missing (interrupted by SIGINT)"
    assert "finished</span>" not in page
    # A job stopped by its failures (a dead model server), not by a signal: its summary has no interrupted_by.
    (job / "summary.json").write_text(json.dumps({"complete": False, "planned_episodes": 50, "stopped_by": "the model server failed 5 episodes in a row"}))
    stopped = re.search(r'<span class="badge incomplete"[^>]*>(.*?)</span>', render(job))
    assert stopped and stopped.group(1).endswith("missing (the model server failed 5 episodes in a row)")
    (job / "summary.json").write_text(json.dumps({"complete": False, "planned_episodes": 50}))  # neither
    assert re.search(r'<span class="badge incomplete"[^>]*>[^<]*missing</span>', render(job))
    data = _data(page)
    unjudged = {e["i"] for e in data["episodes"] if e["o"] in ("infrastructure", "model_server", "cancelled")}
    assert unjudged  # the test means something only with some
    assert all(e["r"] is None for e in data["episodes"] if e["i"] in unjudged)  # no reward, so no 0 to draw
    for task in data["tasks"]:  # a task's mean is over its judged episodes only
        scored = [data["episodes"][i]["r"] or 0.0 for i in task["episodes"] if i not in unjudged]
        assert task["mean"] == (pytest.approx(sum(scored) / len(scored)) if scored else None)


def test_a_timeline_without_spans_lays_out_the_lifecycle_and_never_a_total() -> None:
    from harbor_async.report.analysis import episode_phases

    # An eval record of an earlier release: no spans, and parts and sums among the seconds.
    old = EpisodeRecord(task="t", seconds={"start": 0.5, "exec": 0.2, "verify": 0.3, "stop": 0.1, "model": 1.0, "tools": 0.4, "total": 2.3})
    spans = episode_phases(old)
    assert [s["phase"] for s in spans] == ["start", "agent", "verify", "stop"]  # the model call before verify
    assert spans[1]["end"] - spans[1]["start"] == pytest.approx(1.4) and spans[-1]["end"] == pytest.approx(2.3)
    assert all(s["phase"] != "total" for s in spans)
    a = analyze([old])
    assert [row["phase"] for row in a.phases] == ["start", "agent", "verify", "stop"]
