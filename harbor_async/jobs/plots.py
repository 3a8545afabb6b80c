"""The sweep's table (CSV) and plot (PNG): mean reward and pass@k with intervals against checkpoint step."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any


def sweep_csv(sweep: dict[str, Any]) -> str:
    """One row per checkpoint: mean reward, pass@k (each with its interval), paired differences."""
    rows = sweep["rows"]
    ks = sorted({int(k) for row in rows for k in row["pass_at_k"]})
    vs_first = {p["other"]: p for p in sweep["vs_first"]}
    vs_prev = {p["other"]: p for p in sweep["neighbours"]}
    header = ["model", "step", "episodes", "mean_reward", "mean_reward_low", "mean_reward_high"]
    for k in ks:
        header += [f"pass@{k}", f"pass@{k}_low", f"pass@{k}_high"]
    header += ["diff_vs_first", "diff_vs_first_low", "diff_vs_first_high"]
    header += ["diff_vs_previous", "diff_vs_previous_low", "diff_vs_previous_high"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    for row in rows:
        cells = [row["model"], row["step"], row["episodes"], row["mean_reward"], *_ci(row["mean_reward_ci"])]
        for k in ks:
            entry = row["pass_at_k"].get(str(k)) or {}
            cells += [entry.get("value"), *_ci(entry.get("ci"))]
        for pairs in (vs_first, vs_prev):
            pair = pairs.get(row["model"])
            cells += [pair["difference"], *_ci(pair["ci"])] if pair else ["", "", ""]
        writer.writerow(["" if c is None else c for c in cells])
    return buffer.getvalue()


def _ci(ci: Any) -> list[Any]:
    return list(ci) if ci else [None, None]


def plot_sweep(sweep: dict[str, Any], path: str | Path) -> Path:
    """Plot mean reward and pass@k (with 95% intervals) against checkpoint step (index when unknown)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    rows = sweep["rows"]
    steps = [row["step"] for row in rows]
    xs = steps if all(s is not None for s in steps) and len(set(steps)) == len(steps) else list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("mean reward", [r["mean_reward"] for r in rows], [r["mean_reward_ci"] for r in rows])]
    for k in sorted({int(k) for row in rows for k in row["pass_at_k"]}):
        entries = [row["pass_at_k"].get(str(k)) or {} for row in rows]
        series.append((f"pass@{k}", [e.get("value") for e in entries], [e.get("ci") for e in entries]))
    for label, values, cis in series:
        ys = [float("nan") if v is None else v for v in values]
        low = [y - ci[0] if ci else 0.0 for y, ci in zip(ys, cis, strict=True)]
        high = [ci[1] - y if ci else 0.0 for y, ci in zip(ys, cis, strict=True)]
        ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=4, label=label)
    ax.set_xlabel("checkpoint step" if xs is steps else "checkpoint")
    if xs is not steps:
        ax.set_xticks(xs, [row["model"] for row in rows], rotation=20)
    ax.set_ylabel(f"score (success: reward >= {sweep.get('success_threshold', 1.0):g})")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    target = Path(path)
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target
