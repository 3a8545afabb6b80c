"""Task suites: a local tree or a Hugging Face dataset repo -> validated Harbor tasks.

A *suite* is a folder of Harbor task folders, laid out either as
``<root>/tasks/<name>/task.toml`` (the Hugging Face dataset layout TRL's
``HarborSpec`` reads) or as ``<root>/<name>/task.toml``. A *source* is one of:

- ``None``: the example suite bundled with this package;
- a local path (``str`` or :class:`~pathlib.Path`) to such a tree;
- a Hugging Face dataset repo id, ``"org/name"`` (optionally ``"org/name@revision"``
  or with an ``hf:`` prefix), downloaded with
  ``huggingface_hub.snapshot_download(repo, repo_type="dataset", allow_patterns=["tasks/**"])``;
- a dataset of Harbor's registry, ``"name@version"``, or a list of task folders
  (such a dataset downloaded, see :mod:`harbor_async.tasks.registry`), kept in its order.

Every task is parsed with Harbor's own :class:`harbor.models.task.task.Task`, so a
task that loads here also loads in Harbor. Tasks of a folder are ordered by folder name, the
order TRL's ``HarborSpec`` uses, so ``num_tasks`` / ``indices`` select the same
tasks as there. A broken task never breaks the suite: it is reported in
:attr:`TaskSuite.invalid` with its reason, logged as a warning, and left out.
"""

from __future__ import annotations

import fnmatch
import operator
import os
import re
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from harbor.models.task.config import TaskConfig
from harbor.models.task.task import Task
from pydantic import ValidationError

from harbor_async.core.errors import (
    EmptySuiteError,
    RegistryError,
    SuiteNotFoundError,
    TaskLoadError,
)
from harbor_async.core.logs import get_logger
from harbor_async.tasks.files import remember_file_filter
from harbor_async.tasks.registry import HF_PREFIXES, parse_hf

__all__ = [
    "EmptySuiteError",
    "InvalidTask",
    "SuiteNotFoundError",
    "TaskLoadError",
    "TaskSuite",
    "load_suite",
    "load_task",
]

log = get_logger(__name__)

#: The only part of a dataset repo that is downloaded.
HUB_ALLOW_PATTERNS: list[str] = ["tasks/**"]

# A Harbor registry dataset with its version ("name@version"), as a source string (HarborSpec's).
_REGISTRY_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9._+-]*$")
# A Hub repo id: "org/name", each part alphanumeric plus . _ - (no leading dot or dash).
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class InvalidTask:
    """A task folder that was found in a suite but left out, and why."""

    path: Path
    reason: str


@dataclass
class TaskSuite:
    """The valid tasks of a suite, in suite order, plus the ones left out.

    Attributes:
        root: the folder holding the task folders (``<suite>/tasks`` for the
            ``tasks/`` layout); passing it back to :func:`load_suite` loads the
            same suite. For a list of task folders: their common parent.
        tasks: the valid tasks as Harbor :class:`~harbor.models.task.task.Task`
            objects, sorted by folder name (or in ``indices`` order).
        invalid: task folders that failed validation, with their reasons.
        positions: each task's position among the suite's task folders, as
            the caller's ``indices`` spelt it (``-1`` stays ``-1``: TRL's ``task_index``).
    """

    root: Path
    tasks: list[Task]
    invalid: list[InvalidTask] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    @property
    def task_dirs(self) -> list[Path]:
        """The absolute task folders, in suite order (what TRL's ``reset(task_dir)`` takes)."""
        return [task.task_dir for task in self.tasks]

    @property
    def names(self) -> list[str]:
        """Harbor's task names (``[task].name`` if set, else the folder name), in suite order."""
        return [task.name for task in self.tasks]

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __getitem__(self, index: int) -> Task:
        return self.tasks[index]


# ── single task ─────────────────────────────────────────────────────────────


def _validation_summary(error: ValidationError) -> str:
    parts = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


#: The parts of a task folder that a loader or a backend reads from the host.
TASK_ENTRIES = ("instruction.md", "tests", "solution", "environment")


def task_path_escapes(task_dir: Path) -> list[tuple[Path, Path]]:
    """The task's entries (:data:`TASK_ENTRIES`) that are symlinks leading out of it, with their targets."""
    root = task_dir.resolve()
    found = []
    for name in TASK_ENTRIES:
        path = task_dir / name
        if os.path.lexists(path):
            target = path.resolve()
            if not target.is_relative_to(root):
                found.append((path, target))
    return found


def matches_names(name: str, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None) -> bool:
    """Whether a task's folder name passes ``harbor run``'s ``-i/--include-task-name`` and ``-x/--exclude-task-name`` globs."""
    if include and not any(fnmatch.fnmatchcase(name, pattern) for pattern in include):
        return False
    return not (exclude and any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude))


def suite_task_path(task: Task, root: Path | str) -> str:
    """The task's path relative to its suite root: how job records name it, stable across machines and caches.

    A task outside the root keeps its absolute path.
    """
    try:
        return Path(task.paths.task_dir).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(task.paths.task_dir)


#: The longest phase budget a task may set (a week): past it a number is a mistake, or an attack
#: that a timeout multiplier would turn into an overflow.
MAX_TASK_SECONDS = 7 * 24 * 3600.0


def _insane_value(config: TaskConfig) -> str | None:
    """Why a timeout or resource of the task cannot be right (``None``: they are sane).

    Timeouts must be finite, above 0 and at most :data:`MAX_TASK_SECONDS`; the
    resources a task asks for (``cpus``, ``memory_mb``, ``storage_mb``) above 0.
    """
    sections = (
        ("agent", config.agent), ("verifier", config.verifier), ("environment", config.environment),
        *((f"steps[{i}].agent", step.agent) for i, step in enumerate(config.steps or []) if getattr(step, "agent", None)),
        *((f"steps[{i}].verifier", step.verifier) for i, step in enumerate(config.steps or []) if getattr(step, "verifier", None)),
    )  # fmt: skip
    for name, section in sections:
        for field_name in ("timeout_sec", "build_timeout_sec"):
            value = getattr(section, field_name, None)
            if value is None or field_name not in getattr(section, "model_fields_set", ()):
                continue
            if isinstance(value, bool) or not (0 < float(value) <= MAX_TASK_SECONDS):  # also nan and inf
                return f"[{name}] {field_name} = {value!r} is not a number of seconds in (0, {MAX_TASK_SECONDS:g}]"
    for field_name in ("cpus", "memory_mb", "storage_mb"):
        value = getattr(config.environment, field_name, None)
        if value is not None and (isinstance(value, bool) or not (0 < float(value) < float("inf"))):
            return f"[environment] {field_name} = {value!r} must be above 0"
    return None


def load_task(path: Path | str) -> Task:
    """Load and validate one task folder with Harbor's ``Task`` model.

    Checks, in order: the folder exists; ``task.toml`` exists, is valid TOML and
    validates as Harbor's ``TaskConfig``; there is an ``environment/`` folder (or
    ``[environment].docker_image``); ``instruction.md`` exists and is not empty;
    then Harbor's own checks (a verifier script such as ``tests/test.sh``, input
    paths staying inside the task).

    Args:
        path: the task folder (the one holding ``task.toml``).

    Returns:
        The Harbor task.

    Raises:
        TaskLoadError: with the folder and a one-line reason when any check fails.
    """
    task_dir = Path(path).expanduser()
    if not task_dir.is_dir():
        reason = "not a directory" if task_dir.exists() else "no such directory"
        raise TaskLoadError(task_dir, reason)

    config_path = task_dir / "task.toml"
    if not config_path.is_file():
        raise TaskLoadError(task_dir, "missing task.toml")
    try:
        data = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise TaskLoadError(task_dir, f"invalid TOML in task.toml: {e}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise TaskLoadError(task_dir, f"cannot read task.toml: {e}") from e
    try:
        config = TaskConfig.model_validate(data)
    except ValidationError as e:
        raise TaskLoadError(task_dir, f"invalid task.toml: {_validation_summary(e)}") from e
    except (ValueError, TypeError) as e:
        raise TaskLoadError(task_dir, f"invalid task.toml: {e}") from e

    if (problem := _insane_value(config)) is not None:
        raise TaskLoadError(task_dir, f"invalid task.toml: {problem}")
    for entry, target in task_path_escapes(task_dir):  # as Docker refuses a build-context escape
        raise TaskLoadError(task_dir, f"{entry.name} leads out of the task folder (to {target}); refusing to follow it")
    if not config.environment.docker_image and not (task_dir / "environment").is_dir():
        raise TaskLoadError(task_dir, "missing environment/ folder (and no [environment].docker_image)")
    if not config.steps:
        instruction = task_dir / "instruction.md"
        if not instruction.is_file():
            raise TaskLoadError(task_dir, "missing instruction.md")
        try:
            if not instruction.read_text(encoding="utf-8").strip():
                raise TaskLoadError(task_dir, "instruction.md is empty")
        except (OSError, UnicodeDecodeError) as e:
            raise TaskLoadError(task_dir, f"cannot read instruction.md: {e}") from e

    try:
        return remember_file_filter(Task(task_dir))
    except ValidationError as e:
        raise TaskLoadError(task_dir, f"invalid task: {_validation_summary(e)}") from e
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        raise TaskLoadError(task_dir, str(e) or type(e).__name__) from e


# ── suite sources ───────────────────────────────────────────────────────────


def _parse_hub_source(source: str) -> tuple[str, str | None] | None:
    """Return (repo_id, revision) when ``source`` names a Hub dataset, else None."""
    try:
        explicit = parse_hf(source)  # hf:org/name, hf://org/name
    except RegistryError as exc:
        raise SuiteNotFoundError(str(exc)) from None
    if explicit is not None:
        return explicit
    repo_id, _, revision = source.partition("@")
    if _REPO_ID_RE.match(repo_id) and ".." not in repo_id:
        return repo_id, revision or None
    return None


def _download_hub_suite(repo_id: str, revision: str | None) -> Path:
    """Download the ``tasks/`` tree of a Hub dataset repo; return the snapshot folder."""
    import huggingface_hub  # imported here: the hub client is only needed for this path

    log.info("downloading task suite", repo_id=repo_id, revision=revision)
    try:
        path = huggingface_hub.snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=revision,
            allow_patterns=HUB_ALLOW_PATTERNS,
        )
    except Exception as e:  # network, auth, missing repo: all mean "suite not found"
        raise SuiteNotFoundError(
            f"task suite {repo_id!r} is not a local path, and downloading it as a Hugging Face "
            f"dataset failed: {type(e).__name__}: {e}"
        ) from e
    root = Path(path)
    if not (root / "tasks").is_dir():
        raise SuiteNotFoundError(
            f"Hugging Face dataset {repo_id!r} has no tasks/ folder (downloaded to {root})"
        )
    return root


def _resolve_source(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None) -> Path | list[Path]:
    """Turn a suite source into a local directory (downloading a Hub dataset if named), or a list of task folders."""
    if source is None:
        from harbor_async.suites import example_suite_path

        return example_suite_path()
    if isinstance(source, Sequence) and not isinstance(source, str):
        if not source:
            raise SuiteNotFoundError("task suite source is an empty list of task folders")
        return [Path(item).expanduser() for item in source]
    if isinstance(source, str):
        if not source.strip():
            raise SuiteNotFoundError("task suite source is empty")
        if source.startswith(HF_PREFIXES):
            return _download_hub_suite(*_parse_hub_source(source))  # type: ignore[misc]
        local = Path(source).expanduser()
        if not local.exists():
            # Only a string shaped like "org/name" goes to the Hub, only "name@version" to
            # Harbor's registry; "./x", "/x", "~/x", "x" and "a/b/c" are local paths that do not exist.
            hub = _parse_hub_source(source)
            if hub is not None:
                return _download_hub_suite(*hub)
            if _REGISTRY_REF_RE.match(source):
                from harbor_async.tasks.registry import fetch_dataset

                name, _, version = source.partition("@")
                return list(cast("tuple[Path, ...]", fetch_dataset(name, version).source))  # folders, never hf://
            raise SuiteNotFoundError(
                f"task suite path {source!r} does not exist (and is not a Hugging Face "
                "dataset id of the form 'org/name', nor a Harbor registry dataset 'name@version')"
            )
    else:
        local = Path(source).expanduser()
    if not local.exists():
        raise SuiteNotFoundError(f"task suite path {str(local)!r} does not exist")
    if not local.is_dir():
        raise SuiteNotFoundError(f"task suite path {str(local)!r} is not a directory")
    return local


def _tasks_root(suite_dir: Path) -> Path:
    """The folder holding the task folders: ``<suite>/tasks`` if present, else the suite itself."""
    nested = suite_dir / "tasks"
    return nested if nested.is_dir() else suite_dir


def _scan(tasks_root: Path) -> tuple[list[Path], list[InvalidTask]]:
    """Task folders (with task.toml), sorted by name, and folders that look like broken tasks."""
    candidates: list[Path] = []
    broken: list[InvalidTask] = []
    for child in sorted(tasks_root.iterdir(), key=lambda p: p.name):
        if not child.is_dir() or child.name.startswith(".") or child.name == "__pycache__":
            continue
        if (child / "task.toml").is_file():
            candidates.append(child)
        elif (child / "instruction.md").exists():
            broken.append(InvalidTask(child.resolve(), "missing task.toml"))
    return candidates, broken


def _listed(task_dirs: list[Path]) -> tuple[Path, list[Path], list[InvalidTask]]:
    """A list of task folders (a registry dataset): their common root, the task folders in order, the broken ones."""
    resolved = list(dict.fromkeys(path.resolve() for path in task_dirs))  # a folder listed twice once
    root = Path(os.path.commonpath([path.parent for path in resolved]))
    candidates: list[Path] = []
    broken: list[InvalidTask] = []
    for path in resolved:
        if (path / "task.toml").is_file():
            candidates.append(path)
        else:
            broken.append(InvalidTask(path, "missing task.toml" if path.is_dir() else "no such directory"))
    return root, candidates, broken


def _select(
    candidates: list[Path],
    tasks_root: Path,
    num_tasks: int | None,
    indices: Sequence[int] | None,
) -> list[Path]:
    n = len(candidates)
    if indices is not None:
        if isinstance(indices, (str, bytes)):
            raise TypeError("indices must be a sequence of integers")
        if len(indices) == 0:
            raise ValueError("indices is empty: select at least one task")
        chosen = []
        for raw in indices:
            i = operator.index(raw)
            if not -n <= i < n:
                raise IndexError(
                    f"task index {i} is out of range: suite {tasks_root} has {n} task(s) "
                    f"(valid indices 0..{n - 1})"
                    if n
                    else f"task index {i} is out of range: suite {tasks_root} has no tasks"
                )
            chosen.append(candidates[i])
        return chosen
    if num_tasks is not None:
        num_tasks = operator.index(num_tasks)
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be at least 1, got {num_tasks}")
        return candidates[:num_tasks]
    return candidates


def load_suite(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    *,
    num_tasks: int | None = None,
    indices: Sequence[int] | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> TaskSuite:
    """Load a task suite, select its tasks and validate them with Harbor's ``Task`` model.

    The one task selection of ``run``, ``eval`` and the shim: ``indices``, or
    ``harbor run``'s globs on task names (``include``/``exclude``) first and
    then the first ``num_tasks`` of what they kept.

    Args:
        source: ``None`` for the bundled example suite; a local folder laid out as
            ``<root>/tasks/<name>/task.toml`` or ``<root>/<name>/task.toml``; or a
            Hugging Face dataset repo id ``"org/name"`` (``"org/name@revision"``,
            ``"hf://org/name"`` also accepted), of which only ``tasks/**`` is
            downloaded. A string is a repo id only when no such local path exists
            and it looks like one; ``"./x"``, ``"/x"`` or ``"~/x"`` are always local.
            ``"hf:org/name"`` is always a repo id; ``"name@version"`` that is no local
            path is a dataset of Harbor's registry, downloaded into Harbor's task cache
            (:func:`harbor_async.tasks.registry.fetch_dataset`). A list of task folders (such a
            dataset as :func:`harbor_async.tasks.registry.resolve_dataset` gives it) keeps its
            order; its root is the folders' common parent.
        num_tasks: keep only the first ``num_tasks`` task folders (at least 1).
        indices: keep the task folders at these positions, in this order
            (repeats allowed, negative positions count from the end).
            Mutually exclusive with ``num_tasks``.
        include, exclude: keep only the tasks whose name matches one of the
            ``include`` globs and none of the ``exclude`` ones (``-i``/``-x``);
            then ``num_tasks`` counts the tasks kept.

    Positions refer to the task folders (those with a ``task.toml``) sorted by
    folder name, exactly as in TRL's ``HarborSpec``; only the selected folders are
    validated, and a selected folder that fails validation is left out (so the
    suite can hold fewer tasks than selected). Folders that hold an
    ``instruction.md`` but no ``task.toml`` are always reported as invalid.

    Returns:
        The suite: valid tasks in order, and the invalid ones with reasons (each
        also logged as a warning).

    Raises:
        ValueError: both ``num_tasks`` and ``indices`` given, ``num_tasks < 1``, or
            empty ``indices``.
        IndexError: an index outside the suite, naming the index and the suite size.
        SuiteNotFoundError: the local path does not exist, or the Hub download failed;
            :class:`~harbor_async.core.errors.RegistryError` for a registry dataset.
        EmptySuiteError: no valid task in the (selected part of the) suite; the
            message lists each invalid task's reason. :class:`NoMatchingTaskError`
            when valid tasks exist but none matches the globs.
    """
    if num_tasks is not None and indices is not None:
        raise ValueError("pass num_tasks or indices, not both")

    resolved = _resolve_source(source)
    if isinstance(resolved, list):
        tasks_root, candidates, invalid = _listed(resolved)
    else:
        tasks_root = _tasks_root(resolved).resolve()
        candidates, invalid = _scan(tasks_root)
    if not candidates and not invalid:
        raise EmptySuiteError(tasks_root)
    include = [include] if isinstance(include, str) else include  # one glob, not its characters
    exclude = [exclude] if isinstance(exclude, str) else exclude
    filtered = bool(include or exclude)  # every task folder is read for its name, then the first num_tasks kept
    selected = _select(candidates, tasks_root, None if filtered else num_tasks, indices)

    tasks: list[Task] = []
    positions: list[int] = []
    position = {path: i for i, path in enumerate(candidates)}
    labels = [operator.index(i) for i in indices] if indices is not None else [position[p] for p in selected]
    loaded: dict[Path, Task] = {}
    failed: dict[Path, InvalidTask] = {}
    for task_dir, label in zip(selected, labels, strict=True):
        if task_dir in loaded:
            tasks.append(loaded[task_dir])
            positions.append(label)
            continue
        if task_dir in failed:
            continue
        try:
            task = load_task(task_dir)
        except TaskLoadError as e:
            failed[task_dir] = InvalidTask(task_dir.resolve(), e.reason)
            continue
        except Exception as e:  # noqa: BLE001 - a broken task must never break the suite
            failed[task_dir] = InvalidTask(task_dir.resolve(), f"{type(e).__name__}: {e}")
            continue
        loaded[task_dir] = task
        tasks.append(task)
        positions.append(label)
    invalid.extend(failed.values())
    invalid.sort(key=lambda t: t.path.name)

    for bad in invalid:
        log.warning("invalid task left out of suite", path=str(bad.path), reason=bad.reason)
    if not tasks:
        raise EmptySuiteError(tasks_root, invalid)
    if filtered:
        # By folder name, as Harbor's LocalTaskId/GitTaskId.get_name: not a [task] name = "org/name".
        kept = [
            (t, p) for t, p in zip(tasks, positions, strict=True)
            if matches_names(Path(t.paths.task_dir).resolve().name, include, exclude)
        ]  # fmt: skip
        if not kept:
            raise NoMatchingTaskError(tasks_root, include, exclude)
        kept = kept[:num_tasks] if num_tasks is not None else kept
        tasks, positions = [t for t, _ in kept], [p for _, p in kept]
    return TaskSuite(root=tasks_root, tasks=tasks, invalid=invalid, positions=positions)


class NoMatchingTaskError(EmptySuiteError):
    """The suite has valid tasks, but none whose name the ``include``/``exclude`` globs keep."""

    def __init__(self, root: Path, include: Sequence[str] | None, exclude: Sequence[str] | None) -> None:
        super().__init__(root)
        globs = " ".join([f"-i {p!r}" for p in include or ()] + [f"-x {p!r}" for p in exclude or ()])
        self.include, self.exclude = list(include or ()), list(exclude or ())
        self.args = (f"no task of {root} matches {globs}",)

    def __reduce__(self):
        return (type(self), (self.root, self.include, self.exclude))
