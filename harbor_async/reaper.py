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
  pids of its processes, its tmpfs mount and cgroups), and the ``bwrap``
  processes that name that folder; :mod:`harbor_async.backends.local.cleanup`
  scans for them and removes them.
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

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

import structlog

from harbor_async.backends.local import cleanup as local_cleanup
from harbor_async.files import remove_tree
from harbor_async.leftovers import (
    Resource,
    SandboxInfo,
    has_live_parent,
    kill,
    nested_pids,
    owner_alive,
    process_start_time,
    processes,
)
from harbor_async.naming import (
    COMPOSE_PROJECT_LABEL,
    LABEL_OWNER_PID,
    LABEL_PID_NS,
    LABEL_RUN,
    SESSION_RE,
    TRIAL_DIR_RE,
    local_roots,
    owner_from_session,
)

log = structlog.get_logger("harbor_async.reaper")

Backend = Literal["docker", "local", "all"]
BACKENDS: tuple[str, ...] = ("docker", "local", "all")

#: A session id of the engine with its default run label: ``ha<pid>x<6 hex>-<10 hex>``.

#: A docker object named after a compose project of ours: the project, then ``-`` or ``_``.
_DOCKER_NAME = re.compile(rf"^/?(?P<session>{SESSION_RE.pattern})(?:[-_].*)?$")
#: Harbor's trial folder made by :class:`harbor_async.sandbox.Sandbox` (``mkdtemp`` suffix).
_TRIAL_DIR = TRIAL_DIR_RE
#: Compose override files Harbor writes into ``tempfile.TemporaryDirectory()`` folders.
_HARBOR_COMPOSE_FILES = re.compile(
    r"^(docker-compose-(mounts|environment|egress-control-services)\.json"
    r"|.*-docker-compose-resources\.json|compose\.json)$"
)
_TMP_FOLDER = re.compile(r"^(tmp[A-Za-z0-9_]{8}|harbor-docker-stream-[A-Za-z0-9_]{8})$")
#: Optional labels of a sandbox's container (a compose overlay can set them);
#: when present they take precedence over the pid in the project name.
DOCKER_TIMEOUT = 60.0


class ReaperError(RuntimeError):
    """A sandbox could not be listed or removed."""


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


# ─── time and folders ───────────────────────────────────────────────────────


def _parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time as Docker or the local marker writes it (nanoseconds allowed)."""
    if not text:
        return None
    text = text.strip()
    text = re.sub(r"(\.\d{6})\d+", r"\1", text)  # Python keeps microseconds
    text = re.sub(r"Z$", "+00:00", text)
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        return None
    if value.year < 1971:  # Docker's zero time: unknown
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _mtime(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except OSError:
        return None


def _earliest(*times: datetime | None) -> datetime | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def docker_is_local() -> bool:
    """Whether the Docker daemon is on this machine (``DOCKER_HOST`` unset or a unix socket)."""
    host = os.environ.get("DOCKER_HOST", "")
    return not host or host.startswith("unix://")


def _docker(*args: str, timeout: float = DOCKER_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _docker_lines(*args: str) -> list[list[str]]:
    result = _docker(*args)
    if result.returncode != 0:
        raise ReaperError(f"docker {' '.join(args[:2])} failed: {result.stderr.strip() or result.stdout.strip()}")
    return [line.split("\t") for line in result.stdout.splitlines() if line.strip()]


def _docker_created(kind: str, refs: Sequence[str], template: str) -> dict[str, datetime | None]:
    """Creation time of each object (objects gone meanwhile are left out)."""
    created: dict[str, datetime | None] = {}
    if not refs:
        return created
    result = _docker(kind, "inspect", "--format", f"{{{{.{template}}}}}", *refs)
    # One line per object that still exists, in order; on a partial failure inspect one by one.
    lines = result.stdout.splitlines()
    if result.returncode == 0 and len(lines) == len(refs):
        return {ref: _parse_time(line) for ref, line in zip(refs, lines, strict=True)}
    for ref in refs:
        one = _docker(kind, "inspect", "--format", f"{{{{.{template}}}}}", ref)
        if one.returncode == 0:
            created[ref] = _parse_time(one.stdout.strip())
    return created


def _session_of(name: str, project_label: str = "") -> str | None:
    for candidate in (project_label, name):
        match = _DOCKER_NAME.match(candidate or "")
        if match is not None:
            return match["session"]
    return None


def _compose_project_of(argv: list[str]) -> str | None:
    """The ``--project-name``/``-p`` of a ``docker compose`` command line."""
    if not any(os.path.basename(a) in ("docker-compose", "compose") or a == "compose" for a in argv[:3]):
        return None
    for index, arg in enumerate(argv[:-1]):
        if arg in ("--project-name", "-p"):
            return argv[index + 1]
        if arg.startswith("--project-name="):
            return arg.partition("=")[2]
    return None


def _compose_config_files(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-f", "--file")]


def _temp_dirs() -> list[Path]:
    """Where the owner's temporary folders may be: our temp dir, and /tmp (its TMPDIR may differ)."""
    return list(dict.fromkeys(Path(p).resolve() for p in (tempfile.gettempdir(), "/tmp")))


def _harbor_compose_dirs(files: Iterable[str]) -> set[Path]:
    """Harbor's temporary folders of generated compose overrides among ``files``."""
    temps = set(_temp_dirs())
    found: set[Path] = set()
    for name in files:
        path = Path(name)
        folder = path.parent
        if folder.parent in temps and _TMP_FOLDER.match(folder.name) and _HARBOR_COMPOSE_FILES.match(path.name):
            found.add(folder)
    return found


def _scan_docker() -> dict[str, SandboxInfo]:
    """Every docker object and compose process named after an engine session."""
    found: dict[str, SandboxInfo] = {}
    times: dict[str, list[datetime | None]] = {}

    def add(session: str, resource: Resource, created: datetime | None = None) -> None:
        info = found.get(session)
        if info is None:
            label, pid = owner_from_session(session)
            info = found[session] = SandboxInfo("docker", session, label, pid, None)
            times[session] = []
        info.resources.append(resource)
        times[session].append(created)

    label = f'{{{{.Label "{COMPOSE_PROJECT_LABEL}"}}}}'
    labels = "\t".join(
        f'{{{{.Label "{name}"}}}}'
        for name in ("com.docker.compose.project.config_files", LABEL_OWNER_PID, LABEL_PID_NS, LABEL_RUN)
    )
    containers = [
        (row + [""] * 7)[:7]
        for row in _docker_lines(
            "ps", "-a", "--no-trunc", "--format", f"{{{{.ID}}}}\t{{{{.Names}}}}\t{label}\t{labels}"
        )
    ]
    ours = [row for row in containers if _session_of(row[1], row[2])]
    created = _docker_created("container", [c[0] for c in ours], "Created")
    for cid, name, project, files, owner, namespace, run in ours:
        session = _session_of(name, project)
        assert session is not None
        add(session, Resource("container", cid[:12], name), created.get(cid))
        info = found[session]
        if owner.isdigit():
            info.owner_pid = int(owner)
        if run:
            info.run_label = run
        if namespace and namespace != _pid_namespace():
            info.foreign_pid = True
        for folder in _harbor_compose_dirs(files.split(",") if files else []):
            add(session, Resource("compose-dir", str(folder)))

    networks = [
        (row[0], row[1], row[2] if len(row) > 2 else "")
        for row in _docker_lines("network", "ls", "--no-trunc", "--format", f"{{{{.ID}}}}\t{{{{.Name}}}}\t{label}")
    ]
    ours_n = [(nid, name, project) for nid, name, project in networks if _session_of(name, project)]
    created = _docker_created("network", [n[0] for n in ours_n], "Created")
    for nid, name, project in ours_n:
        add(_session_of(name, project) or "", Resource("network", name), created.get(nid))

    volumes = [
        (row[0], row[1] if len(row) > 1 else "")
        for row in _docker_lines("volume", "ls", "--format", f"{{{{.Name}}}}\t{label}")
    ]
    ours_v = [(name, project) for name, project in volumes if _session_of(name, project)]
    created = _docker_created("volume", [v[0] for v in ours_v], "CreatedAt")
    for name, project in ours_v:
        add(_session_of(name, project) or "", Resource("volume", name), created.get(name))

    images = [
        (f"{row[0]}:{row[1]}" if row[1] != "<none>" else row[2], row[0])
        for row in _docker_lines("images", "--no-trunc", "--format", "{{.Repository}}\t{{.Tag}}\t{{.ID}}")
    ]
    ours_i = [(ref, repo) for ref, repo in images if _session_of(repo)]
    created = _docker_created("image", [i[0] for i in ours_i], "Created")
    for ref, repo in ours_i:
        add(_session_of(repo) or "", Resource("image", ref), created.get(ref))

    for pid, _state, argv in processes():
        project = _compose_project_of(argv)
        session = _session_of(project) if project else None
        if session is not None:
            add(session, Resource("process", str(pid), " ".join(argv[:4])), process_start_time(pid))
            for folder in _harbor_compose_dirs(_compose_config_files(argv)):
                add(session, Resource("compose-dir", str(folder)))

    for session, info in found.items():
        info.created_at = _earliest(*times[session])
        info.owned_by_live_process = has_live_parent(int(r.ref) for r in info.resources if r.kind == "process")
        # Duplicates (two containers naming the same compose folder): keep one.
        info.resources = list(dict.fromkeys(info.resources))
    return found


def _remove_docker(sandboxes: Sequence[SandboxInfo], errors: list[str]) -> None:
    """Kill their compose processes, then remove containers, networks, volumes, images."""
    by_kind: dict[str, list[str]] = {}
    for info in sandboxes:
        for resource in info.resources:
            by_kind.setdefault(resource.kind, []).append(resource.ref)
    killed = by_kind.get("process", [])
    left = kill(int(p) for p in killed)
    if left:
        errors.append(f"compose processes {left} survived SIGKILL")
    if killed:
        # A request the killed compose had sent (create a container ...) still
        # completes in the daemon: let it land, then take what exists now.
        time.sleep(0.5)
        sessions = {info.id for info in sandboxes}
        fresh = [info for session, info in _scan_docker().items() if session in sessions]
        by_kind = {}
        for info in fresh:
            for resource in info.resources:
                by_kind.setdefault(resource.kind, []).append(resource.ref)
    steps = (
        ("container", ("rm", "--force", "--volumes"), "No such container"),
        ("network", ("network", "rm"), "No such network"),
        ("volume", ("volume", "rm", "--force"), "No such volume"),
        ("image", ("image", "rm", "--force"), "No such image"),
    )
    for kind, command, gone in steps:
        refs = by_kind.get(kind, [])
        if not refs:
            continue
        result = _docker(*command, *refs)
        if result.returncode != 0:
            problems = [line for line in result.stderr.splitlines() if line.strip() and gone not in line]
            if problems:
                errors.append(f"docker {' '.join(command)}: {'; '.join(problems)}")
    for folder in by_kind.get("compose-dir", []):
        remove_tree(Path(folder))


# ─── local (bubblewrap) ─────────────────────────────────────────────────────


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


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
    for temp in _temp_dirs():
        try:
            entries.extend(temp.iterdir())
        except OSError:
            continue
    for entry in entries:
        match = _TRIAL_DIR.match(entry.name)
        if match is not None and entry.is_dir():
            found.setdefault(match["session"], []).append((entry, _mtime(entry)))
    return found


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
) -> list[SandboxInfo]:
    """Every sandbox harbor-async runs left on this machine (live ones included).

    Args:
        backend: ``docker``, ``local`` or ``all``. Trial folders of no other
            sandbox are listed (as backend ``trial``) only with ``all``.
        roots: local-backend base folders besides ``$HARBOR_ASYNC_LOCAL_ROOT``.
        run_label: only sandboxes of this run.
        errors: collects what could not be scanned (Docker absent, daemon
            down ...); without it those are logged.

    Sorted oldest first.
    """
    _check_backend(backend)
    problems: list[str] = [] if errors is None else errors
    sandboxes: list[SandboxInfo] = []
    by_session: dict[str, SandboxInfo] = {}
    trials = _scan_trial_dirs()
    nested = nested_pids()
    if backend in ("docker", "all") and shutil.which("docker"):
        try:
            docker = _scan_docker()
        except (ReaperError, OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"docker: {exc}")
            docker = {}
        remote = not docker_is_local()
        for info in docker.values():
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
            info = SandboxInfo("trial", session, label, pid, _earliest(*(t for _, t in folders)))
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
) -> ReapReport:
    """Remove the sandboxes that killed runs left behind.

    Args:
        older_than: only sandboxes created at least this long ago.
        include_live_owners: also remove sandboxes whose owning process still
            runs (``--force``): that process loses them.
        backend, roots, run_label: as for :func:`list_sandboxes`.
        rounds: scans after the removal; a compose command killed mid-request
            can make Docker finish creating an object after the first scan.

    Returns what was removed, what was left alone (and why) and what failed.
    """
    roots = list(roots)
    report = ReapReport()
    chosen: dict[tuple[str, str], SandboxInfo] = {}
    for info in list_sandboxes(backend, roots=roots, run_label=run_label, errors=report.unscanned):
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
            for info in list_sandboxes(backend, roots=roots, errors=rescan)
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
            _remove_docker(docker, errors)
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"docker: {exc}")
    if local:
        local_cleanup.remove(local, errors)
    _remove_folders(sandboxes, "trial-dir", errors)


def reap_stale(roots: Iterable[str | Path] = ()) -> ReapReport:
    """What an engine runs at start with ``reap_stale=True``: reap every sandbox
    of this machine whose owner is dead. Never raises; problems are logged."""
    try:
        report = reap(None, include_live_owners=False, roots=roots)
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
