"""``-d`` as Harbor spells it: registry datasets, and Hugging Face repos as ``hf:org/name``.

- ``name@version`` (or ``name``: Harbor's default version, ``head`` else the
  highest) is looked up in Harbor's registry through Harbor's own registry
  client (:class:`harbor.registry.client.factory.RegistryClientFactory`): the
  default registry, a ``--registry-url`` or a ``--registry-path`` JSON file. Its
  tasks are downloaded by Harbor's :class:`harbor.tasks.client.TaskClient` into
  Harbor's task cache (``~/.cache/harbor/tasks``), as ``harbor run -d`` does; a
  git URL may be a local repository (a path or ``file://``), so a registry file
  works offline.
- ``hf:org/name`` (``hf:org/name@revision``) is a Hugging Face dataset repo,
  downloaded by :func:`harbor_async.tasks.suite.load_suite`.
- ``org/name`` without ``hf:`` meant a Hugging Face repo in earlier releases. It
  still does for one release, with a deprecation notice, when the registry does
  not know the name (or Harbor's default registry cannot be reached).

``-t NAME[@REF]`` (:func:`resolve_task`) is one task, downloaded the same way:

- in a registry file or ``--registry-url`` document, ``NAME`` is a task's
  ``name`` as its datasets list it (any dataset, any version) and ``REF`` its
  git commit (a prefix will do); a name the datasets list as different tasks
  (another git URL, commit or path) is refused, naming them, unless ``@REF``
  picks one;
- in Harbor's own registry (neither option), ``org/name[@ref]`` is a Harbor
  package (``ref``: a tag, revision or digest, ``latest`` by default), fetched
  by Harbor's :class:`~harbor.tasks.client.TaskClient` as ``harbor run -t`` does.

Every registry call runs in its own short-lived thread with its own event loop:
callers may be inside a running loop (a notebook building a ``HarborSpec``), and
a registry that never answers is abandoned after :data:`LOOKUP_TIMEOUT`, never
waited for.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from harbor_async.core.errors import (
    RegistryError,
    RegistryFileError,
    RegistryUnreachableError,
    UnknownDatasetError,
)
from harbor_async.core.logs import get_logger

if TYPE_CHECKING:
    from harbor.models.registry import DatasetMetadata, RegistryTaskId
    from harbor.registry.client.base import BaseRegistryClient

__all__ = [
    "HF_PREFIXES", "AmbiguousTaskError", "Dataset", "Registry", "RegistryTask", "UnknownTaskError", "fetch_dataset",
    "parse_hf", "parse_task_ref", "resolve_dataset", "resolve_task",
]  # fmt: skip

log = get_logger(__name__)
T = TypeVar("T")

#: The spellings of a Hugging Face dataset repo: ``hf:org/name`` (``hf://`` as earlier releases wrote it).
HF_PREFIXES = ("hf://", "hf:")
#: The ref of ``-t NAME`` without one, as Harbor writes it (``harbor run -t org/name`` is ``org/name@latest``).
LATEST = "latest"
#: Seconds a registry lookup may take (``HARBOR_ASYNC_REGISTRY_TIMEOUT``); downloads are not bounded, as in Harbor.
LOOKUP_TIMEOUT = float(os.environ.get("HARBOR_ASYNC_REGISTRY_TIMEOUT") or 60.0)


@dataclass(frozen=True)
class Registry:
    """Where registry datasets are looked up: Harbor's ``--registry-url`` / ``--registry-path`` (neither: Harbor's default)."""

    url: str | None = None
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.url is not None and self.path is not None:
            raise RegistryError("give --registry-url or --registry-path, not both")

    @property
    def explicit(self) -> bool:
        """Whether the user named this registry (else Harbor's default one)."""
        return self.url is not None or self.path is not None

    def __str__(self) -> str:
        if self.path is not None:
            return f"registry file {self.path}"
        return f"registry {self.url}" if self.url is not None else "Harbor's registry"


@dataclass(frozen=True)
class Dataset:
    """A resolved ``-d``: what :func:`~harbor_async.tasks.suite.load_suite` loads, and its name.

    Attributes:
        source: ``"hf://org/name[@revision]"``, or the registry dataset's task
            folders (downloaded), in the registry's order.
        name: the dataset as resolved: ``name@version`` or ``hf:org/name[@revision]``.
        deprecation: a one-line notice for the caller to show, when the spelling is deprecated.
    """

    source: str | tuple[Path, ...]
    name: str
    deprecation: str | None = None


class UnknownTaskError(RegistryError):
    """The registry lists no task of that name (``-t NAME``), or none at that git commit (``-t NAME@REF``).

    Attributes:
        name: the task's name.
        ref: the ref asked for (``None``: the name itself is unknown).
        known: the task's commits (a ref unknown), or registry task names close to the name.
    """

    def __init__(self, message: str, name: str, ref: str | None, known: Sequence[str]) -> None:
        super().__init__(message)
        self.name, self.ref, self.known = name, ref, list(known)

    def __reduce__(self):
        return (type(self), (str(self), self.name, self.ref, self.known))


class AmbiguousTaskError(RegistryError):
    """``-t NAME`` names different tasks in the registry's datasets (another git URL, commit or path).

    Attributes:
        name: the task's name.
        datasets: each dataset (``name@version``) listing it, with the commit it pins (``None``: its HEAD).
    """

    def __init__(self, message: str, name: str, datasets: Sequence[tuple[str, str | None]]) -> None:
        super().__init__(message)
        self.name, self.datasets = name, list(datasets)

    def __reduce__(self):
        return (type(self), (str(self), self.name, self.datasets))


@dataclass(frozen=True)
class RegistryTask:
    """A resolved ``-t``: the task's folder (downloaded into Harbor's cache) and what it was resolved as.

    Attributes:
        path: the task's folder.
        name: the task's name as given (``NAME``), ``ref`` the ref given (``latest`` when none, as Harbor writes it).
        source: where it came from, for messages: ``dataset@version`` (commit) or ``org/name@ref``.
    """

    path: Path
    name: str
    ref: str
    source: str


def parse_hf(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` of ``hf:org/name[@revision]`` (or ``hf://...``); ``None`` without the prefix.

    Raises:
        RegistryError: the prefix with no repo id after it.
    """
    prefix = next((p for p in HF_PREFIXES if text.startswith(p)), None)
    if prefix is None:
        return None
    spec = text[len(prefix) :].removeprefix("datasets/")
    repo_id, _, revision = spec.partition("@")
    if not repo_id.strip("/"):
        raise RegistryError(f"no dataset repo id in {text!r} (write hf:org/name)")
    return repo_id, revision or None


def resolve_dataset(text: str, *, registry_url: str | None = None, registry_path: Path | str | None = None) -> Dataset:
    """Resolve ``-d TEXT`` before any sandbox starts: a registry dataset (downloaded) or a Hugging Face repo.

    Args:
        text: ``name@version``, ``name``, ``hf:org/name[@revision]``, or the
            deprecated ``org/name[@revision]``.
        registry_url, registry_path: Harbor's ``--registry-url`` / ``--registry-path``.

    Raises:
        RegistryError: one line saying why (its subclasses: the registry could not
            be reached, its file is unreadable or invalid, the dataset or version is
            unknown, a download failed).
    """
    text = text.strip()
    if not text:
        raise RegistryError("-d is empty: give name@version or hf:org/name")
    hub = parse_hf(text)
    if hub is not None:
        repo_id, revision = hub
        at = f"@{revision}" if revision else ""
        return Dataset(f"hf://{repo_id}{at}", f"hf:{repo_id}{at}")
    registry = Registry(registry_url, Path(registry_path).expanduser() if registry_path is not None else None)
    name, _, version = text.partition("@")
    if not name:
        raise RegistryError(f"-d {text!r} has no dataset name (write name@version or hf:org/name)")
    if "/" not in name:
        return fetch_dataset(name, version or None, registry)
    # org/name: Harbor's registry first; else the Hugging Face repo it named in earlier releases.
    try:
        return fetch_dataset(name, version or None, registry)
    except UnknownDatasetError as exc:
        if exc.version is not None:  # the registry knows the name: its versions are the answer
            raise
        why = f"{registry} has no dataset {name!r}"
    except RegistryUnreachableError:
        if registry.explicit:
            raise
        why = f"{registry} could not be reached"
    notice = (
        f"-d {text} is read as the Hugging Face dataset hf:{text} ({why}); write -d hf:{text}: "
        "the spelling without hf: goes in the next release"
    )
    return Dataset(f"hf://{text}", f"hf:{text}", deprecation=notice)


def fetch_dataset(name: str, version: str | None = None, registry: Registry | None = None) -> Dataset:
    """Look ``name@version`` up in the registry and download its tasks into Harbor's task cache.

    ``version=None`` takes Harbor's default (``head`` if listed, else the highest version).

    Raises:
        RegistryError: as :func:`resolve_dataset`.
    """
    registry = registry or Registry()
    metadata = _bounded(lambda: _lookup(name, version, registry), LOOKUP_TIMEOUT, str(registry))
    label = f"{metadata.name}@{metadata.version}" if metadata.version else metadata.name
    if not metadata.task_ids:
        raise RegistryError(f"dataset {label} of {registry} lists no tasks")
    log.info("downloading registry dataset", dataset=label, tasks=len(metadata.task_ids), registry=str(registry))
    paths = _bounded(lambda: _download(list(metadata.task_ids), f"dataset {label}"), None, str(registry))
    return Dataset(tuple(dict.fromkeys(paths)), label)  # a task listed twice runs once, as Harbor dedupes


def parse_task_ref(text: str) -> tuple[str, str]:
    """``(name, ref)`` of ``-t NAME[@REF]`` as Harbor parses it: the last ``@`` splits; no ref is ``latest``."""
    name, at, ref = text.strip().rpartition("@")
    return (name, ref or LATEST) if at else (ref, LATEST)


def resolve_task(text: str, *, registry_url: str | None = None, registry_path: Path | str | None = None) -> RegistryTask:
    """Resolve ``-t NAME[@REF]`` before any sandbox starts: one registry task, downloaded (see the module doc).

    Args:
        text: ``NAME`` or ``NAME@REF`` (a registry file's task and its git commit; Harbor's ``org/name@ref``).
        registry_url, registry_path: Harbor's ``--registry-url`` / ``--registry-path`` (neither: Harbor's registry).

    Raises:
        RegistryError: one line saying why (its subclasses: :class:`UnknownTaskError`, :class:`AmbiguousTaskError`,
            the registry unreachable or its file invalid, a download failed).
    """
    from harbor.constants import DEFAULT_REGISTRY_URL

    name, ref = parse_task_ref(text)
    if not name:
        raise RegistryError(f"-t {text!r} has no task name (write NAME or NAME@REF)")
    registry = Registry(registry_url, Path(registry_path).expanduser() if registry_path is not None else None)
    if registry.path is None and registry.url in (None, DEFAULT_REGISTRY_URL):  # Harbor's registry: its packages
        return _bounded(lambda: _fetch_package(name, ref), None, str(registry))
    found, source = _bounded(lambda: _find_task(name, ref, registry), LOOKUP_TIMEOUT, str(registry))
    paths = _bounded(lambda: _download([found.to_source_task_id()], f"task {name}"), None, str(registry))
    return RegistryTask(paths[0], name, ref, source)


# ── Harbor's registry client, on a thread of its own ─────────────────────────


def _bounded(fn: Callable[[], T], timeout: float | None, where: str) -> T:
    """``fn()`` on a daemon thread, waited for at most ``timeout`` seconds (``None``: until done)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="harbor-async-registry", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():  # a connection that never answers: left behind (daemon), not waited for
        raise RegistryUnreachableError(f"{where} did not answer within {timeout:g} s (HARBOR_ASYNC_REGISTRY_TIMEOUT)")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _open(registry: Registry) -> BaseRegistryClient:
    """Harbor's client for the registry; a file is read (a URL fetched) here."""
    from harbor.registry.client.factory import RegistryClientFactory
    from pydantic import ValidationError

    try:
        return RegistryClientFactory.create(registry_url=registry.url, registry_path=registry.path)
    except OSError as exc:  # a file that is not there, a folder, no permission; requests' errors are OSErrors too
        if registry.path is not None:
            raise RegistryFileError(f"cannot read {registry}: {exc.strerror or exc}") from None
        raise RegistryUnreachableError(f"cannot reach {registry}: {_first_line(exc)}") from None
    except ValidationError as exc:  # rows that are no dataset
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise RegistryFileError(
            f"{registry} is not a Harbor registry (a JSON list of datasets): {exc.error_count()} error(s) in its "
            f"datasets, the first: {where + ': ' if where else ''}{first.get('msg', 'invalid')}"
        ) from None
    except (ValueError, TypeError, AttributeError) as exc:  # not JSON
        raise RegistryFileError(f"{registry} is not a Harbor registry (a JSON list of datasets): {_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - anything else a URL's fetch raises
        raise RegistryUnreachableError(f"cannot reach {registry}: {_first_line(exc)}") from None


def _lookup(name: str, version: str | None, registry: Registry) -> DatasetMetadata:
    """The dataset's metadata by Harbor's client; on a miss, the registry's listing says which part is unknown."""
    client = _open(registry)
    ref = f"{name}@{version}" if version else name
    try:
        return asyncio.run(client.get_dataset_metadata(ref))
    except Exception as exc:  # noqa: BLE001 - Harbor says "not found" and "unreachable" alike; the listing tells them apart
        miss = exc
    try:
        listed = asyncio.run(client.list_datasets())
    except Exception as exc:  # noqa: BLE001 - network, service errors
        raise RegistryUnreachableError(f"cannot reach {registry}: {_first_line(exc)}") from None
    names = sorted({d.name for d in listed})
    versions = sorted({d.version for d in listed if d.name == name and d.version is not None})
    if name not in names:
        near = names if len(names) <= 10 else difflib.get_close_matches(name, names, n=5)
        hint = f"; {'its datasets' if len(names) <= 10 else 'close names'}: {', '.join(near)}" if near else ""
        raise UnknownDatasetError(f"{registry} has no dataset {name!r}{hint}", name, None, near)
    if version is not None and version not in versions:
        raise UnknownDatasetError(
            f"{registry} has no version {version!r} of dataset {name!r}; its versions: {', '.join(versions) or 'none'}",
            name, version, versions,
        )  # fmt: skip
    raise RegistryUnreachableError(f"{registry} failed to give dataset {ref}: {_first_line(miss)}")


def _download(task_ids: list[Any], what: str, passed: type[BaseException] | tuple[()] = ()) -> list[Path]:
    """The tasks' folders, downloaded (git: shallow sparse clones) into Harbor's task cache by Harbor's client.

    ``what``: ``dataset NAME@VERSION`` or ``task NAME``, for the error's message; ``passed``: raised as it is
    (the caller's to type), out of the task group Harbor's client may wrap it in.
    """
    from harbor.tasks.client import TaskClient

    try:
        result = asyncio.run(TaskClient().download_tasks(task_ids=list(task_ids)))
    except Exception as group:  # noqa: BLE001 - typed below, by the error inside any task group
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        if passed and isinstance(exc, passed):
            raise exc from None
        _download_failed(exc, what)
    return [Path(path).expanduser() for path in result.paths]


def _download_failed(exc: BaseException, what: str) -> NoReturn:
    if isinstance(exc, subprocess.CalledProcessError):
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        detail = next((line for line in reversed(stderr.splitlines()) if line.strip()), f"exit status {exc.returncode}")
        raise RegistryError(f"downloading {what} failed: {' '.join(map(str, exc.cmd[:2]))}: {detail}") from None
    # a missing local task, a link out of a task, no git; the package service unreachable
    raise RegistryError(f"downloading {what} failed: {_first_line(exc)}") from None


def _find_task(name: str, ref: str, registry: Registry) -> tuple[RegistryTaskId, str]:
    """The registry task ``name`` (at commit ``ref``: a prefix will do; ``latest`` or none: any), and its source.

    Every dataset of every version is searched; the same task (git URL, commit, path) listed by several is one.
    """
    client = _open(registry)
    specs = getattr(client, "dataset_specs", None)
    if specs is None:  # a Harbor registry service, not a document: its tasks are packages (org/name)
        raise RegistryError(f"{registry} lists no tasks by name; give a registry file's task, or Harbor's org/name")
    listed = [(f"{d.name}@{d.version}", t) for versions in specs.values() for d in versions.values() for t in d.tasks]
    named = [(label, task) for label, task in listed if task.name == name]
    if not named:
        names = sorted({task.name for _, task in listed})
        near = names if len(names) <= 10 else difflib.get_close_matches(name, names, n=5)
        hint = f"; {'its tasks' if len(names) <= 10 else 'close names'}: {', '.join(near)}" if near else ""
        raise UnknownTaskError(f"{registry} has no task {name!r}{hint}", name, None, near)
    if ref and ref != LATEST:
        commits = sorted({task.git_commit_id for _, task in named if task.git_commit_id})
        named = [(label, task) for label, task in named if (task.git_commit_id or "").startswith(ref)]
        if not named:
            raise UnknownTaskError(
                f"{registry} has no task {name!r} at commit {ref!r}; its commits: {', '.join(commits) or 'none (HEAD)'}",
                name, ref, commits,
            )  # fmt: skip
    sources: dict[tuple[Any, ...], list[str]] = {}
    for label, task in named:
        sources.setdefault((task.git_url, task.git_commit_id, str(task.path)), []).append(label)
    if len(sources) > 1:
        pinned = [(label, key[1]) for key, labels in sources.items() for label in labels]
        each = "; ".join(f"{', '.join(labels)}: {key[1] or 'HEAD'} of {key[0] or 'a local path'}, {key[2]}" for key, labels in sources.items())
        raise AmbiguousTaskError(
            f"{registry} lists different tasks named {name!r} ({each}); pick one with -t {name}@COMMIT "
            "(a prefix will do)", name, pinned,
        )  # fmt: skip
    (key, labels), = sources.items()
    task = next(task for label, task in named if label == labels[0])
    return task, f"{labels[0]} ({key[1] or 'HEAD'})"


def _fetch_package(name: str, ref: str) -> RegistryTask:
    """Harbor's package ``org/name@ref``, downloaded into Harbor's package cache as ``harbor run -t`` does."""
    import re

    try:
        from harbor.constants import ORG_NAME_PATTERN
        from harbor.db.client import TaskVersionNotFoundError
        from harbor.models.task.id import PackageTaskId
    except ImportError:  # a Harbor without packages
        raise RegistryError("this Harbor has no task packages: give a registry file's task with --registry-path") from None
    if not re.match(ORG_NAME_PATTERN, name) or ".." in name:
        raise RegistryError(
            f"-t {name}: Harbor's registry names a task org/name; a registry file's task by its name needs --registry-path"
        )
    org, _, short = name.partition("/")
    try:
        paths = _download([PackageTaskId(org=org, name=short, ref=ref)], f"task {name}@{ref}", TaskVersionNotFoundError)
    except TaskVersionNotFoundError:
        raise UnknownTaskError(f"Harbor's registry has no task {name}@{ref}", name, ref, []) from None
    return RegistryTask(paths[0], name, ref, f"{name}@{ref}")


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
