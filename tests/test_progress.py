"""The progress line of run and eval: the mean over the judged, failures by class, an ETA."""

from __future__ import annotations

import io

from rich.console import Console

from harbor_async.cli.progress import EpisodeProgress
from harbor_async.records import EpisodeRecord


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
