"""One self-contained HTML file from a job or benchmark results: Jinja2 templates, inlined CSS and JS.

The templates, the stylesheet and the script are package files
(``harbor_async/report/templates`` and ``static``), loaded with
:class:`jinja2.PackageLoader` and :mod:`importlib.resources`. Autoescaping is on
for every template; data reaches the page's script only as inert JSON
(:func:`~harbor_async.report.pack.script_json`) that the script shows with
``textContent``, and a Content-Security-Policy with a per-file nonce keeps any
script the page did not ship from running.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from harbor_async.core.records import EpisodeRecord
from harbor_async.report import charts
from harbor_async.report.analysis import JobAnalysis, analyze
from harbor_async.report.bench import benchmark_section
from harbor_async.report.pack import pack_episode, script_json
from harbor_async.report.source import BenchmarkSource, JobSource, Source, load_source

PACKAGE = "harbor_async.report"


@cache
def _environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader(PACKAGE, "templates"),
        autoescape=True,  # every template, whatever its file name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _num
    env.filters["ci"] = _ci
    env.filters["secs"] = _secs
    env.filters["mib"] = _mib
    return env


def _num(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ci(ci: Any, digits: int = 3) -> str:
    return "" if not ci else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _secs(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


@cache
def _asset(name: str) -> str:
    """A file of ``static/`` (CSS or JS), to inline."""
    return resources.files(PACKAGE).joinpath("static", name).read_text(encoding="utf-8")


def render(source: Source | str | Path, *, success_threshold: float | None = None, live: str | None = None) -> str:
    """The report of ``source`` (a :func:`load_source` result or a path) as HTML text.

    ``live``: the version token of a page served by ``harbor-async view``; the
    page then polls the server and reloads when the token changes.
    """
    import markupsafe

    if not isinstance(source, JobSource | BenchmarkSource):
        source = load_source(source)
    nonce = secrets.token_urlsafe(16)
    common = {
        "name": source.name,
        "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "nonce": nonce,
        "live": live,
        "css": markupsafe.Markup(_asset("report.css")),
        "js": markupsafe.Markup(_asset("report.js")),
        "live_js": markupsafe.Markup(_asset("live.js")),
    }
    if isinstance(source, BenchmarkSource):
        sections = [benchmark_section(r) for r in source.results]
        return _environment().get_template("benchmarks.html.j2").render(kind="benchmarks", sections=sections, **common)
    models = source.config.get("models") if isinstance(source.config.get("models"), list) else None
    analysis = analyze(source.records, success_threshold=success_threshold, model_order=models)
    return _environment().get_template("job.html.j2").render(
        kind=_kind(source, analysis),
        job=source,
        a=analysis,
        config=json.dumps(source.config, indent=2, ensure_ascii=False, default=str),
        charts=_job_charts(analysis),
        data=markupsafe.Markup(script_json(_page_data(analysis))),
        blobs=_blobs(analysis.records),
        **common,
    )


def write_report(source: Source | str | Path, output: str | Path, *, success_threshold: float | None = None) -> Path:
    """Render ``source`` and write it to ``output`` (atomically: a reader never sees half a file)."""
    output = Path(output)
    html = render(source, success_threshold=success_threshold)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(output)
    return output


def default_output(path: str | Path) -> Path:
    """Where ``harbor-async report PATH`` writes: ``report.html`` in the job or results folder."""
    path = Path(path)
    if path.is_dir():
        return path / "report.html"
    if path.suffix == ".json":
        return path.with_suffix(".html")
    return path.parent / "report.html"


def _kind(source: JobSource, analysis: JobAnalysis) -> str:
    if analysis.sweep:
        return "sweep"
    command = source.config.get("command")
    if isinstance(command, str) and command:
        return command
    return "eval" if any(r.transcript or r.model for r in source.records) else "run"


def _page_data(analysis: JobAnalysis) -> dict[str, Any]:
    errors = sorted({e for t in analysis.tasks for e in t["errors"]})
    return {
        "threshold": analysis.threshold,
        "groups": [g.label for g in analysis.groups],
        "errors": errors,
        "tasks": analysis.tasks,
        "episodes": analysis.episodes,
    }


def _blobs(records: list[EpisodeRecord]) -> Iterator[tuple[int, str]]:
    for i, record in enumerate(records):
        yield i, pack_episode(record)


def _job_charts(analysis: JobAnalysis) -> dict[str, str]:
    out: dict[str, str] = {}
    if analysis.outcomes:
        out["outcomes"] = charts.outcomes_chart(analysis.outcomes)
    if analysis.phases:
        out["phases"] = charts.phases_chart(analysis.phases)
    if analysis.sweep:
        labels = [g.label for g in analysis.groups]
        out["reward"] = charts.sweep_chart(
            labels,
            {
                "mean reward": (
                    [g.summary["mean_reward"] for g in analysis.groups],
                    [g.summary["mean_reward_ci"] for g in analysis.groups],
                )
            },
            "mean reward (95% interval)",
        )
        ks = sorted({k for g in analysis.groups for k in g.summary["pass_at_k"]}, key=int)
        if ks:
            shown = sorted({ks[0], ks[-1]}, key=int)
            out["pass_at_k"] = charts.sweep_chart(
                labels,
                {
                    f"pass@{k}": (
                        [g.summary["pass_at_k"].get(k, {}).get("value") for g in analysis.groups],
                        [g.summary["pass_at_k"].get(k, {}).get("ci") for g in analysis.groups],
                    )
                    for k in shown
                },
                "pass@k (95% interval)",
            )
        if analysis.differences:
            out["differences"] = charts.differences_chart(analysis.differences)
    return out
