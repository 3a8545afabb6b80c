"""The figures of a job's report, computed from its records.

Everything here is plain data (numbers, strings, lists, dicts) for the
templates and the page's script; the scores come from :mod:`harbor_async.jobs.scoring`
so that the report agrees with ``summary.json`` and the command line.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harbor_async.core.records import EpisodeRecord
from harbor_async.core.usage import RESOURCE_FIELDS, SUMMED_FIELDS
from harbor_async.jobs.scoring import (
    DEFAULT_SUCCESS_THRESHOLD,
    paired_difference,
    summarize,
)

#: Percentiles of each phase's seconds shown in the summary.
PERCENTILES = (50, 90, 95, 99)
#: Phases in the order an episode goes through them; others follow by name.
PHASE_ORDER = ("start", "agent", "exec", "verify", "stop")
#: An episode's phases, in the order they run (what a timeline lays out).
LIFECYCLE = ("start", "agent", "verify", "stop")

SOLVED = "solved"
UNSOLVED = "unsolved"
#: Outcomes of episodes the model was not judged on (rerun by a resume, never scored).
NOT_JUDGED = frozenset({"infrastructure", "model_server", "cancelled", "invalid_task"})


@dataclass
class GroupSummary:
    """One model or checkpoint of a job: its label and :func:`~harbor_async.jobs.scoring.summarize` of its records."""

    label: str
    records: list[EpisodeRecord]
    summary: dict[str, Any]


@dataclass
class JobAnalysis:
    """What a job's report shows, except the transcripts (see :mod:`harbor_async.report.pack`)."""

    records: list[EpisodeRecord]
    threshold: float
    summary: dict[str, Any]
    groups: list[GroupSummary]
    outcomes: dict[str, int]
    phases: list[dict[str, Any]]
    episodes: list[dict[str, Any]]
    tasks: list[dict[str, Any]]
    differences: list[dict[str, Any]] = field(default_factory=list)
    #: per task (and model), what its sandboxes used, with the job's totals first (see :func:`resource_rows`)
    resources: list[dict[str, Any]] = field(default_factory=list)

    @property
    def sweep(self) -> bool:
        """Whether the records name several models or checkpoints."""
        return len(self.groups) > 1

    def group_ks(self) -> list[str]:
        """The k of pass@k that any model or checkpoint has (each has up to its fewest attempts of a task)."""
        return sorted({k for g in self.groups for k in g.summary["pass_at_k"]}, key=int)

    def difference_rows(self) -> list[dict[str, Any]]:
        """Per task: its difference from the first checkpoint at each later one (``None`` where not run)."""
        rows: dict[str, dict[str, Any]] = {}
        for column, diff in enumerate(self.differences):
            for row in diff["per_task"]:
                entry = rows.setdefault(row["path"], {"task": row["task"], "path": row["path"], "diffs": [None] * len(self.differences)})
                entry["diffs"][column] = row["diff"]
        # Worst change at the last checkpoint first: what regressed is what one looks for.
        return sorted(rows.values(), key=lambda r: (r["diffs"][-1] is None, r["diffs"][-1] or 0.0, natural_key(r["task"])))


def analyze(
    records: list[EpisodeRecord], *, success_threshold: float | None = None, model_order: list[str] | None = None
) -> JobAnalysis:
    """Summaries, outcomes, phase percentiles, the episode index and per-task rows of ``records``.

    ``model_order``: the job's models as its command line gave them (``-m A -m B``): groups, and
    so the sweep's base (the first), follow it, as the CLI's table, ``sweep.csv`` and
    ``sweep.png`` do; without it, checkpoints by step, then names.
    """
    threshold = DEFAULT_SUCCESS_THRESHOLD if success_threshold is None else success_threshold
    labels = group_labels(records)
    grouped: dict[str, list[EpisodeRecord]] = {}
    first_model: dict[str, str | None] = {}
    for record, label in zip(records, labels, strict=True):
        grouped.setdefault(label, []).append(record)
        first_model.setdefault(label, record.model)
    position = {name: i for i, name in enumerate(model_order or [])}
    order = sorted(grouped, key=lambda g: (position.get(first_model[g] or "", len(position)), natural_key(g)))
    groups = [GroupSummary(g, grouped[g], summarize(grouped[g], success_threshold=threshold)) for g in order]
    episodes = [_episode_row(i, r, label, threshold) for i, (r, label) in enumerate(zip(records, labels, strict=True))]
    analysis = JobAnalysis(
        records=records,
        threshold=threshold,
        summary=summarize(records, success_threshold=threshold),
        groups=groups,
        outcomes=dict(Counter(e["o"] for e in episodes).most_common()),
        phases=phase_percentiles(records),
        episodes=episodes,
        tasks=_task_rows(episodes, order),
        resources=resource_rows(records, labels),
    )
    if analysis.sweep:
        analysis.differences = _differences(groups)
    return analysis


def resource_rows(records: list[EpisodeRecord], labels: list[str] | None = None) -> list[dict[str, Any]]:
    """What the sandboxes used: the whole job first (``task`` ``None``), then one row per (model, task).

    Each row: ``measured`` episodes (with a ``resources`` record), ``sandbox_seconds`` and
    ``cpu_seconds`` summed, and the highest ``memory_peak_bytes``, ``disk_written_bytes`` and
    ``processes_peak`` of any of them (``None`` where none was measured). Empty: no record has any.
    """
    labels = labels if labels is not None else group_labels(records)
    rows: dict[tuple[str, str] | None, dict[str, Any]] = {}
    for record, label in zip(records, labels, strict=True):
        if not record.resources:
            continue
        for key in (None, (label, record.task_path or record.task)):
            row = rows.setdefault(key, {
                "task": None if key is None else record.task, "group": None if key is None else label, "measured": 0,
                **dict.fromkeys(RESOURCE_FIELDS),
            })  # fmt: skip
            row["measured"] += 1
            for name in RESOURCE_FIELDS:
                value, old = record.resources.get(name), row[name]
                if value is not None:
                    row[name] = value if old is None else old + value if name in SUMMED_FIELDS else max(old, value)
    if not rows:
        return []
    total = rows.pop(None)
    return [total, *sorted(rows.values(), key=lambda r: (r["group"], natural_key(r["task"])))]


def group_labels(records: list[EpisodeRecord]) -> list[str]:
    """Each record's model or checkpoint label: the checkpoint where checkpoints tell the records apart."""
    pairs = {(r.model, r.checkpoint) for r in records}
    checkpoints = {c for _, c in pairs}
    models = {m for m, _ in pairs}
    if None not in checkpoints and len(checkpoints) == len(pairs):
        return [str(r.checkpoint) for r in records]
    if len(models) == len(pairs):
        return [r.model or "" for r in records]
    return [f"{r.model or ''} @ {r.checkpoint}" if r.checkpoint else r.model or "" for r in records]


def natural_key(text: str) -> list[Any]:
    """Sort key that orders ``step-900`` before ``step-1000``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part]


def outcome(record: EpisodeRecord, threshold: float) -> str:
    """``solved``, ``unsolved`` or the failure class of an episode.

    A failure that was judged anyway (a verifier or agent failure with a reward
    at or above the threshold) counts as solved: the reward is what scores.
    """
    if not record.judged:
        return record.unjudged_as
    if record.score >= threshold:
        return SOLVED
    return record.error_class or UNSOLVED


def episode_phases(record: EpisodeRecord) -> list[dict[str, Any]]:
    """The episode's phases as ``{phase, start, end}``: its spans, else its lifecycle ``seconds`` end to end.

    Records of earlier releases (eval's had no spans) carry ``seconds`` with
    parts and sums beside the phases (``model`` and ``tools`` are the agent
    phase's parts, ``exec`` its commands, ``total`` their sum): only the
    lifecycle phases are laid out, in their order, and ``total`` never is one.
    """
    if record.phases:
        return [{"phase": p.phase, "start": p.start, "end": p.end} for p in record.phases]
    seconds = {k: float(v) for k, v in record.seconds.items()}
    if "agent" not in seconds and ("model" in seconds or "tools" in seconds):
        seconds["agent"] = seconds.get("model", 0.0) + seconds.get("tools", 0.0)
    spans, at = [], 0.0
    for phase in LIFECYCLE:
        if phase in seconds:
            spans.append({"phase": phase, "start": at, "end": at + seconds[phase]})
            at += seconds[phase]
    return spans


def phase_seconds(record: EpisodeRecord) -> dict[str, float]:
    """Seconds spent in each phase (a phase that ran more than once is added up)."""
    totals: dict[str, float] = {}
    for span in episode_phases(record):
        totals[span["phase"]] = totals.get(span["phase"], 0.0) + span["end"] - span["start"]
    return totals


def phase_percentiles(records: list[EpisodeRecord]) -> list[dict[str, Any]]:
    """Per phase: count, mean, the :data:`PERCENTILES` and max of its seconds, plus the raw values for a chart."""
    values: dict[str, list[float]] = {}
    for record in records:
        for phase, seconds in phase_seconds(record).items():
            values.setdefault(phase, []).append(seconds)
    rows = []
    for phase in sorted(values, key=_phase_rank):
        data = np.asarray(values[phase], dtype=float)
        row: dict[str, Any] = {"phase": phase, "count": len(data), "mean": float(data.mean()), "max": float(data.max())}
        for p, v in zip(PERCENTILES, np.percentile(data, PERCENTILES), strict=True):
            row[f"p{p}"] = float(v)
        row["values"] = data
        rows.append(row)
    return rows


def _phase_rank(phase: str) -> tuple[int, str]:
    return (PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER), phase)


def _episode_row(index: int, record: EpisodeRecord, label: str, threshold: float) -> dict[str, Any]:
    """One episode in the page's index (short keys: 10,000 of these are embedded)."""
    spans = episode_phases(record)
    return {
        "i": index,
        "t": record.task,
        "p": record.task_path or record.task,
        "a": record.attempt,
        "g": label,
        "r": record.reward,
        "o": outcome(record, threshold),
        "e": record.error_class,
        "d": round(max((s["end"] for s in spans), default=0.0), 4),
        "n": len(record.transcript or []),
    }


def _task_rows(episodes: list[dict[str, Any]], groups: list[str]) -> list[dict[str, Any]]:
    """One row per (model, task): its episodes, mean reward, solved count, failure classes."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for e in episodes:
        row = rows.setdefault(
            (e["g"], e["p"]),
            {"task": e["t"], "path": e["p"], "group": e["g"], "episodes": [], "rewards": [], "errors": Counter(), "secs": []},
        )
        row["episodes"].append(e["i"])
        if e["o"] not in NOT_JUDGED:  # an infrastructure, model-server or cancelled failure is never a 0
            row["rewards"].append(0.0 if e["r"] is None else float(e["r"]))
        row["secs"].append(e["d"])
        if e["o"] != SOLVED:
            row["errors"][e["e"] or UNSOLVED] += 1
    rank = {g: i for i, g in enumerate(groups)}
    attempts = {e["i"]: e["a"] for e in episodes}
    out = []
    for row in sorted(rows.values(), key=lambda r: (rank[r["group"]], natural_key(r["task"]))):
        solved = len(row["episodes"]) - sum(row["errors"].values())
        out.append({
            "task": row["task"],
            "path": row["path"],
            "group": row["group"],
            "n": len(row["episodes"]),
            "mean": float(np.mean(row["rewards"])) if row["rewards"] else None,
            "solved": solved,
            "failed": len(row["episodes"]) - solved,
            "errors": dict(row["errors"]),
            "secs": float(np.mean(row["secs"])),
            "episodes": sorted(row["episodes"], key=lambda i: attempts[i]),  # #0 #1 #2, whatever finished first
        })  # fmt: skip
    return out


def _differences(groups: list[GroupSummary]) -> list[dict[str, Any]]:
    """Each later group against the first: the paired mean difference, its interval, each task's difference."""
    base = groups[0]
    out = []
    for other in groups[1:]:
        diff = paired_difference(base.records, other.records)
        names = {r.task_path or r.task: r.task for r in other.records}
        per_task = sorted(
            ({"task": names.get(key, key), "path": key, "diff": value} for key, value in diff["per_task"].items()),
            key=lambda row: (row["diff"], natural_key(row["task"])),
        )
        out.append({
            "base": base.label,
            "label": other.label,
            "tasks": diff["tasks"],
            "difference": diff["difference"],
            "ci": diff["ci"],
            "better": sum(row["diff"] > 0 for row in per_task),
            "worse": sum(row["diff"] < 0 for row in per_task),
            "per_task": per_task,
        })  # fmt: skip
    return out
