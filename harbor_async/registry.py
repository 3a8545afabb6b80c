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
  downloaded by :func:`harbor_async.tasks.load_suite`.
- ``org/name`` without ``hf:`` meant a Hugging Face repo in earlier releases. It
  still does for one release, with a deprecation notice, when the registry does
  not know the name (or Harbor's default registry cannot be reached).

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from harbor_async.errors import (
    RegistryError,
    RegistryFileError,
    RegistryUnreachableError,
    UnknownDatasetError,
)
from harbor_async.logs import get_logger

if TYPE_CHECKING:
    from harbor.models.registry import DatasetMetadata
    from harbor.registry.client.base import BaseRegistryClient

__all__ = ["HF_PREFIXES", "Dataset", "Registry", "fetch_dataset", "parse_hf", "resolve_dataset"]

log = get_logger(__name__)
T = TypeVar("T")

#: The spellings of a Hugging Face dataset repo: ``hf:org/name`` (``hf://`` as earlier releases wrote it).
HF_PREFIXES = ("hf://", "hf:")
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
    """A resolved ``-d``: what :func:`~harbor_async.tasks.load_suite` loads, and its name.

    Attributes:
        source: ``"hf://org/name[@revision]"``, or the registry dataset's task
            folders (downloaded), in the registry's order.
        name: the dataset as resolved: ``name@version`` or ``hf:org/name[@revision]``.
        deprecation: a one-line notice for the caller to show, when the spelling is deprecated.
    """

    source: str | tuple[Path, ...]
    name: str
    deprecation: str | None = None


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
    paths = _bounded(lambda: _download(metadata, label), None, str(registry))
    return Dataset(tuple(dict.fromkeys(paths)), label)  # a task listed twice runs once, as Harbor dedupes


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


def _download(metadata: DatasetMetadata, label: str) -> list[Path]:
    """The tasks' folders, downloaded (git: shallow sparse clones) into Harbor's task cache by Harbor's client."""
    from harbor.tasks.client import TaskClient

    try:
        result = asyncio.run(TaskClient().download_tasks(task_ids=list(metadata.task_ids)))
    except subprocess.CalledProcessError as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        detail = next((line for line in reversed(stderr.splitlines()) if line.strip()), f"exit status {exc.returncode}")
        raise RegistryError(f"downloading dataset {label} failed: {' '.join(map(str, exc.cmd[:2]))}: {detail}") from None
    except Exception as exc:  # noqa: BLE001 - a missing local task, a link out of a task, no git
        raise RegistryError(f"downloading dataset {label} failed: {_first_line(exc)}") from None
    return [Path(path).expanduser() for path in result.paths]


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
