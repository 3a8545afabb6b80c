"""``harbor-async run`` and ``harbor-async tasks``: episodes of a suite."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import anyio
import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from harbor_async.backends import resolve_backend
from harbor_async.cli.common import err, fail, out
from harbor_async.engine import Engine
from harbor_async.errors import HarborAsyncError
from harbor_async.logs import configure_logging
from harbor_async.policy import Limits, Timeouts
from harbor_async.runner import AGENTS, EpisodeRecord, run_suite

SuiteArg = Annotated[
    str | None,
    typer.Argument(help="Suite: a local task tree or a Hugging Face dataset repo id (default: the bundled example suite)."),
]
PHASES = ("start", "agent", "exec", "verify", "stop")


def _load(suite: str | None, num_tasks: int | None, indices: str | None):
    from harbor_async.tasks import load_suite

    picked = [int(i) for i in indices.split(",")] if indices else None
    loaded = load_suite(suite, num_tasks=num_tasks, indices=picked)
    for bad in loaded.invalid:
        err.print(f"[yellow]skipped invalid task[/] {bad.path}: {bad.reason}")
    return loaded


def run(
    suite: SuiteArg = None,
    backend: Annotated[str, typer.Option("--backend", "-b", help="Harbor type (docker, e2b, ...), 'local', 'simulated' or module:Class.")] = "local",
    agent: Annotated[str, typer.Option("--agent", "-a", help=f"One of: {', '.join(AGENTS)}.")] = "oracle",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Episodes (and live sandboxes) at once.")] = 8,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write one JSON record per episode to this file.")] = None,
    num_tasks: Annotated[int | None, typer.Option("--num-tasks", "-n", min=1, help="Only the first N tasks.")] = None,
    indices: Annotated[str | None, typer.Option("--indices", help="Comma-separated task indices.")] = None,
    episode_timeout: Annotated[float | None, typer.Option(help="Seconds for a whole episode.")] = None,
    start_timeout: Annotated[float, typer.Option(help="Seconds for one start attempt.")] = 600.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "warning",
    log_format: Annotated[str, typer.Option(help="console or json.")] = "console",
) -> None:
    """Run every task of a suite once, concurrently, and report rewards and timings.

    Exits 1 when any episode failed for an infrastructure reason (start, exec,
    verify or stop), 2 on bad input.
    """
    configure_logging(log_level, log_format, force=True)
    if agent not in AGENTS:
        raise fail(f"unknown agent {agent!r}; use one of {', '.join(AGENTS)}")
    try:
        resolve_backend(backend).environment_class()
        loaded = _load(suite, num_tasks, indices)
    except (HarborAsyncError, ValueError, FileNotFoundError, IndexError) as exc:
        raise fail(str(exc)) from None

    records = anyio.run(_run_all, loaded.tasks, backend, agent, concurrency, episode_timeout, start_timeout)
    _print_table(records)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        with json_path.open("w") as fh:
            for record in records:
                fh.write(json.dumps(record.to_dict()) + "\n")
        err.print(f"wrote {len(records)} records to {json_path}")
    broken = [r for r in records if r.infrastructure_failure]
    if broken:
        for r in broken:
            err.print(f"[bold red]infrastructure failure[/] {r.task}: {r.error}")
        raise typer.Exit(1)


async def _run_all(tasks, backend, agent, concurrency, episode_timeout, start_timeout) -> list[EpisodeRecord]:
    timeouts = Timeouts(start=start_timeout, episode=episode_timeout)
    with Progress(
        TextColumn("[bold]episodes"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward sum {task.fields[score]:.1f}"),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    ) as progress:
        bar = progress.add_task("episodes", total=len(tasks), score=0.0)
        score = 0.0

        def done(record: EpisodeRecord) -> None:
            nonlocal score
            score += record.reward or 0.0
            progress.update(bar, advance=1, score=score)

        async with Engine(limits=Limits(live_sandboxes=concurrency), timeouts=timeouts) as engine:
            return await run_suite(engine, tasks, backend, agent=agent, concurrency=concurrency, on_done=done)


def _print_table(records: list[EpisodeRecord]) -> None:
    table = Table(title="episodes")
    table.add_column("task")
    table.add_column("reward", justify="right")
    used = [p for p in PHASES if any(p in r.seconds for r in records)]
    for phase in used:
        table.add_column(f"{phase} s", justify="right")
    table.add_column("error")
    for r in records:
        reward = "-" if r.reward is None else f"{r.reward:g}"
        cells = [f"{r.seconds[p]:.3f}" if p in r.seconds else "" for p in used]
        table.add_row(r.task, reward, *cells, (r.error or "")[:80])
    scored = [r.reward for r in records if r.reward is not None]
    mean = sum(scored) / len(scored) if scored else 0.0
    out.print(table)
    out.print(f"{len(records)} episodes, mean reward {mean:.3f}, {sum(r.infrastructure_failure for r in records)} infrastructure failures")


def tasks(
    suite: SuiteArg = None,
    num_tasks: Annotated[int | None, typer.Option("--num-tasks", "-n", min=1)] = None,
) -> None:
    """List a suite's valid tasks and report the invalid ones."""
    try:
        loaded = _load(suite, num_tasks, None)
    except (HarborAsyncError, ValueError, FileNotFoundError, IndexError) as exc:
        raise fail(str(exc)) from None
    table = Table(title=f"tasks in {loaded.root}")
    table.add_column("#", justify="right")
    table.add_column("task")
    table.add_column("path")
    for i, task in enumerate(loaded.tasks):
        table.add_row(str(i), task.name, str(task.paths.task_dir))
    out.print(table)
