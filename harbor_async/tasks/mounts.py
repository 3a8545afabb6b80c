"""Host folders mounted into every sandbox of a run: Harbor's ``--mounts``, read-only unless ``--mounts-writable``.

``harbor run --mounts '<JSON>'`` takes a JSON array of volumes in Docker
Compose's service format: ``"/host/path:/sandbox/path[:ro]"`` strings or
``{"type": "bind", "source": ..., "target": ..., "read_only": true}`` objects
(Harbor's ``EnvironmentConfig.mounts`` and its job configs take the objects).
Every sandbox runs code that is treated as hostile, and a writable host mount
lets that code change the host's files. So here every mount is read-only
(Harbor's are writable unless they say ``ro``): one that says nothing is
mounted read-only, and one the JSON makes writable (``:rw``, ``"read_only":
false``) is refused unless ``--mounts-writable`` is given; with it each mount
is as Harbor reads it (writable unless ``ro``/``"read_only": true``).

Only bind mounts of existing host paths, given as absolute paths, are taken
(a named volume, an image or a tmpfs is a Compose feature the local backend
has no counterpart of), onto absolute sandbox paths other than ``/``, the
kernel's ``/proc``, ``/sys`` and ``/dev``, and Harbor's ``/tests``,
``/solution`` and ``/logs`` (a mount there would stand in for the task's
tests or for what the verifier writes, its reward among them). The local and
docker backends honour them; every other backend is refused before anything
starts (:func:`check_backend`).

The normalized form (:func:`normalized`) is Harbor's object form, what the job's
settings store and what each backend gets: ``{"type": "bind", "source",
"target"}`` plus ``"read_only": true`` for a read-only mount.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from harbor_async.core.errors import HarborAsyncError

#: The flag that lets a mount be writable (named in every refusal of a writable one).
WRITABLE_FLAG = "--mounts-writable"
#: Sandbox paths no mount may cover: the kernel's, and Harbor's tests, solution and logs (the reward's folder).
RESERVED_TARGETS = ("/proc", "/sys", "/dev", "/tests", "/solution", "/logs")
#: Host paths no mount may come from (resolved): the kernel's and the runtime's (sockets: docker.sock, dbus, ...).
RESERVED_SOURCES = ("/proc", "/sys", "/dev", "/run", "/var/run", "/boot")
#: Harbor keyword options that mount host paths their own way (writable by default): refused, --mounts instead.
MOUNTING_OPTIONS = frozenset({"mounts", "auto_mounts", "auto_mounting", "extra_docker_compose"})
#: Entries of a mounted folder checked for sockets and devices; a larger folder is refused (mount a narrower one).
MAX_CHECKED_ENTRIES = 100_000
#: Keys of a mount object taken (Compose's ``bind`` options only as ``create_host_path: false``).
_KEYS = frozenset({"type", "source", "target", "read_only", "bind"})


class MountError(HarborAsyncError, ValueError):
    """A ``--mounts`` value (or a job config's ``environment.mounts``) refused: one line, before anything starts."""


def parse_mounts(text: str | None, *, writable: bool = False, flag: str = "--mounts") -> list[dict[str, Any]]:
    """``--mounts``' JSON text as normalized mounts (:func:`normalized`); ``None`` or ``""``: none.

    Raises:
        MountError: text that is not a JSON array, or a mount :func:`normalized` refuses.
    """
    if text is None or not text.strip():
        return []
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise MountError(f"{flag}: not JSON ({exc}); give a JSON array such as '[\"/data:/data:ro\"]'") from None
    return normalized(values, writable=writable, flag=flag)


def normalized(values: Any, *, writable: bool = False, flag: str = "--mounts") -> list[dict[str, Any]]:
    """Mounts (Compose strings or objects) in Harbor's object form, each checked; read-only unless ``writable``.

    Also what a resumed job's stored mounts go through again: a host path gone since is refused then.

    Raises:
        MountError: not a list; a mount that is no bind of an existing absolute host path onto an
            absolute, unreserved sandbox path; two mounts on one target; a writable one without ``writable``.
    """
    if not isinstance(values, list):
        raise MountError(f"{flag}: expected a JSON array of mounts, got {type(values).__name__}")
    found: list[dict[str, Any]] = []
    targets: set[str] = set()
    given = []
    for index, value in enumerate(values):  # what needs no look at the host first: the JSON's own mistakes
        where = f"{flag}[{index}]"
        source, target, mode = _fields(value, where)
        target = _sandbox_target(target, where)
        if target in targets:
            raise MountError(f"{where}: a second mount on {target}")
        targets.add(target)
        if mode == "rw" and not writable:
            raise MountError(
                f"{where}: {source} is writable in the JSON; every mount is read-only unless {WRITABLE_FLAG} is given "
                "(a writable host folder opens the host to the sandbox's code)"
            )
        given.append((where, source, target, mode))
    for where, source, target, mode in given:
        mount: dict[str, Any] = {"type": "bind", "source": _host_source(source, where), "target": target}
        if mode == "ro" or not writable:  # unsaid: Harbor's writable, only with --mounts-writable
            mount["read_only"] = True  # (Harbor's model takes only true: a writable mount leaves it out)
        found.append(mount)
    _refuse_sources_in_writable_ones(found, flag)
    return found


def refuse_mounting_options(options: Mapping[str, Any], flag: str = "--ek") -> None:
    """Refuse Harbor's own ways of mounting host paths in backend options (writable by default, unchecked).

    Raises:
        MountError: one of :data:`MOUNTING_OPTIONS` is set.
    """
    given = sorted(MOUNTING_OPTIONS & set(options))
    if given:
        raise MountError(f"{flag} {given[0]}: host paths are mounted with --mounts (read-only unless {WRITABLE_FLAG})")


def refuse_protected(mounts: Sequence[Mapping[str, Any]], protected: Mapping[str, str | os.PathLike[str]]) -> None:
    """Refuse a mount whose source holds, or lies in, a protected host folder (the suite: its tests and
    solutions; the jobs folder: every trial's rewards), which the sandbox's code would read or change.

    Raises:
        MountError: naming the mount and the folder.
    """
    for index, mount in enumerate(mounts):
        source = os.path.realpath(mount["source"])
        for what, folder in protected.items():
            path = os.path.realpath(folder)
            if _within(path, source) or _within(source, path):
                raise MountError(f"--mounts[{index}]: {mount['source']} overlaps {what} ({path}); mount a folder apart")


def check_backend(environment_class: type, backend: str, mounts: Sequence[dict[str, Any]]) -> None:
    """Refuse mounts a backend cannot honour, before any sandbox starts (nothing to refuse without mounts).

    The local backend (its class names its own checks as ``check_host_mounts``) and Harbor's docker
    environment and its subclasses honour them; any other backend is refused.

    Raises:
        MountError: the backend does not honour host mounts, or refuses one of these.
    """
    if not mounts:
        return
    own_check = getattr(environment_class, "check_host_mounts", None)
    if own_check is not None:
        try:
            own_check(mounts)
        except MountError as exc:
            raise MountError(f"--mounts: {exc}") from None
        return
    from harbor.environments.docker.docker import DockerEnvironment

    if not issubclass(environment_class, DockerEnvironment):
        raise MountError(f"--mounts: backend {backend!r} cannot honour host mounts (the local and docker backends can)")


def _fields(value: Any, where: str) -> tuple[Any, Any, str | None]:
    """(source, target, mode) of one Compose string or object; the mode is "ro", "rw" or ``None`` (unsaid)."""
    if isinstance(value, str):  # Compose's short form: SOURCE:TARGET[:MODE]
        parts = value.split(":")
        if len(parts) not in (2, 3) or not all(parts[:2]):
            raise MountError(f"{where}: {value!r} is not SOURCE:TARGET[:ro|rw] (a host path, a sandbox path)")
        mode = parts[2] if len(parts) == 3 else ""
        if mode not in ("", "ro", "rw"):
            raise MountError(f"{where}: mode {mode!r} not taken (ro or rw)")
        return parts[0], parts[1], mode or None
    if not isinstance(value, dict):
        raise MountError(f"{where}: a mount is a 'SOURCE:TARGET[:ro]' string or an object, got {type(value).__name__}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise MountError(f"{where}: {', '.join(map(repr, unknown))} not taken (type, source, target, read_only)")
    if value.get("type") != "bind":
        raise MountError(f"{where}: type {value.get('type')!r} not taken; only \"bind\" mounts of host paths are")
    if value.get("bind") not in (None, {}, {"create_host_path": False}):
        raise MountError(f"{where}: bind options {value['bind']!r} not taken (only create_host_path: false)")
    read_only = value.get("read_only")
    if read_only is not None and not isinstance(read_only, bool):
        raise MountError(f"{where}: read_only must be true or false, got {read_only!r}")
    return value.get("source"), value.get("target"), None if read_only is None else ("ro" if read_only else "rw")


def _host_source(source: Any, where: str) -> str:
    """The host path, checked and resolved (links followed once, here): absolute, printable, existing, no
    socket, FIFO or device (a read-only bind of a socket still connects: docker.sock), and none inside a folder."""
    if not isinstance(source, str) or not source:
        raise MountError(f"{where}: source must be a host path, got {source!r}")
    if not source.isprintable():
        raise MountError(f"{where}: source {source!r} has control characters")
    if not os.path.isabs(source):
        raise MountError(f"{where}: source {source!r} is relative; give an absolute host path")
    if not os.path.exists(source):
        raise MountError(f"{where}: source {os.path.normpath(source)} does not exist on this host")
    source = os.path.realpath(source)  # what is bound: a link swapped later does not move it
    if source == "/" or any(_within(source, p) for p in RESERVED_SOURCES):
        raise MountError(f"{where}: source {source} is reserved (/, {', '.join(RESERVED_SOURCES)} and below)")
    if not (os.path.isfile(source) or os.path.isdir(source)):
        raise MountError(f"{where}: source {source} is not a file or folder (a socket, FIFO or device opens the host)")
    if os.path.isdir(source):
        _refuse_special_files(source, where)
    return source


def _refuse_special_files(folder: str, where: str) -> None:
    """Refuse a folder holding a socket, FIFO or device (links are not followed: they resolve in the sandbox)."""
    import stat

    pending, seen = [folder], 0
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError as exc:
            raise MountError(f"{where}: cannot read {exc.filename}: {exc.strerror}") from None
        for entry in entries:
            seen += 1
            if seen > MAX_CHECKED_ENTRIES:
                raise MountError(f"{where}: {folder} holds over {MAX_CHECKED_ENTRIES} entries; mount a narrower folder")
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                raise MountError(f"{where}: {entry.path} is a socket, FIFO or device (it would open the host)")
            if stat.S_ISDIR(mode):
                pending.append(entry.path)


def _refuse_sources_in_writable_ones(mounts: Sequence[Mapping[str, Any]], flag: str) -> None:
    """A source below a writable mount's source is refused: the sandbox could swap a folder on its path for a link."""
    for index, writable in enumerate(mounts):
        if writable.get("read_only"):
            continue
        for other, mount in enumerate(mounts):
            inner = mount["source"] != writable["source"] and _within(mount["source"], writable["source"])
            if other != index and inner:  # (the same folder twice binds the same folder: nothing to swap)
                raise MountError(f"{flag}[{other}]: {mount['source']} overlaps the writable {writable['source']}")


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or below it (both absolute, resolved)."""
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _sandbox_target(target: Any, where: str) -> str:
    """The sandbox path, checked: absolute, printable, not ``/`` nor a reserved one (normalized)."""
    if not isinstance(target, str) or not target:
        raise MountError(f"{where}: target must be a sandbox path, got {target!r}")
    if not target.isprintable():
        raise MountError(f"{where}: target {target!r} has control characters")
    if not target.startswith("/"):
        raise MountError(f"{where}: target {target!r} is not an absolute sandbox path")
    target = posixpath.normpath(target)
    target = "/" + target.lstrip("/")  # normpath keeps a leading "//"
    if target == "/" or any(target == p or target.startswith(p + "/") for p in RESERVED_TARGETS):
        raise MountError(f"{where}: target {target} is reserved (/, {', '.join(RESERVED_TARGETS)} and below)")
    return target
