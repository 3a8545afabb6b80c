"""Charts of a report, drawn by matplotlib and embedded as SVG data URIs.

Each function returns a ``data:image/svg+xml;base64,...`` URI for an ``<img>``:
an image cannot run script, so a task or model name inside a chart is inert
whatever it contains. matplotlib runs headless (the Agg backend) and is
imported on first use, so importing the report costs nothing until a chart is drawn.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Colours of the outcomes, shared with the page's CSS (report.css).
OUTCOME_COLOURS = {
    "solved": "#2e7d32",
    "unsolved": "#c62828",
    "agent": "#ef6c00",
    "verifier": "#6a1b9a",
    "infrastructure": "#455a64",
    "model_server": "#1565c0",
    "cancelled": "#9e9e9e",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "harbor-async", "svg.fonttype": "path", "font.size": 9})
    return plt


def _uri(fig: Any) -> str:
    plt = _pyplot()
    buffer = io.BytesIO()
    fig.tight_layout()
    # No date in the SVG: the same records give the same file.
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    return "data:image/svg+xml;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def png_uri(path: Path) -> str:
    """A saved PNG plot (a benchmark's) as a data URI."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def outcomes_chart(outcomes: dict[str, int]) -> str:
    """Episodes by outcome, a horizontal bar each."""
    plt = _pyplot()
    names = list(outcomes)
    fig, ax = plt.subplots(figsize=(5, 0.45 * len(names) + 0.8))
    colours = [OUTCOME_COLOURS.get(n, "#607d8b") for n in names]
    bars = ax.barh(names, [outcomes[n] for n in names], color=colours)
    ax.bar_label(bars, padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("episodes")
    ax.spines[["top", "right"]].set_visible(False)
    return _uri(fig)


def phases_chart(phases: Sequence[dict[str, Any]]) -> str:
    """Each phase's seconds as a box plot (whiskers at p5/p95)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 0.5 * len(phases) + 1.0))
    ax.boxplot(
        [p["values"] for p in phases],
        tick_labels=[p["phase"] for p in phases],
        orientation="horizontal",
        whis=(5, 95),
        showfliers=False,
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds (box: p25-p75, whiskers: p5-p95)")
    ax.grid(True, axis="x", alpha=0.3)
    return _uri(fig)


def _errorbars(values: Sequence[float | None], cis: Sequence[Sequence[float] | None]) -> list[list[float]]:
    lows, highs = [], []
    for v, ci in zip(values, cis, strict=True):
        if v is None or ci is None:
            lows.append(0.0)
            highs.append(0.0)
        else:
            lows.append(max(v - ci[0], 0.0))
            highs.append(max(ci[1] - v, 0.0))
    return [lows, highs]


def sweep_chart(labels: Sequence[str], series: dict[str, tuple[list[float | None], list[Any]]], ylabel: str) -> str:
    """Values against checkpoint, one line per series, with their 95% intervals as error bars."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(labels) + 2), 3.6))
    x = list(range(len(labels)))
    for name, (values, cis) in series.items():
        ys = [float("nan") if v is None else v for v in values]
        ax.errorbar(x, ys, yerr=_errorbars(values, cis), marker="o", capsize=4, label=name)
    ax.set_xticks(x, labels, rotation=30 if len(labels) > 4 else 0, ha="right" if len(labels) > 4 else "center")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.05, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _uri(fig)


def differences_chart(differences: Sequence[dict[str, Any]]) -> str:
    """Each checkpoint's paired mean difference from the first, with its interval."""
    plt = _pyplot()
    labels = [d["label"] for d in differences]
    values = [d["difference"] for d in differences]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(labels) + 2), 3.2))
    x = list(range(len(labels)))
    ax.axhline(0.0, color="#888", linewidth=1)
    ax.errorbar(
        x,
        [float("nan") if v is None else v for v in values],
        yerr=_errorbars(values, [d["ci"] for d in differences]),
        marker="o",
        capsize=4,
        linestyle="none",
    )
    ax.set_xticks(x, labels, rotation=30 if len(labels) > 4 else 0, ha="right" if len(labels) > 4 else "center")
    ax.set_ylabel(f"mean reward minus {differences[0]['base']}")
    ax.grid(True, alpha=0.3)
    return _uri(fig)


def line_chart(
    series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, *, logy: bool = False, logx: bool = False
) -> str:
    """Plain lines (benchmarks): one per series of ``(x, y)`` points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, points in sorted(series.items()):
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    if logy:
        ax.set_yscale("log")
    if logx:
        from matplotlib.ticker import ScalarFormatter

        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())  # 8, 32, not 2^3, 2^5
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    return _uri(fig)
