"""The progress line of ``run`` and ``eval``: episodes done, the mean reward over the judged, failures by class, ETA.

A reward *sum* says nothing while a job runs, and an episode nobody judged
(infrastructure, the model server, an interruption) is not a 0: the mean is
over the judged episodes only, as every score of the project is, and the
unjudged are counted beside it by class.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from harbor_async.core.printing import escape_controls
from harbor_async.core.records import EpisodeRecord

#: Characters of a status text (the model server's answer while it is awaited) shown on the line.
STATUS_CHARS = 160


class EpisodeProgress:
    """A rich progress bar over a batch's episodes; :meth:`record` each as it ends."""

    def __init__(self, console: Console, *, disable: bool = False) -> None:
        self.bar = Progress(
            TextColumn("[bold]episodes"), BarColumn(), MofNCompleteColumn(),
            TextColumn("mean reward {task.fields[mean]}{task.fields[failures]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console, transient=False, disable=disable,
        )  # fmt: skip
        self.task: Any = None
        self.judged = 0
        self.reward_total = 0.0
        self.failures: dict[str, int] = {}

    def __enter__(self) -> EpisodeProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def plan(self, pending: int) -> None:
        """Start the bar over the ``pending`` episodes this invocation runs."""
        self.task = self.bar.add_task("episodes", total=pending, mean="-", failures="", status="")

    def more(self, episodes: int) -> None:
        """Add ``episodes`` to the bar's total (a retry round)."""
        if self.task is not None:
            self.bar.update(self.task, total=(self.bar.tasks[0].total or 0) + episodes)

    def status(self, text: str) -> None:
        """A passing word on the line (what the model server answers while it is awaited)."""
        if self.task is not None:
            self.bar.update(self.task, status=escape_controls(text)[:STATUS_CHARS])

    def record(self, record: EpisodeRecord) -> None:
        """Count one finished episode: into the mean when judged, else under its failure class."""
        if record.judged:
            self.judged += 1
            self.reward_total += record.score
        if record.error_class is not None:
            self.failures[record.error_class] = self.failures.get(record.error_class, 0) + 1
        if self.task is not None:
            self.bar.update(self.task, advance=1, mean=self.mean_text(), failures=self.failures_text())

    def mean_text(self) -> str:
        """The mean reward over the judged episodes so far, or ``-`` before the first."""
        return f"{self.reward_total / self.judged:.3f} over {self.judged} judged" if self.judged else "-"

    def failures_text(self) -> str:
        """``  failures: agent 2, infrastructure 1`` (empty with none)."""
        if not self.failures:
            return ""
        return "  failures: " + ", ".join(f"{name} {count}" for name, count in sorted(self.failures.items()))
