"""Scores of a job: mean reward, the unbiased pass@k, bootstrap intervals over tasks.

Used alike by ``run``, ``eval``, the report and cluster runs, so that one job
folder gives one summary whoever reads it. Resampling uses a fixed seed: the
same records give the same summary.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from harbor_async.core.records import EpisodeRecord

#: Reward at or above which an episode counts as solved, unless told otherwise.
DEFAULT_SUCCESS_THRESHOLD = 1.0
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` passed.

    ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021), computed as a product so
    that it stays exact for large ``n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def by_task(records: Iterable[EpisodeRecord]) -> dict[str, list[EpisodeRecord]]:
    """Records grouped by task path (name when no path), in first-seen order."""
    groups: dict[str, list[EpisodeRecord]] = defaultdict(list)
    for record in records:
        groups[record.task_path or record.task].append(record)
    return dict(groups)


def bootstrap_interval(
    values: Sequence[float] | np.ndarray, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float] | None:
    """A percentile bootstrap interval of the mean of ``values`` (``None`` for fewer than 2)."""
    if len(values) < 2:
        return None
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, len(data), size=(samples, len(data)))].mean(axis=1)
    alpha = (1.0 - CONFIDENCE) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


def summarize(
    records: Iterable[EpisodeRecord],
    *,
    k: int | None = None,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
) -> dict[str, Any]:
    """The summary of a job's (latest) records.

    Every score is over the episodes the model was **judged** on: an episode
    that failed for an infrastructure, model-server or cancelled reason says
    nothing about the model, so it is never a 0 here; it is counted in
    ``not_judged`` (by class) and a resume reruns it. An agent or verifier
    failure is judged (its reward, or 0). ``mean_reward`` is the mean over
    judged episodes (``mean_reward_completed``, the name of earlier releases,
    is the same number); pass@k is given for each k from 1 to ``k`` (default:
    the fewest judged attempts of any task) over the tasks with judged
    attempts, each with a bootstrap interval over tasks.
    """
    records = list(records)
    all_tasks = by_task(records)
    tasks = {key: judged for key, rs in all_tasks.items() if (judged := [r for r in rs if r.judged])}
    judged = [r for r in records if r.judged]
    failures = Counter(r.error_class for r in records if r.error_class)
    not_judged = Counter(r.unjudged_as for r in records if not r.judged)
    task_means = [float(np.mean([r.score for r in rs])) for rs in tasks.values()]
    mean = _mean([r.score for r in judged])
    summary: dict[str, Any] = {
        "episodes": len(records),
        "tasks": len(all_tasks),
        "completed": len(judged),
        "not_judged": sum(not_judged.values()),
        "not_judged_by_class": dict(sorted(not_judged.items())),
        "failures": dict(sorted(failures.items())),
        "mean_reward": mean,
        "mean_reward_ci": bootstrap_interval(task_means),
        "mean_reward_completed": mean,
        "success_threshold": success_threshold,
    }
    fewest = min((len(rs) for rs in tasks.values()), default=0)
    k_max = min(k or fewest, fewest)
    pass_k: dict[str, Any] = {}
    for kk in range(1, k_max + 1):
        per_task = [
            pass_at_k(len(rs), sum(r.score >= success_threshold for r in rs), kk) for rs in tasks.values()
        ]
        pass_k[str(kk)] = {"value": _mean(per_task), "ci": bootstrap_interval(per_task)}
    summary["pass_at_k"] = pass_k
    summary["per_task"] = []
    for rs in all_tasks.values():
        scored = [r for r in rs if r.judged]
        summary["per_task"].append({
            "task": rs[0].task,
            "task_path": rs[0].task_path,
            "episodes": len(rs),
            "judged": len(scored),
            "mean_reward": _mean([r.score for r in scored]),
            "solved": sum(r.score >= success_threshold for r in scored),
            "failures": dict(Counter(r.error_class for r in rs if r.error_class)),
        })  # fmt: skip
    usage = usage_totals(records)
    if usage:
        summary["usage"] = usage
    return summary


#: Per-episode gauges in a record's ``usage``, not amounts: never summed over episodes.
_GAUGES = frozenset({"last_total_tokens"})


def usage_totals(records: Iterable[EpisodeRecord]) -> dict[str, float]:
    """Token counts, requests and cost summed over every episode (judged or not: the spend is the same)."""
    totals: dict[str, float] = {}
    for record in records:
        for key, value in (record.usage or {}).items():
            if key not in _GAUGES and isinstance(value, int | float) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
    return dict(sorted(totals.items()))


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def paired_difference(
    base: Iterable[EpisodeRecord],
    other: Iterable[EpisodeRecord],
    *,
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, Any]:
    """The mean reward of ``other`` minus ``base`` over the tasks both were judged on, with a paired bootstrap interval.

    Tasks are shared between checkpoints, so the tasks are resampled together
    (one index draw for both), which removes the task-difficulty variance an
    unpaired interval would carry. Also returns each task's difference.
    """
    a = {key: float(np.mean([r.score for r in rs])) for key, rs in by_task(r for r in base if r.judged).items()}
    b = {key: float(np.mean([r.score for r in rs])) for key, rs in by_task(r for r in other if r.judged).items()}
    shared = [key for key in a if key in b]
    diffs = np.asarray([b[key] - a[key] for key in shared], dtype=float)
    result: dict[str, Any] = {
        "tasks": len(shared),
        "difference": float(diffs.mean()) if len(diffs) else None,
        # Resampling the per-task differences resamples both checkpoints' tasks together.
        "ci": bootstrap_interval(diffs, samples=samples, seed=seed),
        "per_task": {key: float(d) for key, d in zip(shared, diffs, strict=True)},
    }
    return result


def sweep_summary(
    checkpoints: Sequence[tuple[str, int | None, Sequence[EpisodeRecord]]],
    *,
    k: int | None = None,
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD,
) -> dict[str, Any]:
    """Scores of several checkpoints of one suite, in the order given (by step).

    ``checkpoints`` is ``(model, step, records)`` per checkpoint. Returns
    ``rows`` (mean reward and pass@k with their intervals, per checkpoint),
    ``vs_first`` (each checkpoint minus the first) and ``neighbours`` (each
    minus the one before), the last two with paired per-task bootstrap intervals.
    """
    rows = []
    for model, step, records in checkpoints:
        summary = summarize(records, k=k, success_threshold=success_threshold)
        rows.append(
            {
                "model": model,
                "step": step,
                "episodes": summary["episodes"],
                "not_judged": summary["not_judged"],
                "mean_reward": summary["mean_reward"],
                "mean_reward_ci": summary["mean_reward_ci"],
                "pass_at_k": summary["pass_at_k"],
                "failures": summary["failures"],
            }
        )

    def pair(i: int, j: int) -> dict[str, Any]:
        diff = paired_difference(checkpoints[i][2], checkpoints[j][2])
        return {"base": checkpoints[i][0], "other": checkpoints[j][0], **diff}

    return {
        "rows": rows,
        "vs_first": [pair(0, j) for j in range(1, len(checkpoints))],
        "neighbours": [pair(j - 1, j) for j in range(1, len(checkpoints))],
        "success_threshold": success_threshold,
    }
