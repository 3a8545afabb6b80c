"""Docker leftovers of harbor-async runs: find them, remove them.

Harbor names a sandbox's compose project after its session id, so the
project's containers (``<project>-main-1``), networks (``<project>_default``),
volumes (``<project>_*``) and built images (``<project>-main``) all carry it,
and compose labels containers, networks and volumes with
``com.docker.compose.project``. The owner pid comes from the project name (or
from the overlay's ``io.harbor-async.owner-pid`` / ``io.harbor-async.pid-ns``
labels), the creation time from Docker's own ``Created`` of its containers, networks and volumes (an image's
dates only a sandbox that left nothing else: a cached build carries an earlier build's time). The ``docker
compose`` processes a killed owner left running are found by their
``--project-name`` and killed first, so that they cannot recreate what is being
removed; so are Harbor's temporary compose override folders.

The policy (whose sandboxes to remove) is :mod:`harbor_async.backends.reaper`'s.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

from harbor_async.backends.leftovers import (
    Resource,
    SandboxInfo,
    earliest,
    has_live_parent,
    kill,
    parse_time,
    pid_namespace,
    process_start_time,
    processes,
    temp_dirs,
)
from harbor_async.core.errors import ReaperError
from harbor_async.core.files import remove_tree
from harbor_async.core.naming import (
    COMPOSE_PROJECT_LABEL,
    LABEL_OWNER_PID,
    LABEL_PID_NS,
    LABEL_RUN,
    SESSION_RE,
    owner_from_session,
)

#: A docker object named after a compose project of ours: the project, then ``-`` or ``_``.
_DOCKER_NAME = re.compile(rf"^/?(?P<session>{SESSION_RE.pattern})(?:[-_].*)?$")
#: Compose override files Harbor writes into ``tempfile.TemporaryDirectory()`` folders.
_HARBOR_COMPOSE_FILES = re.compile(
    r"^(docker-compose-(mounts|environment|egress-control-services)\.json"
    r"|.*-docker-compose-resources\.json|compose\.json)$"
)
_TMP_FOLDER = re.compile(r"^(tmp[A-Za-z0-9_]{8}|harbor-docker-stream-[A-Za-z0-9_]{8})$")
DOCKER_TIMEOUT = 60.0



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
        return {ref: parse_time(line) for ref, line in zip(refs, lines, strict=True)}
    for ref in refs:
        one = _docker(kind, "inspect", "--format", f"{{{{.{template}}}}}", ref)
        if one.returncode == 0:
            created[ref] = parse_time(one.stdout.strip())
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


def _harbor_compose_dirs(files: Iterable[str]) -> set[Path]:
    """Harbor's temporary folders of generated compose overrides among ``files``."""
    temps = set(temp_dirs())
    found: set[Path] = set()
    for name in files:
        path = Path(name)
        folder = path.parent
        if folder.parent in temps and _TMP_FOLDER.match(folder.name) and _HARBOR_COMPOSE_FILES.match(path.name):
            found.add(folder)
    return found


def scan() -> dict[str, SandboxInfo]:
    """Every docker object and compose process named after an engine session."""
    found: dict[str, SandboxInfo] = {}
    times: dict[str, list[datetime | None]] = {}
    image_times: dict[str, list[datetime | None]] = {}

    def add(session: str, resource: Resource, created: datetime | None = None) -> None:
        info = found.get(session)
        if info is None:
            label, pid = owner_from_session(session)
            info = found[session] = SandboxInfo("docker", session, label, pid, None)
            times[session] = []
        info.resources.append(resource)
        # An image's "Created" is its last layer's: a build served from the cache dates it to whichever earlier build
        # made that layer, before the owner started, which would take a live owner for a reused pid.
        (image_times.setdefault(session, []) if resource.kind == "image" else times[session]).append(created)

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
        if namespace and namespace != pid_namespace():
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
        compose_project = _compose_project_of(argv)
        session = _session_of(compose_project) if compose_project else None
        if session is not None:
            add(session, Resource("process", str(pid), " ".join(argv[:4])), process_start_time(pid))
            for folder in _harbor_compose_dirs(_compose_config_files(argv)):
                add(session, Resource("compose-dir", str(folder)))

    for session, info in found.items():
        info.created_at = earliest(*times[session]) or earliest(*image_times.get(session, []))
        info.owned_by_live_process = has_live_parent(int(r.ref) for r in info.resources if r.kind == "process")
        # Duplicates (two containers naming the same compose folder): keep one.
        info.resources = list(dict.fromkeys(info.resources))
    return found


def remove(sandboxes: Sequence[SandboxInfo], errors: list[str]) -> None:
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
        fresh = [info for session, info in scan().items() if session in sessions]
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


#: Task images of docker sandboxes: Harbor's content-addressed main-image name, ``hb__<environment id>``,
#: which the fast start keeps for the run (and later runs) instead of removing it at each stop.
TASK_IMAGE_PREFIX = "hb__"


def task_images() -> list[str]:
    """The task images on the daemon (``hb__*``), as ``repository:tag``."""
    rows = _docker_lines("images", "--format", "{{.Repository}}:{{.Tag}}", "--filter", f"reference={TASK_IMAGE_PREFIX}*")
    return sorted({row[0] for row in rows if row[0].startswith(TASK_IMAGE_PREFIX)})


def prune_task_images() -> tuple[list[str], list[str]]:
    """Remove every task image no container uses; returns (removed, kept with the daemon's reason)."""
    return remove_task_images(task_images())


def remove_task_images(images: Sequence[str]) -> tuple[list[str], list[str]]:
    """Remove these images where no container uses them; returns (removed, kept with the daemon's reason).

    An image already gone counts as removed (another run's ``--delete`` or a prune got there first).
    """
    removed, kept = [], []
    for image in images:
        result = _docker("rmi", image)  # never -f: an image a container (a live sandbox) uses stays
        reason = ((result.stderr or result.stdout).strip().splitlines() or ["in use"])[-1]
        if result.returncode == 0 or "No such image" in reason:
            removed.append(image)
        else:
            kept.append(f"{image}: {reason}")
    return removed, kept
