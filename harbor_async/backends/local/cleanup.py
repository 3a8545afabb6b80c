"""Find and remove what local sandboxes left on this machine (the reaper's local part).

A local sandbox leaves a folder ``<root>/harbor-async-<run label>-<session id>``
holding the marker file (run label, session id, owner pid, creation time, the
pids of its processes, its mount and cgroups) and the ``bwrap`` processes whose
``--bind`` source is that folder's ``fs/``. The reaper decides *whether* to
remove a sandbox; this module says what one holds and removes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from harbor_async.backends.leftovers import (
    Resource,
    SandboxInfo,
    comm,
    has_live_parent,
    kill,
    pid_namespace,
    process_start_time,
    processes,
)
from harbor_async.backends.local.limits import remove_cgroups
from harbor_async.backends.local.rootfs import remove_mount, remove_sandbox_folder
from harbor_async.core.naming import MARKER_NAME, PREFIX, SESSION_RE, owner_from_session

__all__ = ["read_marker", "remove", "scan"]


def read_marker(folder: Path) -> dict[str, Any]:
    """The marker of a sandbox folder ({} when missing or unreadable)."""
    try:
        data = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _created(marker: dict[str, Any], folder: Path) -> datetime | None:
    text = marker.get("created_at")
    if isinstance(text, str):
        try:
            value = datetime.fromisoformat(text)
            return value if value.tzinfo else value.replace(tzinfo=UTC)
        except ValueError:
            pass
    try:
        return datetime.fromtimestamp(folder.stat().st_mtime, UTC)
    except OSError:
        return None


def _bwrap_processes() -> list[tuple[int, list[str]]]:
    return [
        (pid, argv)
        for pid, _state, argv in processes()
        if os.path.basename(argv[0]) == "bwrap" or comm(pid) == "bwrap"
    ]


def scan(roots: Sequence[Path]) -> dict[str, SandboxInfo]:
    """Every local sandbox folder under ``roots``, keyed by folder (two roots may share a session id).

    Each holds its ``process`` resources (bwrap and nsenter pids still running
    the sandbox) and its ``folder``; the owner pid and creation time come from
    the marker, else from the folder's name and modification time.
    """
    found: dict[str, SandboxInfo] = {}
    bwraps = _bwrap_processes()
    for root in roots:
        try:
            folders = sorted(p for p in root.iterdir() if p.name.startswith(f"{PREFIX}-") and p.is_dir())
        except OSError:
            continue
        for folder in folders:
            marker = read_marker(folder)
            session = str(marker.get("session_id") or "")
            match = SESSION_RE.search(folder.name)
            if not session and match is not None:
                session = match.group(0)
            session = session or folder.name
            label, pid = owner_from_session(session)
            label = marker.get("run_label") or label
            owner = marker.get("owner_pid")
            pid = owner if isinstance(owner, int) else pid
            created = _created(marker, folder)
            info = SandboxInfo("local", session, label, pid, created)
            roots_bound = {str(folder / "fs"), str(folder)}
            if isinstance(marker.get("mount"), str):
                roots_bound.add(marker["mount"])
            pids = {bpid for bpid, argv in bwraps if roots_bound & set(argv)}
            # The marker's pids (bwrap, or enter.py joining the sandbox): only if
            # they still run that program and started after the sandbox (not a reused pid).
            recorded = [marker.get("keeper_pid"), *(marker.get("pids") or [])]
            for mpid in recorded:
                started = process_start_time(mpid) if isinstance(mpid, int) else None
                if (
                    started is not None
                    and isinstance(mpid, int)
                    and (comm(mpid) in ("bwrap", "ha-enter") or _is_join_helper(mpid))
                    and (created is None or started >= created - timedelta(seconds=2))
                ):
                    pids.add(mpid)
            for bpid in sorted(pids):
                info.resources.append(Resource("process", str(bpid), comm(bpid)))
            info.owned_by_live_process = has_live_parent(pids)
            namespace = marker.get("pid_ns")
            info.foreign_pid = bool(namespace) and namespace != pid_namespace()
            for cgroup in marker.get("cgroups") or []:
                if isinstance(cgroup, str) and os.path.isdir(cgroup):
                    info.resources.append(Resource("cgroup", cgroup))
            if isinstance(marker.get("mount"), str) and os.path.lexists(marker["mount"]):
                info.resources.append(Resource("mount", marker["mount"]))
            info.resources.append(Resource("folder", str(folder)))
            found[str(folder)] = info
    return found


def remove(sandboxes: Sequence[SandboxInfo], errors: list[str]) -> None:
    """Kill the sandboxes' processes, then remove their folders; failures go to ``errors``."""
    pids = [int(r.ref) for info in sandboxes for r in info.resources if r.kind == "process"]
    left = kill(pids)
    if left:
        errors.append(f"bwrap processes {left} survived SIGKILL")
    for info in sandboxes:
        cgroups = [r.ref for r in info.resources if r.kind == "cgroup"]
        if cgroups:  # a process that escaped the kill above (forked meanwhile) dies here
            left_groups = remove_cgroups(cgroups)
            if left_groups:
                errors.append(f"cgroups {left_groups} could not be removed")
        mount = next((Path(r.ref) for r in info.resources if r.kind == "mount"), None)
        for resource in info.resources:
            if resource.kind == "folder":
                try:
                    remove_sandbox_folder(Path(resource.ref), mount)
                except OSError as exc:
                    errors.append(f"cannot remove {resource.ref}: {exc}")


def abandon(keeper: Any, confinement: Any, mount: Path | None, lease: Any) -> None:
    """Finalizer of an environment dropped without ``stop()``: end its processes, free its mount, cgroups and uid.

    The folder stays (only ``stop()`` removes it; a reaper finds it).
    """
    keeper.abandon()
    try:
        if mount is not None:
            remove_mount(mount)
        if confinement is not None and confinement.cgroups is not None:
            confinement.cgroups.remove(wait=1.0)
    except OSError:
        pass  # a finalizer must not raise; the reaper finishes the job
    if lease is not None:
        lease.release()


def _is_join_helper(pid: int) -> bool:
    """Whether ``pid`` is an enter.py helper that has not named itself yet (the first milliseconds)."""
    try:
        return b"helpers/enter" in Path(f"/proc/{pid}/cmdline").read_bytes()  # enter.py, or enter_server.py's child
    except OSError:
        return False


def stale_mount(folder: Path) -> Path | None:
    """The tmpfs a sandbox folder's marker names (a killed run's, found at the next start of the same name)."""
    mount = read_marker(folder).get("mount")
    return Path(mount) if isinstance(mount, str) else None
