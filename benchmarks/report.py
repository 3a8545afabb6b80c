"""Benchmark output: rich tables, a JSON file with every figure and the machine, a PNG plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.grpo_step import GrpoRun
from benchmarks.overhead import OverheadResult
from benchmarks.provenance import stamp
from benchmarks.throughput import ThroughputResult


def write_json(path: Path, kind: str, results: dict) -> Path:
    """Write ``results`` with the machine and the run's provenance (:mod:`benchmarks.provenance`) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp(kind, results), indent=2))
    return path


def _cell(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def throughput_table(results: Sequence[ThroughputResult]) -> Table:
    """One row per run: rate, phase latencies, peaks."""
    table = Table(title="sandbox throughput")
    for column in ("backend", "episodes", "conc.", "ep/s", "fail", "peak live", "MiB/sandbox"):
        table.add_column(column, justify="right")
    for phase in ("start", "exec", "verify", "stop"):
        table.add_column(f"{phase} p50/p95/p99 ms", justify="right")
    floors = any(r.bwrap_floor_p50_ms is not None for r in results)
    if floors:  # the local backend: bare bwrap in the same run, and start p50 over it
        table.add_column("bwrap true p50 ms (1 / conc.)", justify="right")
        table.add_column("start/bwrap (1 / conc.)", justify="right")
    for r in results:
        mem = "-" if r.peak_memory_per_sandbox_mib is None else f"{r.peak_memory_per_sandbox_mib:.1f}"
        cells = []
        for phase in ("start", "exec", "verify", "stop"):
            p = r.phases.get(phase)
            cells.append("-" if p is None else f"{p['p50'] * 1e3:.0f}/{p['p95'] * 1e3:.0f}/{p['p99'] * 1e3:.0f}")
        if floors:
            cells.append(" / ".join(_cell(v, "{:.1f}") for v in (r.bwrap_floor_p50_ms, r.bwrap_floor_concurrent_p50_ms)))
            cells.append(" / ".join(_cell(v, "{:.2f}x") for v in (r.start_over_floor, r.start_over_concurrent_floor)))
        table.add_row(
            r.backend, str(r.episodes), str(r.concurrency), f"{r.episodes_per_second:.2f}",
            str(r.failures), str(r.peak_live), mem, *cells,
        )  # fmt: skip
    return table


def overhead_table(result: OverheadResult) -> Table:
    """The portal round trip and the capacity ramp."""
    rt = result.round_trip
    loop = f"; loop {result.event_loop}" if result.event_loop else ""
    table = Table(title=f"engine overhead (simulated, zero latency{loop})")
    table.add_column("measure")
    table.add_column("p50 µs", justify="right")
    table.add_column("p99 µs", justify="right")
    table.add_column("loop busy", justify="right")
    table.add_column("GC pauses (longest ms, over bound)", justify="right")
    table.add_column("GC young threshold", justify="right")
    table.add_row("exec awaited on the loop", f"{rt.direct_p50_us:.1f}", f"{rt.direct_p99_us:.1f}")
    table.add_row("exec through the portal (a shim call)", f"{rt.portal_p50_us:.1f}", f"{rt.portal_p99_us:.1f}")
    table.add_row("portal overhead", f"{rt.overhead_p50_us:.1f}", f"{rt.overhead_p99_us:.1f}")
    table.add_row("asyncio's bare hand-off, no engine (this machine's floor)", f"{rt.floor_p50_us:.1f}", f"{rt.floor_p99_us:.1f}")
    for step in result.capacity:
        mark = "" if step.under_bound else f"  (over {result.bound_us:g} µs)"
        table.add_row(
            f"probe with {step.sandboxes} live sandboxes{mark}", f"{step.probe_p50_us:.1f}", f"{step.probe_p99_us:.1f}",
            f"{step.loop_busy:.0%}", f"{step.collections} ({step.longest_collection_ms:.1f}, {step.collections_over_bound})",
            f"{step.young_threshold}",
        )  # fmt: skip
    return table


def grpo_table(runs: Sequence[GrpoRun]) -> Table:
    """Per backend and batch size: both implementations' step times and the ratio."""
    table = Table(title="GRPO step: environment seconds per step (TRL env vs shim)")
    for column in ("backend", "B", "T", "impl", "first step", "later steps", "reset", "tools", "rewards", "ratio shim/TRL"):
        table.add_column(column, justify="right")
    by_key: dict[tuple[str, int], dict[str, GrpoRun]] = {}
    for run in runs:
        by_key.setdefault((run.backend, run.batch), {})[run.implementation] = run
    for (backend, batch), pair in by_key.items():
        for impl in ("trl", "shim"):
            run = pair.get(impl)
            if run is None:
                continue
            later = run.steps[1:] or run.steps
            part = lambda name: sum(getattr(s, name) for s in later) / len(later)  # noqa: E731
            ratio = ""
            if impl == "shim" and "trl" in pair:
                ratio = f"1/{pair['trl'].later_step_mean / run.later_step_mean:.1f}"
            table.add_row(
                backend, str(batch), str(run.turns), impl, f"{run.steps[0].total:.2f}",
                f"{run.later_step_mean:.2f}", f"{part('reset'):.2f}", f"{part('tools'):.2f}",
                f"{part('rewards'):.2f}", ratio,
            )  # fmt: skip
    return table


def plot_grpo(runs: Sequence[GrpoRun], path: Path, title: str) -> Path | None:
    """Step time against batch size, one line per implementation and backend; None if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        series.setdefault(f"{run.implementation} ({run.backend})", []).append((run.batch, run.later_step_mean))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([b for b, _ in points], [s for _, s in points], marker="o", label=label)
    ax.set_xlabel("batch size B (rollouts per step)")
    ax.set_ylabel("environment seconds per step (after the first)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def harbor_table(result: dict) -> Table:
    """Per CLI: wall time, episodes/s and phase p50/p99 over the rounds; the ratio in the title."""
    ratio = result["ratio_episodes_per_second"]
    table = Table(
        title=f"harbor-async run vs harbor run ({result['env']}, -a {result['agent']}, -n {result['n_concurrent']}, "
        f"{result['repeats']} rounds): episodes/s ratio harbor-async/harbor median {ratio['median']:.2f} "
        f"(min {ratio['min']:.2f}, max {ratio['max']:.2f})"
    )
    for column in ("CLI", "episodes", "reward 1", "wall s (median)", "episodes/s median [min-max]"):
        table.add_column(column, justify="right")
    for phase in ("start", "agent", "verify", "stop"):
        table.add_column(f"{phase} p50/p99 ms", justify="right")
    for cli, row in result["clis"].items():
        rate = row["episodes_per_second"]
        cells = []
        for phase in ("start", "agent", "verify", "stop"):
            p = row["phases"].get(phase)
            cells.append("-" if p is None else f"{p['p50'] * 1e3:.0f}/{p['p99'] * 1e3:.0f}")
        table.add_row(
            cli, str(row["episodes"]), str(row["reward_one"]), f"{row['wall_s']['median']:.2f}",
            f"{rate['median']:.2f} [{rate['min']:.2f}-{rate['max']:.2f}]", *cells,
        )  # fmt: skip
    return table


def harbor_task_table(result: dict) -> Table:
    """Per task: each CLI's rewards, Harbor's exception names and median seconds; a difference of rewards marked."""
    tasks = result.get("tasks") or {}
    differ = sum(1 for row in tasks.values() if not row["same_rewards"])
    table = Table(title=f"per task: {len(tasks)} tasks, {differ} whose rewards differ")
    for column in ("task", "harbor rewards", "harbor-async rewards", "harbor exceptions", "harbor-async exceptions", "s harbor", "s harbor-async", "same"):
        table.add_column(column)
    for task, row in tasks.items():
        cells = []
        for key in ("rewards", "exceptions"):
            for cli in ("harbor", "harbor-async"):
                value = row[cli][key]
                cells.append(", ".join(f"{k} x{n}" for k, n in value.items()) if isinstance(value, dict) else " ".join(map(str, value)))
        seconds = [str(row[cli]["seconds_p50"] if row[cli]["seconds_p50"] is not None else "-") for cli in ("harbor", "harbor-async")]
        table.add_row(task, *cells, *seconds, "yes" if row["same_rewards"] else "NO")
    return table


def print_tables(*tables: Table) -> None:
    """Print tables to stdout."""
    console = Console()
    if not console.is_terminal:  # a log file or pipe: keep every column readable
        console = Console(width=170)
    for table in tables:
        console.print(table)
