"""``run``'s options in Harbor's dialect: its job config files (``-c``), ``--print-config``, ``--dry-run``'s plan,
the one line naming our defaults where they differ from ``harbor run``'s, and what a resumed job refused before."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, cast

import typer
from rich.table import Table
from rich.text import Text

from harbor_async.cli.common import fail, out, say
from harbor_async.core.printing import escape_controls
from harbor_async.episodes.runner import PlannedEpisode
from harbor_async.jobs.settings import JobSettings
from harbor_async.tasks.mounts import (
    MountError,
    check_backend,
    normalized,
    parse_mounts,
    refuse_mounting_options,
    refuse_protected,
)
from harbor_async.tasks.overrides import parse_env_pairs


def previous_refusals(job: Any) -> list[dict[str, str]]:
    """The tasks the job's first run refused (its ``summary.json``), kept by a resume's summary."""
    from harbor_async.jobs.folder import JobFolderError

    try:
        found = job.read_json("summary.json")
    except JobFolderError:
        return []
    return list(found.get("refused") or []) if isinstance(found, dict) else []


def with_config(ctx: typer.Context, sources: list[str]) -> dict[str, Any]:
    """``run``'s arguments: the command line's, over the job config's where the command line gave none.

    ``--ak``/``--ek`` add to the config's kwargs (a key given on the command line wins), as in Harbor.
    """
    from harbor_async.jobs.harbor_config import (
        JobConfigError,
        load_job_config,
        run_options,
    )

    try:
        from_config = run_options(load_job_config(sources))
    except JobConfigError as exc:
        raise fail(f"-c/--config: {exc}") from None
    typed = {name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"}
    # Click's raw values: an unset repeatable option is (), which typer turns into None for the function
    arguments = {**{name: None if value == () else value for name, value in ctx.params.items()}, "ctx": ctx, "config": None}
    for name, value in from_config.items():
        if name in ("ak", "ek") and name in typed:
            arguments[name] = [*value, *(ctx.params[name] or [])]
        elif name not in typed:
            arguments[name] = value
    if "mounts" in from_config and "mounts" not in typed:  # checked here to name the file's field, not --mounts

        try:
            parse_mounts(from_config["mounts"], writable=bool(arguments.get("mounts_writable")), flag="environment.mounts")
        except MountError as exc:
            raise fail(f"-c/--config: {exc}") from None
    return arguments


def print_job_config(
    settings: JobSettings, spec: Any, jobs_dir: Path, job_name: str | None, selection: dict[str, Any]
) -> None:
    """The run as Harbor's ``JobConfig``, printed as ``harbor run --print-config`` prints it (defaults left out).

    ``selection``: ``-i``, ``-x`` and ``-l`` as the dataset's ``task_names``, ``exclude_task_names``, ``n_tasks``.
    """
    from harbor_async.jobs.harbor_layout import HarborJob

    root = Path(cast(str, settings.suite)) if settings.suite else None  # str(loaded.root) by now
    folder = jobs_dir / (job_name or "job")
    config = HarborJob(folder, settings, root, spec).job_config()
    for dataset in config.datasets:
        for field, value in selection.items():
            if value is not None:
                setattr(dataset, field, value)
    printed = config.model_dump(mode="json", exclude_defaults=True)
    if job_name is None:  # no name given: a timestamp when it runs, left out as Harbor leaves out its default
        printed.pop("job_name", None)
    typer.echo(json.dumps(printed, indent=2, ensure_ascii=False))


def print_plan(episodes: list[PlannedEpisode], settings: JobSettings, resume: Path | None) -> None:
    """``--dry-run``'s output: the episodes per task on stdout, one line of what would run on stderr."""
    per_task = Counter(e.task.name for e in episodes)
    table = Table("task", "episodes")
    for name, count in per_task.items():
        table.add_row(Text(escape_controls(name)), str(count))
    out.print(table)
    plan = f"the plan of {resume}" if resume is not None else settings.suite
    say("dry run:", f"{len(episodes)} episodes of {len(per_task)} tasks ({plan}), -e {settings.environment_type}, "
        f"-a {settings.agent}, -n {settings.n_concurrent}; every check passed, nothing started", "bold")


#: ``harbor run``'s own defaults of ``-e`` and ``-n``, which differ from ours.
HARBOR_DEFAULTS = {"env": "docker", "n_concurrent": 4}


def defaults_line(env: str | None, n_concurrent: int | None, settings: JobSettings) -> str | None:
    """One line naming the backend and concurrency a run took by default, beside ``harbor run``'s (``None``: both given)."""
    said = []
    if env is None:
        said.append(f"-e {settings.environment_type} (harbor run's default: -e {HARBOR_DEFAULTS['env']})")
    if n_concurrent is None:
        said.append(f"-n {settings.n_concurrent} (harbor run's: -n {HARBOR_DEFAULTS['n_concurrent']})")
    return f"defaults: {', '.join(said)}; give -e/-n to choose" if said else None


def env_pairs(pairs: list[str] | None, flag: str) -> dict[str, str] | None:
    """``--ae``/``--ve``'s ``KEY=VALUE`` pairs (``None``: not given); a malformed pair exits 2 naming it."""

    if pairs is None:
        return None
    try:
        return parse_env_pairs(pairs, flag)
    except ValueError as exc:
        raise fail(exc) from None


def load_env_file(path: Path | str | None) -> str | None:
    """Harbor's ``--env-file``: the file's variables into this process's environment (over the shell's, as Harbor
    loads it); what reaches a task or an agent is still only what ``--env-allow`` names. Its path, for the job."""
    if path is None:
        return None
    from dotenv import load_dotenv

    path = Path(path).expanduser()
    if not path.is_file():
        raise fail(f"--env-file {path}: no such file")
    load_dotenv(path, override=True)
    return str(path.resolve())


def mounts_option(text: str | None, writable: bool) -> list[dict[str, Any]]:
    """``--mounts``' JSON, normalized (:mod:`harbor_async.tasks.mounts`: read-only unless ``--mounts-writable``); else exit 2."""

    try:
        return parse_mounts(text, writable=writable)
    except MountError as exc:
        raise fail(exc) from None


def checked_mounts(spec: Any, settings: JobSettings) -> None:
    """A job's mounts checked again (a resume's host paths may be gone) and against its backend; else exit 2."""

    try:
        refuse_mounting_options(settings.environment_kwargs)  # Harbor's own (writable unless each says not)
        normalized(settings.mounts, writable=settings.mounts_writable)
        check_backend(spec.environment_class(), spec.name, settings.mounts)
    except MountError as exc:
        raise fail(exc) from None


def refuse_protected_mounts(settings: JobSettings, jobs_dir: Path) -> None:
    """Exit 2 when a ``--mounts`` source overlaps the suite's task folders (their tests and solutions) or the jobs
    folder (every trial's rewards): the sandbox's code would read, or with a writable mount change, them."""

    if not settings.mounts:
        return
    suite = settings.suite
    folders = [suite] if isinstance(suite, str) else list(suite or [])
    protected: dict[str, Any] = {"the jobs folder": jobs_dir}
    local = [folder for folder in folders if "://" not in folder and Path(folder).exists()]
    protected.update({"the suite" if len(local) == 1 else f"the suite's task folder {i}": f for i, f in enumerate(local)})
    try:
        refuse_protected(settings.mounts, protected)
    except MountError as exc:
        raise fail(exc) from None
