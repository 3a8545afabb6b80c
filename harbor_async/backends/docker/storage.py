"""A docker task's ``storage_mb``: the daemon's quota where it has one, else a watch of ours.

Harbor's docker backend ignores ``storage_mb``: a container writes as much as
the host disk takes. Docker bounds a container's writable layer only with
``--storage-opt size=`` (Compose's ``storage_opt``), which overlay2 supports
on xfs mounted with ``pquota`` only (and devicemapper, btrfs, zfs); elsewhere
the daemon refuses to create the container. So, once per process and Docker
endpoint, :func:`daemon_quota` asks the daemon by creating (never starting) a
container with the option:

- where it works, the task's main service gets ``storage_opt: {size: ...}``
  (:func:`quota_overlay`): the daemon enforces it, and a write past it fails
  with ``ENOSPC`` inside the container (the agent's own problem to handle);
- where it does not (this project's CI daemon: overlay2 on ext4), one thread
  per process (:class:`StorageWatch`) asks the daemon every
  :data:`POLL_SECONDS` for the apparent size of each watched container's
  writable layer (``docker inspect --size``: ``SizeRw``, sparse files count in
  full) in one call for all of them, and kills a container past its bound. Its
  environment then refuses every further command with
  :class:`~harbor_async.verification.disk_bounds.StorageLimitError`, and the episode is the
  agent's scored failure (:func:`harbor_async.verification.disk_bounds.settle_bounds`).
  A poll is not a quota: a container may write past its bound for up to one
  interval before it is killed (a sparse file costs the disk nothing, a real
  write at disk speed for one interval).

``harbor-async doctor -b docker`` says which of the two applies.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harbor_async.core.logs import get_logger
from harbor_async.verification.disk_bounds import StorageLimitError

log = get_logger()

#: Seconds between two looks at the watched containers' writable layers.
POLL_SECONDS = 2.0
#: Seconds one ``docker`` call of the watch or the probe may take.
DOCKER_TIMEOUT = 30.0
#: The daemon's answer per Docker endpoint (``DOCKER_HOST``, ``DOCKER_CONTEXT``): (enforced, how it was found).
_QUOTA: dict[tuple[str, str], tuple[bool, str]] = {}
_QUOTA_LOCK = threading.Lock()


def _endpoint() -> tuple[str, str]:
    return os.environ.get("DOCKER_HOST", ""), os.environ.get("DOCKER_CONTEXT", "")


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=DOCKER_TIMEOUT)


def daemon_quota() -> tuple[bool, str]:
    """Whether the daemon enforces ``--storage-opt size=`` (asked once per process and endpoint), and what it said.

    Blocking (``docker`` calls): call it from a worker thread. A daemon that
    cannot be asked counts as not enforcing it (the watch then bounds the
    containers), and is asked again next time.
    """
    with _QUOTA_LOCK:
        known = _QUOTA.get(_endpoint())
        if known is not None:
            return known
        found = _probe()
        if found[1] is not None:
            _QUOTA[_endpoint()] = (found[0], found[1])
        return found[0], found[1] or "the daemon could not be asked"


def _probe() -> tuple[bool, str | None]:
    """Create (not start) a container with a 1 MiB quota from any local image; ``None`` when nothing could be asked."""
    try:
        images = _docker("image", "ls", "-q", "--no-trunc")
        image = next(iter(images.stdout.split()), None) if images.returncode == 0 else None
        if image is None:
            return False, None  # no image to create one from: ask again once there is
        made = _docker("create", "--pull", "never", "--network", "none", "--storage-opt", "size=1m", image, "true")
    except (OSError, subprocess.TimeoutExpired):
        return False, None
    if made.returncode == 0:
        _docker("rm", "-f", made.stdout.strip())
        return True, "the daemon enforces storage_opt size (a quota on each container's writable layer)"
    reason = (made.stderr.strip().splitlines() or [f"exit {made.returncode}"])[0].removeprefix("Error response from daemon: ")
    return False, f"the daemon refuses storage_opt ({reason[:200]})"


def quota_overlay(folder: Path, storage_mb: int) -> Path:
    """Write a Compose file giving the main service a ``storage_mb`` quota (where the daemon enforces one)."""
    path = folder / "harbor-async-storage.json"
    path.write_text(json.dumps({"services": {"main": {"storage_opt": {"size": f"{int(storage_mb)}m"}}}}))
    return path


@dataclass
class _Watched:
    limit_mb: int
    on_exceeded: Callable[[StorageLimitError], None]


class StorageWatch:
    """One thread polling the writable-layer sizes of every watched container (one ``docker inspect`` a round).

    The thread starts with the first container watched and ends when none is
    left. Killing a container and telling its environment happen on this
    thread; the environment only reads what it was told.
    """

    def __init__(self, interval: float = POLL_SECONDS) -> None:
        self.interval = interval
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, container: str, limit_mb: int, on_exceeded: Callable[[StorageLimitError], None]) -> None:
        """Bound ``container``'s writable layer to ``limit_mb`` MiB; past it, kill it and call ``on_exceeded``."""
        with self._lock:
            self._watched[container] = _Watched(limit_mb, on_exceeded)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="harbor-async-storage-watch", daemon=True)
                self._thread.start()

    def unwatch(self, container: str) -> None:
        """Stop watching ``container`` (its sandbox stops)."""
        with self._lock:
            self._watched.pop(container, None)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
                watched = dict(self._watched)
            try:
                self._round(watched)
            except Exception as exc:  # noqa: BLE001 - a daemon hiccup: the next round asks again
                log.warning("storage watch round failed", error=repr(exc))

    def _round(self, watched: dict[str, _Watched]) -> None:
        found = _docker("inspect", "--size", "--format", "{{.Id}} {{.SizeRw}}", *watched)
        for line in found.stdout.splitlines():  # a container gone meanwhile is left out (and the call exits 1)
            container, _, size_text = line.partition(" ")
            entry = watched.get(container)
            try:
                size = int(size_text)
            except ValueError:
                continue
            if entry is None or size <= entry.limit_mb * 2**20:
                continue
            with self._lock:
                if self._watched.pop(container, None) is None:
                    continue  # unwatched meanwhile: its sandbox is stopping
            error = StorageLimitError(container, entry.limit_mb, size)
            entry.on_exceeded(error)  # first: a command refused from now on, before the kill ends the running one
            _docker("kill", container)
            log.warning("container past its storage_mb: killed", container=container[:12], limit_mb=entry.limit_mb, size=size)


#: The process's one watch.
WATCH = StorageWatch()


__all__ = ["POLL_SECONDS", "WATCH", "StorageWatch", "daemon_quota", "quota_overlay"]
