"""The progress line of run and eval: the mean over the judged, failures by class, an ETA."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from harbor_async.cli.progress import EpisodeProgress
from harbor_async.core.records import EpisodeRecord


def test_the_line_shows_the_mean_over_the_judged_the_failures_by_class_and_an_eta() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)
    with EpisodeProgress(console) as progress:
        progress.plan(5)
        progress.record(EpisodeRecord(task="a", reward=1.0))
        progress.record(EpisodeRecord(task="b", reward=0.0, error_class="agent"))  # the model's failure: a 0
        progress.record(EpisodeRecord(task="c", reward=None, error_class="infrastructure"))  # not a 0
        progress.status("server: 503")
        progress.bar.refresh()
    shown = out.getvalue()
    assert "3/5" in shown and "mean reward 0.500 over 2 judged" in shown
    assert "failures: agent 1, infrastructure 1" in shown
    assert "ETA" in shown and "server: 503" in shown


def test_nothing_judged_shows_no_mean() -> None:
    progress = EpisodeProgress(Console(file=io.StringIO()), disable=True)
    progress.plan(2)
    progress.record(EpisodeRecord(task="a", reward=None, error_class="model_server"))
    assert progress.mean_text() == "-" and progress.failures_text() == "  failures: model_server 1"


@pytest.mark.slow
def test_run_and_eval_show_it(tmp_path) -> None:
    """Both commands' line: half of the starts fail for good (infrastructure, not a 0), the rest solve."""
    from harbor_async.suites import example_suite_path
    from tests.cli_helpers import harbor_async
    from tests.scripted_server import ScriptedServer

    fails = ["-e", "simulated", "--ek", "start_permanent_failure_rate=1.0", "-l", "2"]
    ran = harbor_async("run", *fails, "-o", str(tmp_path / "run"))
    assert ran.returncode == 1
    assert "0/2" not in ran.stderr and "2/2" in ran.stderr and "mean reward -" in ran.stderr, ran.stderr
    assert "failures: infrastructure 2" in ran.stderr, ran.stderr
    solved = harbor_async("run", "-e", "simulated", "-l", "3", "-o", str(tmp_path / "run"))
    assert "mean reward 1.000 over 3 judged" in solved.stderr and "ETA" in solved.stderr, solved.stderr
    with ScriptedServer(example_suite_path() / "tasks") as server:
        evaluated = harbor_async(
            "eval", "-p", str(example_suite_path()), "-l", "2", "-e", "simulated", "-m", "solver",
            "--base-url", server.base_url, "-o", str(tmp_path / "eval"),
        )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "2/2" in evaluated.stderr and "mean reward 1.000 over 2 judged" in evaluated.stderr, evaluated.stderr
