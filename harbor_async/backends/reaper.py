"""Find and remove sandboxes that killed harbor-async processes left behind.

Every sandbox the engine creates is named ``<run label>-<10 hex>`` (the
session id Harbor receives), and the default run label is
``ha<pid>x<6 hex>``: the name alone says which process owns the sandbox.

What a sandbox leaves on this machine, by backend:

- ``docker``: Harbor names the compose project after the session id, so the
  project's containers (``<project>-main-1``), networks (``<project>_default``),
  volumes (``<project>_*``) and built images (``<project>-main``) all carry it,
  and compose labels containers, networks and volumes with
  ``com.docker.compose.project``. Harbor's own compose files carry no labels
  of ours, so the owner pid comes from the project name (or from the
  container's ``io.harbor-async.owner-pid`` / ``io.harbor-async.pid-ns`` labels
  when a compose overlay sets them) and the creation time from Docker's own
  ``Created``. The ``docker compose`` processes a killed owner left running (a
  build, an ``up`` or an ``exec`` in flight) are found by their
  ``--project-name`` and killed first, so that they cannot recreate what is
  being removed; so are Harbor's temporary compose override folders.
- ``local``: a folder ``<root>/harbor-async-<run label>-<session id>`` holding
  ``.harbor-async.json`` (run label, session id, owner pid, creation time, the
  pids of its processes) and the ``bwrap`` processes whose ``--bind`` source is
  that folder's ``fs/``.
- every backend: Harbor's trial folder ``$TMPDIR/harbor-async-<session id>-*``
  (looked for in the reaper's ``$TMPDIR`` and in ``/tmp``).

A sandbox's owner is alive when its pid runs a process that started before the
sandbox was created (a reused pid started later is not the owner); when the pid
was recorded inside a container, a process with that pid in a nested pid
namespace counts too; and when a process of the sandbox (a bwrap, a ``docker
compose`` command) still has a live parent. ``reap`` leaves sandboxes of live
owners alone unless forced, and those of unknown owners (no pid recorded, or a
pid of another pid namespace per a marker's ``pid_ns`` or a container's label)
unless given ``older_than`` or forced.

Limits: the Docker part assumes the daemon runs on this machine; with a remote
``DOCKER_HOST`` every docker sandbox counts as owned by a live process, so only
``force`` removes them. A reaper running *inside* a pid namespace cannot see the
owners outside it: without the ``pid_ns`` record it takes them for dead.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from harbor_async.backends.docker import cleanup as docker_cleanup
from harbor_async.backends.leftovers import (
    Resource,
    SandboxInfo,
    earliest,
    mtime,
    nested_pids,
    owner_alive,
    temp_dirs,
)
from harbor_async.backends.local import cleanup as local_cleanup
from harbor_async.core.errors import ReaperError
from harbor_async.core.files import remove_tree
from harbor_async.core.logs import get_logger
from harbor_async.core.naming import (
    SESSION_RE,
    TRIAL_DIR_RE,
    TRIAL_MARKER_NAME,
    local_roots,
    owner_from_session,
)

log = get_logger("harbor_async.backends.reaper")

Backend = Literal["docker", "local", "all"]
BACKENDS: tuple[str, ...] = ("docker", "local", "all")

#: Harbor's trial folder made by :class:`harbor_async.engine.sandbox.Sandbox` (``mkdtemp`` suffix).
_TRIAL_DIR = TRIAL_DIR_RE


@dataclass
class ReapReport:
    """What :func:`reap` removed, left alone, failed to remove, and could not scan."""

    reaped: list[SandboxInfo] = field(default_factory=list)
    skipped: list[tuple[SandboxInfo, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: backends that could not be scanned (Docker installed, daemon down ...)
    unscanned: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every chosen sandbox was removed."""
        return not self.errors


# ─── local (bubblewrap) ─────────────────────────────────────────────────────


def _remove_folders(sandboxes: Sequence[SandboxInfo], kind: str, errors: list[str]) -> None:
    """Remove every resource of ``kind`` (a folder) of ``sandboxes``; failures go to ``errors``."""
    for info in sandboxes:
        for resource in info.resources:
            if resource.kind == kind:
                try:
                    remove_tree(Path(resource.ref))
                except OSError as exc:
                    errors.append(f"cannot remove {resource.ref}: {exc}")


# ─── trial folders ──────────────────────────────────────────────────────────


def _scan_trial_dirs() -> dict[str, list[tuple[Path, datetime | None]]]:
    found: dict[str, list[tuple[Path, datetime | None]]] = {}
    entries: list[Path] = []
    for temp in temp_dirs():
        try:
            entries.extend(temp.iterdir())
        except OSError:
            continue
    for entry in entries:
        match = _TRIAL_DIR.match(entry.name)
        if match is not None and entry.is_dir():
            found.setdefault(_trial_session(entry, match["session"]), []).append((entry, mtime(entry)))
    return found


def _trial_session(folder: Path, named: str) -> str:
    """The sandbox a trial folder belongs to: its marker's, else the one its name carries."""
    try:
        marked = (folder / TRIAL_MARKER_NAME).read_text().strip()
    except OSError:
        return named
    return marked if SESSION_RE.fullmatch(marked) else named


# ─── public API ─────────────────────────────────────────────────────────────


def _alive(info: SandboxInfo, nested: dict[int, list[int]]) -> bool | None:
    if info.owned_by_live_process:
        return True
    if info.foreign_pid:
        return None
    return owner_alive(info.owner_pid, info.created_at, nested)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def list_sandboxes(
    backend: Backend | str = "all",
    *,
    roots: Iterable[str | Path] = (),
    run_label: str | None = None,
    errors: list[str] | None = None,
    docker: bool = True,
) -> list[SandboxInfo]:
    """Every sandbox harbor-async runs left on this machine (live ones included).

    Args:
        backend: ``docker``, ``local`` or ``all``. Trial folders of no other
            sandbox are listed (as backend ``trial``) only with ``all``.
        roots: local-backend base folders besides ``$HARBOR_ASYNC_LOCAL_ROOT``.
        run_label: only sandboxes of this run.
        errors: collects what could not be scanned (Docker absent, daemon
            down ...); without it those are logged.
        docker: ``False`` leaves the Docker daemon unasked, whatever ``backend``
            says (what an engine reaps as it opens: see :func:`reap_stale`).

    Sorted oldest first.
    """
    _check_backend(backend)
    problems: list[str] = [] if errors is None else errors
    sandboxes: list[SandboxInfo] = []
    by_session: dict[str, SandboxInfo] = {}
    info: SandboxInfo | None
    trials = _scan_trial_dirs()
    nested = nested_pids()
    if docker and backend in ("docker", "all") and shutil.which("docker"):
        try:
            containers = docker_cleanup.scan()
        except (ReaperError, OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"docker: {exc}")
            containers = {}
        remote = not docker_cleanup.docker_is_local()
        for info in containers.values():
            info.owner_alive = True if remote else _alive(info, nested)
            sandboxes.append(info)
            by_session[info.id] = info
    if backend in ("local", "all"):
        for info in local_cleanup.scan(local_roots(roots)).values():
            info.owner_alive = _alive(info, nested)
            sandboxes.append(info)
            by_session.setdefault(info.id, info)
    for session, folders in trials.items():
        info = by_session.get(session)
        if info is None:
            if backend != "all":
                continue
            label, pid = owner_from_session(session)
            info = SandboxInfo("trial", session, label, pid, earliest(*(t for _, t in folders)))
            info.owner_alive = owner_alive(pid, info.created_at, nested)
            sandboxes.append(info)
        info.resources.extend(Resource("trial-dir", str(path)) for path, _ in folders)
    if run_label is not None:
        sandboxes = [s for s in sandboxes if s.run_label == run_label]
    if errors is None:
        for problem in problems:
            log.warning("sandboxes not scanned", problem=problem)
    far_past = datetime.min.replace(tzinfo=UTC)
    return sorted(sandboxes, key=lambda s: (s.created_at or far_past, s.backend, s.id))


def reap(
    older_than: timedelta | None = None,
    include_live_owners: bool = False,
    *,
    backend: Backend | str = "all",
    roots: Iterable[str | Path] = (),
    run_label: str | None = None,
    rounds: int = 3,
    docker: bool = True,
) -> ReapReport:
    """Remove the sandboxes that killed runs left behind.

    Args:
        older_than: only sandboxes created at least this long ago.
        include_live_owners: also remove sandboxes whose owning process still
            runs (``--force``): that process loses them.
        backend, roots, run_label, docker: as for :func:`list_sandboxes`.
        rounds: scans after the removal; a compose command killed mid-request
            can make Docker finish creating an object after the first scan.

    Returns what was removed, what was left alone (and why) and what failed.
    """
    roots = list(roots)
    report = ReapReport()
    chosen: dict[tuple[str, str], SandboxInfo] = {}
    for info in list_sandboxes(backend, roots=roots, run_label=run_label, errors=report.unscanned, docker=docker):
        reason = _keep_reason(info, older_than, include_live_owners)
        if reason is None:
            chosen[(info.backend, info.id if info.backend != "local" else _folder_of(info))] = info
        else:
            report.skipped.append((info, reason))
    if not chosen:
        return report
    doomed_sessions = {info.id for info in chosen.values()}
    doomed_folders = {_folder_of(i) for i in chosen.values() if i.backend == "local"}
    pending = list(chosen.values())
    for round_ in range(max(rounds, 1)):
        errors: list[str] = []
        _remove(pending, errors)
        # Scan again: what is left of the chosen sandboxes, or came back.
        time.sleep(0.05 if round_ == 0 else 0.5)
        rescan: list[str] = []
        pending = [
            info
            for info in list_sandboxes(backend, roots=roots, errors=rescan, docker=docker)
            if (info.backend == "local" and _folder_of(info) in doomed_folders)
            or (info.backend != "local" and info.id in doomed_sessions)
        ]
        if rescan:  # cannot tell what is left
            report.errors.extend(errors + rescan)
            break
        if not pending:
            break
        if round_ == max(rounds, 1) - 1:
            report.errors.extend(errors)
            report.errors.extend(
                f"{info.backend} sandbox {info.id} still holds {', '.join(map(str, info.resources))}"
                for info in pending
            )
    report.reaped = list(chosen.values())
    for info in report.reaped:
        log.info(
            "reaped sandbox",
            backend=info.backend, sandbox=info.id, owner_pid=info.owner_pid, resources=len(info.resources),
        )  # fmt: skip
    return report


def _folder_of(info: SandboxInfo) -> str:
    return next((r.ref for r in info.resources if r.kind == "folder"), info.id)


def _keep_reason(info: SandboxInfo, older_than: timedelta | None, force: bool) -> str | None:
    """Why ``info`` must be left alone, or None to reap it."""
    age = info.age
    if older_than is not None and (age is None or age < older_than):
        return f"younger than {older_than}"
    if force:
        return None
    if info.owner_alive:
        return f"owner pid {info.owner_pid} is alive"
    if info.owner_alive is None and older_than is None:
        return "owner unknown (reap it with --older-than or --force)"
    return None


def _remove(sandboxes: Sequence[SandboxInfo], errors: list[str]) -> None:
    docker = [s for s in sandboxes if s.backend == "docker"]
    local = [s for s in sandboxes if s.backend == "local"]
    if docker:
        try:
            docker_cleanup.remove(docker, errors)
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"docker: {exc}")
    if local:
        local_cleanup.remove(local, errors)
    _remove_folders(sandboxes, "trial-dir", errors)


def reap_stale(
    roots: Iterable[str | Path] = (), *, backend_kwargs: dict[str, Any] | None = None, docker: bool = False
) -> ReapReport:
    """What an engine runs with ``reap_stale=True``: reap every sandbox of this
    machine whose owner is dead. Never raises; problems are logged.

    ``backend_kwargs``: the engine's backend options; the local backend's
    ``sandbox_root`` among them is scanned too. ``docker``: the Docker daemon's
    leftovers only (what an engine reaps at its first docker sandbox, having
    reaped this host's as it opened); ``False``: everything but the daemon's.
    """
    root = (backend_kwargs or {}).get("sandbox_root")
    roots = [*roots, root] if root else list(roots)
    try:
        report = reap(None, include_live_owners=False, backend="docker" if docker else "all", roots=roots, docker=docker)
    except Exception as exc:  # a start-up convenience must not stop the engine
        log.warning("reaping stale sandboxes failed", error=repr(exc))
        return ReapReport(errors=[repr(exc)])
    if report.reaped:
        log.warning("reaped sandboxes left by dead runs", count=len(report.reaped), ids=[s.id for s in report.reaped])
    for problem in report.errors:
        log.warning("reaping stale sandboxes", problem=problem)
    for problem in report.unscanned:
        log.info("stale sandboxes not scanned", problem=problem)
    return report


_REAPED: set[tuple[str | None, bool]] = set()  # (sandbox root, docker) this process has reaped at an engine's start
_REAPED_LOCK = threading.Lock()


def reap_stale_once(*, backend_kwargs: dict[str, Any] | None = None, docker: bool = False) -> ReapReport | None:
    """:func:`reap_stale`, once per process, sandbox root and ``docker``: what dead owners left goes before the
    first engine opens; the shim's engines, one per option set, do not each scan the machine again.

    ``docker=False`` (as an engine opens): this host's folders and processes only; ``True`` (at an engine's
    first docker sandbox): the daemon's leftovers, not this host's again. A run that starts no docker sandbox leaves the daemon
    alone: a run on ``local`` or a cloud backend neither waits on a slow or absent daemon nor removes
    containers that only docker runs (and ``sandboxes reap``) are concerned with.
    """
    root = (backend_kwargs or {}).get("sandbox_root")
    key = (str(root) if root else None, docker)
    with _REAPED_LOCK:
        if key in _REAPED:
            return None
        _REAPED.add(key)
    return reap_stale(backend_kwargs=backend_kwargs, docker=docker)


def parse_duration(text: str) -> timedelta:
    """``90``, ``90s``, ``10m``, ``2h``, ``1d``, ``1h30m`` -> a timedelta.

    Raises:
        ValueError: not a duration.
    """
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return timedelta(seconds=float(text))
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 10m, 2h, 1d)")
    return timedelta(seconds=sum(float(n) * units[u] for n, u in parts))


def format_age(age: timedelta | None) -> str:
    """``42s``, ``7m``, ``3h12m``, ``2d4h``; ``?`` when unknown."""
    if age is None:
        return "?"
    seconds = max(int(age.total_seconds()), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600}h"
