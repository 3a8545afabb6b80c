"""What ``run`` prints at its end: the table of episodes and the job's summary line."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.table import Table
from rich.text import Text

from harbor_async.cli.common import out
from harbor_async.core.printing import escape_controls
from harbor_async.core.records import EpisodeRecord

#: The phases of an episode, in order: the table's columns.
PHASES = ("start", "agent", "verify", "stop")


def print_table(records: list[EpisodeRecord]) -> None:
    """One row per episode: its reward, the seconds of each phase, its failure."""
    if not records:
        return
    names = Counter(name for name, _ in {(r.task, r.task_path) for r in records})
    attempts = any(r.attempt for r in records)
    table = Table(title="episodes")
    table.add_column("task", overflow="fold")
    if attempts:
        table.add_column("attempt", justify="right")
    table.add_column("reward", justify="right")
    used = [p for p in PHASES if any(s.phase == p for r in records for s in r.phases)]
    for phase in used:
        table.add_column(f"{phase} s", justify="right")
    table.add_column("failure")
    table.add_column("error", overflow="fold", ratio=1)
    for r in records:
        spans = {s.phase: s.seconds for s in r.phases}
        name = r.task if names[r.task] == 1 else r.task_path  # same names: tell them apart by path
        row: list[str | Text] = [Text(escape_controls(name))]
        if attempts:
            row.append(str(r.attempt))
        row.append("-" if r.reward is None else f"{r.reward:g}")
        row += [f"{spans[p]:.3f}" if p in spans else "" for p in used]
        row += [Text(r.error_class or ""), Text(escape_controls(r.error or ""))]
        table.add_row(*row)
    out.print(table)


def print_summary(summary: dict[str, Any], records: list[EpisodeRecord]) -> None:
    """The job's one line: the mean over the judged, what was not judged and why, the failures; then pass@k."""
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    failures = ", ".join(f"{n} {cls}" for cls, n in summary["failures"].items()) or "none"
    by_class = dict(summary["not_judged_by_class"])
    disabled = by_class.pop("verification_disabled", 0)  # asked for (--disable-verification): nothing to rerun
    unjudged = ", ".join(f"{n} {cls}" for cls, n in by_class.items())
    fix = "; fix invalid tasks first" if "invalid_task" in by_class else ""
    out.print(Text(
        f"{summary['episodes']} episodes: mean reward {fmt(summary['mean_reward'])} over the {summary['completed']} judged"
        + (f", {summary['not_judged'] - disabled} not judged ({unjudged}: rerun by --resume{fix})" if by_class else "")
        + (f", {disabled} not verified (--disable-verification)" if disabled else "")
        + f"; failures: {failures}"
        + (f"; {summary['sandbox_seconds']:.1f} sandbox-seconds" if summary.get("sandbox_seconds") else "")
    ))  # fmt: skip
    if summary["pass_at_k"]:
        out.print(Text("  ".join(f"pass@{k} {fmt(v['value'])}" for k, v in summary["pass_at_k"].items())))
