"""Which tasks a command runs: Harbor's ``-p``/``-d``/``-t``, ``-i``/``-x`` globs, ``-l``, ``--indices``, ``-k``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from harbor_async.cli.common import fail, say
from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.logs import quieter
from harbor_async.episodes.runner import PlannedEpisode
from harbor_async.tasks.registry import resolve_dataset, resolve_task

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.tasks.suite import TaskSuite

# ── -d and the registry options, as `harbor run` spells them (run, tasks and eval) ──
DatasetOpt = Annotated[
    str | None,
    typer.Option(
        "--dataset", "-d",
        help="A Harbor registry dataset, name@version (name: its default version), "
        "or a Hugging Face dataset repo, hf:org/name\\[@revision].",
    ),
]  # fmt: skip
RegistryUrlOpt = Annotated[
    str | None, typer.Option("--registry-url", help="A registry.json URL to resolve -d or -t in.", show_default="Harbor's registry")
]
RegistryPathOpt = Annotated[
    Path | None, typer.Option("--registry-path", help="A local registry.json file to resolve -d or -t in.", show_default=False)
]
TaskRefOpt = Annotated[
    str | None,
    typer.Option(
        "--task", "-t",
        help="One registry task, run alone: NAME\\[@COMMIT] as a --registry-path/--registry-url file's datasets list it, "
        "or Harbor's package org/name\\[@ref] (neither option).",
    ),
]  # fmt: skip


def suite_source(
    suite: str | None,
    path: Path | None,
    dataset: str | None,
    registry_url: str | None = None,
    registry_path: Path | None = None,
    task_ref: str | None = None,
) -> str | Path | list[str] | None:
    """The one suite source of ``SUITE`` (hidden, older spelling), ``-p``, ``-d`` or ``-t``; ``None``: the bundled suite.

    ``-d`` and ``-t`` are resolved here, before any sandbox starts: a registry
    dataset is downloaded (its task folders are the source), and so is a
    registry task (its one folder); ``hf:org/name`` stays a repo id.
    A deprecated spelling is said once on stderr; any error exits 2 in one line.
    """
    sources = (("SUITE", suite), ("-p/--path", path), ("-d/--dataset", dataset), ("-t/--task", task_ref))
    given = [name for name, value in sources if value]
    if len(given) > 1:
        raise fail(f"give one suite, not {' and '.join(given)}")
    if (registry_url is not None or registry_path is not None) and not (dataset or task_ref):
        raise fail("--registry-url and --registry-path resolve -d/--dataset or -t/--task; give -d name@version")
    if path is not None:
        return Path(path)  # a Path is always local
    if task_ref:
        try:
            found = resolve_task(task_ref, registry_url=registry_url, registry_path=registry_path)
        except HarborAsyncError as exc:
            raise fail(exc) from None
        return [str(found.path)]  # as text: the source is kept in the job's settings (JSON)
    if dataset:
        try:
            resolved = resolve_dataset(dataset, registry_url=registry_url, registry_path=registry_path)
        except HarborAsyncError as exc:
            raise fail(exc) from None
        if resolved.deprecation:
            say("deprecated:", resolved.deprecation)
        # task folders as plain strings: the source is kept in the job's settings (JSON)
        return resolved.source if isinstance(resolved.source, str) else [str(p) for p in resolved.source]
    return suite


def load_tasks(
    source: str | Path | list[str] | None,
    *,
    n_tasks: int | None = None,
    indices: list[int] | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
) -> TaskSuite:
    """Load and select the tasks as Harbor does: globs on task names first, then the first ``n_tasks``.

    Invalid tasks are reported once each, on stderr. Exits 2 on any bad input.
    """
    from harbor_async.tasks.suite import load_suite

    if n_tasks is not None and indices is not None:
        raise fail("pass -l/--n-tasks or --indices, not both")
    try:
        # Without globs only the first n task folders are validated (fast on big suites).
        # Invalid tasks are reported below, once each: not also as the suite's log warnings.
        with quieter("error"):
            loaded = load_suite(source, num_tasks=n_tasks, indices=indices, include=include, exclude=exclude)
    except (HarborAsyncError, ValueError, FileNotFoundError, IndexError, TypeError) as exc:
        raise fail(exc) from None
    for bad in loaded.invalid:
        say("skipped invalid task", f"{bad.path}: {bad.reason}")
    return loaded


def plan_episodes(tasks: list[Task], attempts: int) -> list[PlannedEpisode]:
    """``attempts`` episodes of each task; a task selected twice (``--indices 0,0``) continues its attempt count."""
    seen: dict[Path, int] = {}
    episodes: list[PlannedEpisode] = []
    for task in tasks:
        first = seen.get(task.paths.task_dir, 0)
        episodes.extend(PlannedEpisode(task, first + a) for a in range(attempts))
        seen[task.paths.task_dir] = first + attempts
    return episodes


def describe_episodes(episodes: list[PlannedEpisode]) -> list[dict[str, Any]]:
    """The plan as ``harbor-async.json`` keeps it, for ``--resume``."""
    return [{"task": e.task.name, "task_path": str(e.task.paths.task_dir), "attempt": e.attempt} for e in episodes]


def reload_episodes(described: list[dict[str, Any]]) -> list[PlannedEpisode]:
    """The plan of a job folder's ``harbor-async.json``, its tasks loaded again (exits 2 if one is gone)."""
    from harbor_async.tasks.suite import load_task

    loaded: dict[str, Task] = {}
    episodes = []
    try:
        for item in described:
            path = item["task_path"]
            if path not in loaded:
                loaded[path] = load_task(path)
            episodes.append(PlannedEpisode(loaded[path], int(item["attempt"])))
    except HarborAsyncError as exc:
        raise fail(f"cannot resume: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise fail(f"cannot resume: the job settings have no valid episode list ({exc!r})") from None
    return episodes
