"""Per-sandbox resource limits: cgroups (v1 or v2), per-sandbox host uids, rlimits.

Each sandbox gets, when this process runs as root:

- its own unprivileged host uid (and gid) from a pool (:class:`UidLease`): root
  inside the sandbox's user namespace is that uid outside, and RLIMIT_NPROC,
  which counts processes per uid, is then a per-sandbox limit;
- a cgroup per controller (:class:`Cgroups`): ``pids.max``, a memory limit and
  a CPU quota; v2 where the unified hierarchy has the controllers, else v1's
  ``pids``, ``memory`` and ``cpu`` hierarchies. Every process of the sandbox
  (the keeper and each exec) is put in them before it starts, by the helper
  ``helpers/enter-cgroups.sh``;
- where a cgroup2 hierarchy has ``cgroup.kill`` (Linux 5.14; the unified root,
  or the ``unified`` companion a v1 host mounts beside its hierarchies), a
  cgroup of each exec's own below the sandbox's there (:meth:`Cgroups.exec_group`):
  one write to its ``cgroup.kill`` ends everything the exec started, however
  many processes, with no walk of a process table.

Without root none of this is possible: the sandbox's root is the caller's own
uid, and there are no process, memory or CPU limits (see the README).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor_async.backends.leftovers import kill
from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.naming import PREFIX

#: First host uid/gid of the per-sandbox pool: past systemd's container range
#: (524288-1879048191) and below 2**31, which some tools take for signed.
UID_BASE = 1_879_048_192
UID_COUNT = 65_536
#: Where the pool's lock files live (one per uid in use; a lock dies with its holder).
UID_LOCK_DIRS = ("/run/harbor-async-uids", "/tmp/harbor-async-uids")
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Where a v1 (hybrid) host mounts its cgroup2 hierarchy, which has no controllers but has ``cgroup.kill``.
HYBRID_UNIFIED = CGROUP_ROOT / "unified"
CPU_PERIOD_US = 100_000
#: Name prefix of an exec's own cgroup below the sandbox's (see :meth:`Cgroups.exec_group`).
EXEC_GROUP_PREFIX = "exec-"


class LimitError(HarborAsyncError, RuntimeError):
    """A sandbox's limits could not be set up (no free uid, cgroup not writable ...)."""


@dataclass(frozen=True)
class ResourceLimits:
    """What one sandbox may use. ``None``: not limited."""

    pids: int | None = 1024
    memory_mb: int | None = None
    cpus: float | None = None
    storage_mb: int | None = None


class UidLease:
    """One host uid of the pool, held (by an ``flock``) until :meth:`release`.

    The lock is released by the kernel when the holding process dies, so a
    killed run never leaks a uid.
    """

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd = fd

    @classmethod
    def acquire(cls, hint: int = 0) -> UidLease:
        """Lease a free uid, probing from ``hint`` (spread the probes: a hash of the sandbox's name).

        Raises:
            LimitError: no lock folder is writable, or all uids are in use.
        """
        folder = _lock_dir()
        for step in range(UID_COUNT):
            uid = UID_BASE + (hint + step) % UID_COUNT
            fd = os.open(folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue
                raise LimitError(f"cannot lock {folder / str(uid)}: {exc}") from exc
            return cls(uid, fd)
        raise LimitError(f"all {UID_COUNT} sandbox uids are in use")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def pool_uids_mapped() -> bool:
    """Whether this process's user namespace maps the whole uid pool (it does on a machine's own root;
    a container's root user namespace usually maps 65,536 uids from 0 only)."""
    try:
        lines = Path("/proc/self/uid_map").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        inside, _outside, count = (int(v) for v in line.split())
        if inside <= UID_BASE and UID_BASE + UID_COUNT <= inside + count:
            return True
    return False


def _lock_dir() -> Path:
    for name in UID_LOCK_DIRS:
        folder = Path(name)
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise LimitError(f"no writable folder for the sandbox uid locks among {UID_LOCK_DIRS}")


def cgroup_version() -> str | None:
    """``"v2"`` when the unified hierarchy has memory, pids and cpu; ``"v1"`` when
    v1 has those hierarchies; ``None`` when neither is writable (not root)."""
    if os.geteuid() != 0:
        return None
    unified = CGROUP_ROOT / "cgroup.controllers"
    try:
        if {"memory", "pids", "cpu"} <= set(unified.read_text().split()):
            return "v2"
    except OSError:
        pass
    if all((CGROUP_ROOT / name / "cgroup.procs").exists() for name in ("memory", "pids", "cpu")):
        return "v1"
    return None


class Cgroups:
    """The cgroups of one sandbox, named ``harbor-async/<name>`` in each hierarchy."""

    def __init__(self, name: str, version: str) -> None:
        self.version = version
        if version == "v2":
            self.folders = [CGROUP_ROOT / PREFIX / name]
        else:
            self.folders = [CGROUP_ROOT / c / PREFIX / name for c in ("pids", "memory", "cpu")]
        #: The sandbox's folder in a cgroup2 hierarchy with ``cgroup.kill`` (None: none): its execs' groups go below.
        self.kill_parent: Path | None = None
        self._execs = 0

    @classmethod
    def of_folders(cls, folders: list[Path]) -> Cgroups:
        """The cgroups a marker recorded (to remove them; the version does not matter then)."""
        group = cls("", "v1")
        group.folders = list(folders)
        return group

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid to, to join."""
        return [str(folder / "cgroup.procs") for folder in self.folders]

    def create(self, limits: ResourceLimits) -> None:
        """Make the cgroups and write the limits.

        Raises:
            LimitError: a cgroup cannot be made or a limit not written.
        """
        try:
            if self.version == "v2":
                self._create_v2(limits)
            else:
                self._create_v1(limits)
        except OSError as exc:
            self.remove()
            raise LimitError(f"cannot set up the sandbox's cgroups ({self.version}): {exc}") from exc
        self._create_kill_parent()

    def _create_kill_parent(self) -> None:
        """The folder the execs' own cgroups go below, where ``cgroup.kill`` exists; else none (tree walks then)."""
        if self.version == "v2":
            folder = self.folders[0]
        elif (HYBRID_UNIFIED / "cgroup.controllers").exists():
            folder = HYBRID_UNIFIED / self.folders[0].relative_to(CGROUP_ROOT / "pids")
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError:
                return
            if not (folder / "cgroup.kill").exists():
                self._rmdir_quietly(folder)
                return
            self.folders.append(folder)  # the keeper and each exec's nsenter join it: a reaper finds them there too
        else:
            return
        if (folder / "cgroup.kill").exists():
            self.kill_parent = folder

    def exec_group(self) -> Path | None:
        """A new cgroup for one exec, below the sandbox's: ``cgroup.kill`` there ends that exec alone.

        The exec's process moves itself in (``enter.py``), not its nsenter, which must outlive it to
        reap it. Nothing is charged differently: no controller is enabled below the sandbox's cgroup,
        so its limits still count every process. ``None`` where it cannot be made.
        """
        if self.kill_parent is None:
            return None
        self._execs += 1
        folder = self.kill_parent / f"{EXEC_GROUP_PREFIX}{self._execs}"
        try:
            folder.mkdir()
        except OSError:
            return None
        return folder

    @staticmethod
    def drop_exec_group(folder: Path, wait: float = 0.0) -> None:
        """Remove an exec's cgroup if it is empty; one still holding what the exec left running stays until :meth:`remove`.

        ``wait``: seconds to let a killed exec's processes leave it first (blocking: a worker thread's). A process
        killed through ``cgroup.kill`` stays in the group until it has exited and been reaped, which on a loaded
        machine takes a moment after the exec's own process has ended.
        """
        deadline = time.monotonic() + wait
        while wait and _populated(folder) and time.monotonic() < deadline:
            time.sleep(0.01)
        Cgroups._rmdir_quietly(folder)

    @staticmethod
    def _rmdir_quietly(folder: Path) -> None:
        try:
            folder.rmdir()
        except OSError:
            pass

    def _create_v1(self, limits: ResourceLimits) -> None:
        pids, memory, cpu = self.folders
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)
        _write(pids / "pids.max", str(limits.pids) if limits.pids else "max")
        if limits.memory_mb:
            size = str(limits.memory_mb * 1024 * 1024)
            _write(memory / "memory.limit_in_bytes", size)
            swap = memory / "memory.memsw.limit_in_bytes"  # present when swap accounting is on
            if swap.exists():
                _write(swap, size)
        if limits.cpus:
            _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(max(int(limits.cpus * CPU_PERIOD_US), 1000)))

    def _create_v2(self, limits: ResourceLimits) -> None:
        (folder,) = self.folders
        parent = folder.parent
        parent.mkdir(exist_ok=True)
        # Controllers must be enabled on every level above the sandbox's group.
        for level in (CGROUP_ROOT, parent):
            _write(level / "cgroup.subtree_control", "+memory +pids +cpu")
        folder.mkdir(exist_ok=True)
        _write(folder / "pids.max", str(limits.pids) if limits.pids else "max")
        if limits.memory_mb:
            _write(folder / "memory.max", str(limits.memory_mb * 1024 * 1024))
            _write(folder / "memory.swap.max", "0")
        if limits.cpus:
            _write(folder / "cpu.max", f"{max(int(limits.cpus * CPU_PERIOD_US), 1000)} {CPU_PERIOD_US}")

    def pids(self) -> list[int]:
        """Every process still in the sandbox's cgroups (its execs' own included)."""
        return sorted(cgroup_members(self.folders))

    def remove(self, wait: float = 5.0) -> list[str]:
        """Remove the cgroups (they must be empty; dying processes are waited for). Returns what is left."""
        deadline = time.monotonic() + wait
        left = []
        for folder in [*exec_groups(self.folders), *self.folders]:
            while True:
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        left.append(str(folder))
                        break
                    time.sleep(0.02)
        return left


def exec_groups(folders: list[Path]) -> list[Path]:
    """The execs' own cgroups below the sandbox's ``folders`` (see :meth:`Cgroups.exec_group`)."""
    found = []
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        found += [Path(e.path) for e in entries if e.name.startswith(EXEC_GROUP_PREFIX) and e.is_dir(follow_symlinks=False)]
    return found


def cgroup_members(folders: list[Path]) -> set[int]:
    """The pids in ``folders`` and their execs' own cgroups (unreadable ones skipped)."""
    pids: set[int] = set()
    for folder in [*folders, *exec_groups(folders)]:
        try:
            pids.update(int(line) for line in Path(folder, "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            continue
    return pids


def remove_cgroups(folders: list[str]) -> list[str]:
    """Kill what still runs in leftover cgroup folders, then remove them; returns what is left."""

    pids = cgroup_members([Path(f) for f in folders])
    if pids:
        kill(pids)
    return Cgroups.of_folders([Path(f) for f in folders]).remove()


def _write(path: Path, value: str) -> None:
    with open(path, "w") as file:
        file.write(value)


def parse_limit(value: int | float | str | None, kind: type) -> Any:
    """A keyword given as a number or as text (``--ek memory_mb=512``); ``None``/``""``/``0``: none."""
    if value in (None, "", "none", "None"):
        return None
    number = kind(value)
    return number if number > 0 else None


def sandbox_cgroups(name: str, limits: ResourceLimits) -> Cgroups:
    """The cgroups of sandbox ``name``, made with its limits.

    Raises:
        LimitError: no writable hierarchy has memory, pids and cpu (not root, a
            read-only cgroupfs), or a cgroup or limit could not be written.
    """
    version = cgroup_version()
    if version is None:
        raise LimitError("no writable cgroup hierarchy with memory, pids and cpu")
    cgroups = Cgroups(name, version)
    cgroups.create(limits)
    return cgroups


def _populated(folder: Path) -> bool:
    """Whether a cgroup2 group still holds a process (its ``cgroup.events``); ``False`` where it cannot be read."""
    try:
        return "populated 1" in (folder / "cgroup.events").read_text()
    except OSError:
        return False
