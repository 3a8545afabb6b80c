"""How a sandbox is confined: the keeper's bwrap command line and the prefix every process of the sandbox starts with.

The keeper starts on the host as::

    sh enter-cgroups.sh <cgroup.procs>... --      # into the sandbox's cgroups (root)
    setpriv --reuid U --regid U --clear-groups    # the sandbox's own host uid (root)
    prlimit --nproc=N --core=0 --                 # per-uid process limit (root, no cgroups)
    bwrap ...                                     # build the namespaces

and every exec as ``python -I -S helpers/enter.py SPEC`` (or a fork of the warm
``helpers/enter_server.py`` that runs the same code, :mod:`.enter_server`), which does the same
three steps, joins the namespaces and confines itself before the sandbox's
command is loaded (see that file: a program started inside the sandbox's mount
namespace with the namespace's capabilities would run the sandbox's
``/etc/ld.so.preload``). So nothing of the sandbox ever runs as host root:
bwrap makes a user namespace in which uid 0 is ``U`` (``--unshare-user --uid 0
--gid 0``), and an exec enters that namespace as ``U``, the namespace's owner.
Without root the uid and limit steps are skipped: the caller's uid is root inside.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from harbor_async.backends.local.keeper import Keeper, Tools, sandbox_caps
from harbor_async.backends.local.layout import (
    BASE_ENV,
    CAP_NUMBERS,
    KEEPER_INIT,
    MASKED_PATHS,
    READONLY_PATHS,
    SHM_SIZE,
    SPECIAL_DIRS,
    SYSTEM_DIRS,
    under,
)
from harbor_async.backends.local.limits import Cgroups, ResourceLimits, pool_uids_mapped
from harbor_async.tasks.mounts import RESERVED_TARGETS, MountError

_HELPERS = resources.files("harbor_async.backends.local") / "helpers"


def helper(name: str) -> str:
    """Path of a helper program shipped with the package (a real file on disk)."""
    return str(_HELPERS / name)


@dataclass(frozen=True)
class HostBind:
    """A host path bound into the sandbox (``--mounts``): bwrap's ``--ro-bind``, or ``--bind`` when writable."""

    source: str
    target: str
    read_only: bool = True


def host_binds(mounts: Sequence[Mapping[str, Any]] | None) -> tuple[HostBind, ...]:
    """Harbor's mounts (``BaseEnvironment``'s ``mounts``) as this backend's binds; read-only unless one says not.

    Only binds of absolute host paths onto absolute sandbox paths outside the host's read-only
    system folders (``/usr``, ``/lib``, ...: bwrap cannot make a mount point in them) and the
    kernel's folders are taken (``harbor-async run`` has checked the rest: :mod:`harbor_async.tasks.mounts`).

    Raises:
        MountError: a mount this backend cannot bind.
    """
    binds = []
    for mount in mounts or ():
        source, target = str(mount.get("source") or ""), str(mount.get("target") or "")
        if mount.get("type", "bind") != "bind" or not os.path.isabs(source) or not target.startswith("/"):
            raise MountError(f"local backend: only binds of absolute host paths are taken, got {dict(mount)!r}")
        target = "/" + os.path.normpath(target).lstrip("/")
        if target == "/" or under(target, SYSTEM_DIRS + SPECIAL_DIRS + RESERVED_TARGETS):
            raise MountError(f"local backend: cannot mount onto {target} (/, {', '.join(SYSTEM_DIRS + SPECIAL_DIRS)})")
        if os.geteuid() == 0 and pool_uids_mapped() and (closed := _closed_folder(source)) is not None:
            raise MountError(
                f"local backend: the sandbox's own host uid cannot reach {source}: {closed} gives other users "
                "no search (x) permission"
            )
        binds.append(HostBind(source, target, bool(mount.get("read_only", False))))  # Harbor's reading: the engine checked
    return tuple(binds)


def _closed_folder(source: str) -> str | None:
    """The first folder above ``source`` that other users may not pass, if any.

    As root, a sandbox is a host uid of its own with no groups, and bwrap binds the source as that
    uid: it needs other users' search permission on every folder above it (else the start fails).
    """
    folder = os.path.dirname(os.path.abspath(source))
    while True:
        try:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return folder
        except OSError:
            return folder
        if folder == "/":
            return None
        folder = os.path.dirname(folder)


@dataclass
class Confinement:
    """One sandbox's host identity and limits, and the host paths bound into it (``--mounts``)."""

    limits: ResourceLimits
    uid: int | None = None  # the sandbox's host uid (None: the caller's own, not root)
    cgroups: Cgroups | None = None
    binds: tuple[HostBind, ...] = ()

    def host_prefix(self, tools: Tools) -> list[str]:
        """What every process of the sandbox starts with on the host (see the module's docstring)."""
        argv: list[str] = []
        if self.cgroups is not None:
            argv += [tools.sh, helper("enter-cgroups.sh"), *self.cgroups.procs_files, "--"]
        if self.uid is not None:
            argv += [tools.setpriv, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"]
            # Where cgroups are missing, RLIMIT_NPROC is what is left: it counts
            # per real uid, so with a uid of its own it is this sandbox's limit.
            if self.limits.pids and self.cgroups is None:
                argv += [tools.prlimit, f"--nproc={self.limits.pids}", "--core=0", "--"]
        return argv


def keeper_argv(tools: Tools, fs: Path, info_fd: int, confinement: Confinement, folder: Path) -> list[str]:
    """The long-lived bwrap: the sandbox's namespaces, mounts and capabilities, with a waiting init.

    ``fs`` is the sandbox's root; ``folder``, its folder on the host, is named
    on the command line only (set and unset at once: the sandbox never sees
    it) so that ``ps`` and a reaper can tell whose bwrap this is.
    """
    # --as-pid-1: the init shell is the namespace's PID 1 (bwrap's own init
    # would show bwrap's host command line inside the sandbox).
    argv = [
        *confinement.host_prefix(tools),
        tools.bwrap, "--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0",
        # Not --disable-userns: it puts the sandbox in a nested user namespace
        # that an exec entering as the outer one's owner has no rights over.
        "--as-pid-1", "--die-with-parent", "--new-session",
        "--hostname", BASE_ENV["HOSTNAME"], "--bind", str(fs), "/",
    ]  # fmt: skip
    for name in SYSTEM_DIRS:
        if os.path.isdir(name) and not os.path.islink(name):
            argv += ["--ro-bind", name, name]
    # --mounts, before the kernel's folders and masks (which a bind could otherwise cover). bwrap binds the
    # source as the sandbox's uid: a path that uid cannot reach fails the start, named in the keeper's log.
    for bind in confinement.binds:
        argv += ["--ro-bind" if bind.read_only else "--bind", bind.source, bind.target]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(SHM_SIZE), "--tmpfs", "/dev/shm"]
    argv += ["--ro-bind", "/sys", "/sys"]
    # The host's cgroup tree would show every sandbox's name and usage: a sandbox sees its own
    # cgroup (v2: one folder, read-only, as a container does), or nothing.
    own = confinement.cgroups.folders[0] if confinement.cgroups is not None and confinement.cgroups.version == "v2" else None
    if own is not None:
        argv += ["--ro-bind", str(own), "/sys/fs/cgroup"]
    elif os.path.isdir("/sys/fs/cgroup"):
        argv += ["--tmpfs", "/sys/fs/cgroup", "--remount-ro", "/sys/fs/cgroup"]
    for path in READONLY_PATHS:  # the host's own file, read-only (bwrap binds host paths)
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    for path in MASKED_PATHS:
        if os.path.isdir(path):
            argv += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            argv += ["--ro-bind", "/dev/null", path]
    argv += ["--cap-drop", "ALL"]
    for capability in sandbox_caps():
        argv += ["--cap-add", capability]
    argv += ["--clearenv", "--setenv", "PATH", BASE_ENV["PATH"], "--chdir", "/"]
    argv += ["--setenv", "HARBOR_ASYNC_SANDBOX", str(folder), "--unsetenv", "HARBOR_ASYNC_SANDBOX"]
    argv += ["--info-fd", str(info_fd)]
    return [*argv, "--", tools.sh, "-c", KEEPER_INIT]


def join_spec(
    keeper: Keeper,
    confinement: Confinement,
    env: dict[str, str],
    cwd: str,
    command: list[str],
    *,
    mnt: int | None = None,
    extra_caps: tuple[str, ...] = (),
    hold: tuple[str, ...] = (),
    kill_group: Path | None = None,
) -> dict[str, Any]:
    """The SPEC ``enter.py`` takes to run ``command`` inside the keeper's namespaces (``ns``: name to open fd).

    The helper enters the namespaces through the namespace files this process
    holds open (passed down), so a recycled pid can never send it elsewhere; it
    keeps the sandbox's host uid (the namespace's owner, root inside), then
    sets no-new-privs and the keeper's capabilities (plus ``extra_caps``)
    before it runs ``command`` with exactly ``env``. ``mnt`` joins another
    mount namespace of the sandbox's (the verifier's) instead of the keeper's;
    ``hold`` makes the verifier's instead of running a command (see ``enter.py``);
    ``kill_group``, the exec's own cgroup (:meth:`.Cgroups.exec_group`), which the command joins.
    """
    namespaces = dict(keeper.namespaces)
    if mnt is not None:
        namespaces["mnt"] = mnt
    if hold:  # only the user and mount namespaces: it stays out of the sandbox's PID namespace
        namespaces = {name: fd for name, fd in namespaces.items() if name in ("user", "mnt")}
    limits = confinement.limits
    spec = {
        "procs": [str(f) for f in confinement.cgroups.procs_files] if confinement.cgroups is not None else [],
        "uid": confinement.uid,
        "nproc": limits.pids if confinement.uid is not None and confinement.cgroups is None else None,
        "ns": namespaces,
        "caps": sorted(CAP_NUMBERS[c] for c in (*sandbox_caps(), *extra_caps)),
        "cwd": cwd,
        "env": env,
        "argv": command,
        "hold": list(hold),
        "hold_mb": limits.storage_mb or 256,
        "kill": str(kill_group / "cgroup.procs") if kill_group is not None else None,
    }
    return spec


def enter_argv(spec: dict[str, Any]) -> list[str]:
    """``enter.py SPEC`` as a process of its own (it must inherit ``spec["ns"]``'s fds)."""
    return [sys.executable, "-I", "-S", "-B", helper("enter.py"), json.dumps(spec)]
