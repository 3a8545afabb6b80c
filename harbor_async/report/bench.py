"""Benchmark results as report sections: tables and the step-time and throughput plots.

Reads the JSON files ``harbor-async bench`` writes (``benchmarks/report.py``
gives their shape). A saved PNG beside a result (the benchmark's own plot) is
shown as it is, in place of the plots drawn here from the JSON. A result of a kind this module does not know
is still shown, as tables of its lists and settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harbor_async.report import charts
from harbor_async.report.source import BenchmarkResult

THROUGHPUT_PHASES = ("start", "exec", "verify", "stop")
HARBOR_PHASES = ("start", "agent", "verify", "stop")


@dataclass
class Table:
    """A table of text cells (the template escapes them)."""

    title: str
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Chart:
    """A chart as a data URI for an ``<img>``."""

    title: str
    uri: str


@dataclass
class BenchmarkSection:
    """One benchmark result as the report shows it."""

    name: str
    kind: str
    machine: list[tuple[str, str]]
    tables: list[Table] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)


def benchmark_section(result: BenchmarkResult) -> BenchmarkSection:
    """The tables and plots of one result."""
    data = result.data
    kind = str(data.get("benchmark", "?"))
    section = BenchmarkSection(result.name, kind, _machine(data.get("machine")) + _provenance(data.get("provenance")))
    if kind == "throughput":
        _throughput(section, data)
    elif kind == "grpo-step":
        _grpo(section, data)
    elif kind == "overhead":
        _overhead(section, data)
    elif kind == "harbor":
        _harbor(section, data)
    elif kind == "docker-step" and "rounds" in data:
        _layers(section, data)
    else:
        _generic(section, data)
    if result.plot is not None:  # the benchmark's own plot of the same figures: shown instead of a redraw
        section.charts = [Chart(f"{result.plot.name} (saved by the benchmark)", charts.png_uri(result.plot))]
    return section


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return str(value)


def _machine(machine: Any) -> list[tuple[str, str]]:
    if not isinstance(machine, dict):
        return []
    rows = [(k, _fmt(v)) for k, v in machine.items() if not isinstance(v, dict | list)]
    packages = machine.get("packages")
    if isinstance(packages, dict):
        rows.append(("packages", ", ".join(f"{k} {v}" for k, v in packages.items())))
    return rows


def _provenance(provenance: Any) -> list[tuple[str, str]]:
    """Commit, command and load before/after (``benchmarks/provenance.py``); results of earlier releases have none."""
    if not isinstance(provenance, dict):
        return []
    rows = []
    for key, value in provenance.items():
        if isinstance(value, list):
            value = " ".join(_fmt(v) for v in value)
        rows.append((key.replace("_", " "), _fmt(value)))
    return rows


def _harbor(section: BenchmarkSection, data: dict[str, Any]) -> None:
    """``bench harbor``: one row per CLI, the ratio of episodes/s, and each round."""
    clis = data.get("clis")
    if not isinstance(clis, dict):
        return _generic(section, data)
    columns = ["CLI", "episodes", "reward 1", "errors", "wall s median", "episodes/s median", "episodes/s min", "episodes/s max"]
    columns += [f"{p} p50/p99 ms" for p in HARBOR_PHASES]
    rows = []
    for cli, row in clis.items():
        rate = row.get("episodes_per_second") or {}
        cells = [cli, _fmt(row.get("episodes")), _fmt(row.get("reward_one")), _fmt(row.get("errors"))]
        cells += [_fmt((row.get("wall_s") or {}).get("median"))] + [_fmt(rate.get(k)) for k in ("median", "min", "max")]
        for phase in HARBOR_PHASES:
            p = (row.get("phases") or {}).get(phase)
            cells.append("-" if not p else f"{p['p50'] * 1e3:.0f}/{p['p99'] * 1e3:.0f}")
        rows.append(cells)
    setting = f"{data.get('env')}, -a {data.get('agent')}, -n {data.get('n_concurrent')}, {data.get('repeats')} rounds"
    section.tables.append(Table(f"harbor-async run vs harbor run ({setting})", columns, rows))
    ratio = data.get("ratio_episodes_per_second") or {}
    section.tables.append(
        Table("episodes/s ratio harbor-async / harbor", ["median", "min", "max"], [[_fmt(ratio.get(k)) for k in ("median", "min", "max")]])
    )
    rounds = [r for r in data.get("rounds", []) if isinstance(r, dict)]
    if rounds:
        names = list(clis)
        section.tables.append(Table(
            "rounds", ["round", "first", *[f"{c} wall s" for c in names], "ratio"],
            [[_fmt(r.get("round")), _fmt(r.get("first")), *[_fmt((r.get(c) or {}).get("wall_s")) for c in names], _fmt(r.get("ratio"))] for r in rounds],
        ))  # fmt: skip
    commands = data.get("commands")
    if isinstance(commands, dict):
        section.tables.append(Table("commands (last round)", ["CLI", "command"], [[k, str(v)] for k, v in commands.items()]))
    return None


def _layers(section: BenchmarkSection, data: dict[str, Any]) -> None:
    """``bench docker-step``: each layer's later-step time and its ratio to TRL's env (median, min, max of the rounds)."""
    summary = data.get("summary")
    if not isinstance(summary, dict):
        return _generic(section, data)
    columns = ["layer", "later step s median", "ratio median", "ratio min", "ratio max", "first step ratio median", "mean reward"]
    rows = []
    for layer, row in summary.items():
        later, ratio = row.get("later_step_s") or {}, row.get("later_ratio_to_trl") or {}
        rows.append([
            layer, _fmt(later.get("median")), *[_fmt(ratio.get(k)) for k in ("median", "min", "max")],
            _fmt((row.get("first_ratio_to_trl") or {}).get("median")), _fmt((row.get("mean_reward") or {}).get("median")),
        ])  # fmt: skip
    setting = f"B={data.get('batch')}, T={data.get('turns')}, {data.get('steps')} steps, {data.get('repeats')} rounds, {data.get('task_set', 'bundled')} tasks"
    section.tables.append(Table(f"GRPO step on docker, layer by layer against TRL's env ({setting})", columns, rows))
    return None


def _throughput(section: BenchmarkSection, data: dict[str, Any]) -> None:
    runs = [r for r in data.get("runs", []) if isinstance(r, dict)]
    columns = ["backend", "episodes", "concurrency", "episodes/s", "failures", "peak live", "MiB/sandbox"]
    columns += [f"{p} p50/p95/p99 ms" for p in THROUGHPUT_PHASES]
    floors = any(r.get("bwrap_floor_p50_ms") is not None for r in runs)
    if floors:  # the local backend's floor: a bare bwrap in the same run
        columns += ["bwrap true p50 ms", "start p50 / bwrap"]
        columns += ["bwrap true p50 ms, as many at once", "start p50 / that"]
    rows = []
    rate: dict[str, list[tuple[float, float]]] = {}
    latency: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        cells = [_fmt(r.get(k)) for k in ("backend", "episodes", "concurrency", "episodes_per_second", "failures", "peak_live", "peak_memory_per_sandbox_mib")]
        for phase in THROUGHPUT_PHASES:
            p = (r.get("phases") or {}).get(phase)
            cells.append("-" if not p else "/".join(f"{p[q] * 1e3:.0f}" for q in ("p50", "p95", "p99")))
            if p and r.get("concurrency"):
                latency.setdefault(f"{phase} p50 ({r.get('backend')})", []).append((r["concurrency"], p["p50"] * 1e3))
        if floors:
            cells += [_fmt(r.get("bwrap_floor_p50_ms")), _fmt(r.get("start_over_floor"))]
            cells += [_fmt(r.get("bwrap_floor_concurrent_p50_ms")), _fmt(r.get("start_over_concurrent_floor"))]
        rows.append(cells)
        if r.get("concurrency") and r.get("episodes_per_second") is not None:
            rate.setdefault(str(r.get("backend")), []).append((r["concurrency"], r["episodes_per_second"]))
    section.tables.append(Table("runs", columns, rows))
    if rate:
        section.charts.append(Chart("throughput", charts.line_chart(rate, "concurrency (live sandboxes)", "episodes per second", logx=True)))
    if latency:
        section.charts.append(Chart("phase latency", charts.line_chart(latency, "concurrency (live sandboxes)", "p50 ms", logx=True, logy=True)))


def _grpo(section: BenchmarkSection, data: dict[str, Any]) -> None:
    runs = [r for r in data.get("runs", []) if isinstance(r, dict)]
    rows = []
    series: dict[str, list[tuple[float, float]]] = {}
    for r in runs:
        totals = r.get("step_totals") or []
        rows.append([
            _fmt(r.get("backend")), _fmt(r.get("implementation")), _fmt(r.get("batch")), _fmt(r.get("turns")),
            _fmt(totals[0] if totals else None), _fmt(r.get("later_step_mean")), _fmt(r.get("mean_reward")),
        ])  # fmt: skip
        if r.get("batch") and r.get("later_step_mean") is not None:
            series.setdefault(f"{r.get('implementation')} ({r.get('backend')})", []).append((r["batch"], r["later_step_mean"]))
    section.tables.append(
        Table("runs", ["backend", "implementation", "B", "turns", "first step s", "later steps s", "mean reward"], rows)
    )
    if series:
        section.charts.append(Chart("step time", charts.line_chart(series, "batch size B", "environment seconds per step", logy=True)))


def _overhead(section: BenchmarkSection, data: dict[str, Any]) -> None:
    rt = data.get("round_trip")
    if isinstance(rt, dict):
        section.tables.append(Table("round trip", ["measure", "value"], [[k, _fmt(v)] for k, v in rt.items()]))
    capacity = [c for c in data.get("capacity", []) if isinstance(c, dict)]
    if capacity:
        keys = list(capacity[0])
        section.tables.append(Table("capacity", keys, [[_fmt(c.get(k)) for k in keys] for c in capacity]))
        points = [(c["sandboxes"], c["probe_p99_us"]) for c in capacity if "sandboxes" in c and "probe_p99_us" in c]
        if points:
            section.charts.append(Chart("capacity probe", charts.line_chart({"probe p99": points}, "live sandboxes", "µs", logx=True)))
    if "max_sandboxes_under_bound" in data:
        label = f"max sandboxes with a probe {data.get('bound_percentile', 'p50')} within {_fmt(data.get('bound_us'))} µs"
        section.tables.append(Table("result", ["measure", "value"], [[label, _fmt(data["max_sandboxes_under_bound"])]]))
    elif "max_sandboxes_under_1ms" in data:  # result files of earlier releases
        section.tables.append(Table("result", ["measure", "value"], [["max sandboxes under 1 ms", _fmt(data["max_sandboxes_under_1ms"])]]))


def _generic(section: BenchmarkSection, data: dict[str, Any]) -> None:
    scalars = [[k, _fmt(v)] for k, v in data.items() if k not in ("benchmark", "machine", "provenance") and not isinstance(v, dict | list)]
    if scalars:
        section.tables.append(Table("values", ["key", "value"], scalars))
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(k for v in value for k in v))
            rows = [[_fmt(v.get(c)) if not isinstance(v.get(c), dict | list) else "…" for c in columns] for v in value]
            section.tables.append(Table(key, columns, rows))
