"""Sandboxes made ahead: a start takes a ready one (folder, uid, cgroups, sized root, running keeper).

Most of a local start does not depend on the task: the sandbox folder and its
marker, a host uid, cgroups with the task's limits, the sized tmpfs, the base
tree with its ``/etc`` (:mod:`.template`) and the keeper's namespaces. Those
make a :class:`Piece`, built by :func:`build_piece`, either by the start
itself or ahead of it by :data:`POOL`'s thread while an engine holds the pool
(:meth:`RootPool.hold`). A start then renames the piece's folder to its own
and applies only the task's part (WORKDIR, COPY), with the host's own calls
into the sandbox root as before; the keeper's init (the host's ``sh``, waiting)
is all that runs in it until then, so no sandbox process can swap a path
meanwhile.

A piece is used by one sandbox, once: nothing is ever given back, so nothing
one sandbox wrote can reach another; ``stop()`` removes it all as before.
Pieces are made per (base folder, run label, limits, host binds), and only for a run
label an engine holds: the release of a label's last holder removes every
piece of that label not taken (keepers killed, cgroups, mounts, folders and
uids freed), and waits for one being built, while the engines of other runs
in the process keep theirs. Each piece has the marker of a sandbox (its owner
pid): a killed process's pieces are reaped like its sandboxes.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import select
import subprocess
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from harbor.environments.base import SandboxBuildFailedError

from harbor_async.backends.local.errors import LimitUnavailableError
from harbor_async.backends.local.keeper import KEEPER_THREAD, Keeper, Tools
from harbor_async.backends.local.layout import KEEPER_START_TIMEOUT
from harbor_async.backends.local.limits import (
    LimitError,
    ResourceLimits,
    UidLease,
    pool_uids_mapped,
    sandbox_cgroups,
)
from harbor_async.backends.local.rootfs import (
    mount_hub,
    mount_tmpfs,
    remove_sandbox_folder,
)
from harbor_async.backends.local.sandboxing import Confinement, HostBind, keeper_argv
from harbor_async.backends.local.template import forget, write_base_tree
from harbor_async.core.naming import MARKER_NAME, local_folder_name

log = logging.getLogger(__name__)

#: Pieces kept ready per kind at first; a take that finds none doubles it, up to the cap.
POOL_START, POOL_CAP = 2, 8
#: Seconds after a kind's piece could not be made before a start's miss lets the thread try that kind again.
RETRY_FAILED_AFTER = 30.0
#: Session ids of pieces not yet taken (a reaper lists them with the run; a start renames them).
POOL_SESSION_PREFIX = "pool-"
_numbers = itertools.count()


@dataclass
class Piece:
    """One never-used sandbox: its folder (marker, ``fs``), host identity, sized root and running keeper."""

    folder: Path
    confinement: Confinement
    lease: UidLease | None = None
    mount: Path | None = None
    keeper: Keeper | None = None
    root_fd: int | None = None
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    @property
    def fs(self) -> Path:
        return self.folder / "fs"

    def marker(self, run_label: str, session_id: str, environment_name: str = "") -> dict:
        """What a reaper reads (see the adapter's ``_write_marker``, which adds the exec pids)."""
        keeper, cgroups = self.keeper, self.confinement.cgroups
        return {
            "run_label": run_label, "session_id": session_id, "environment_name": environment_name,
            "created_at": self.created_at, "owner_pid": os.getpid(),
            "keeper_pid": keeper.process.pid if keeper is not None else None,
            "keeper_init_pid": keeper.init_pid if keeper is not None else None,
            "pids": [], "host_uid": self.confinement.uid,
            "cgroups": [str(f) for f in cgroups.folders] if cgroups is not None else [],
            "mount": str(self.mount) if self.mount is not None else None,
        }  # fmt: skip

    def write_marker(self, run_label: str, session_id: str) -> None:
        write_marker(self.folder, self.marker(run_label, session_id))


def write_marker(folder: Path, marker: dict) -> None:
    """Replace the marker atomically: a reaper never reads half of one."""
    temporary = folder / f"{MARKER_NAME}.tmp"
    temporary.write_text(json.dumps(marker))
    temporary.replace(folder / MARKER_NAME)


def build_piece(
    folder: Path, run_label: str, limits: ResourceLimits, require_limits: bool, tools: Tools, session_id: str = "",
    binds: tuple[HostBind, ...] = (),
) -> Piece:
    """Make a sandbox at ``folder`` up to its running keeper (blocking; in a worker thread); ``binds``: ``--mounts``.

    Raises:
        LimitUnavailableError: cgroups are required and cannot be made (nothing is left behind).
        LimitError: no uid of the pool is free.
        SandboxBuildFailedError: bubblewrap could not make the sandbox.
        OSError: the folder or its root could not be made.
    """
    piece = Piece(folder, Confinement(limits, binds=binds))
    session_id = session_id or folder.name
    try:
        _build_tree(piece, run_label, session_id, require_limits)
        start_keeper(piece, tools)
        piece.write_marker(run_label, session_id)
    except BaseException:
        discard_piece(piece)
        raise
    return piece


def _build_tree(piece: Piece, run_label: str, session_id: str, require_limits: bool) -> None:
    confinement, folder = piece.confinement, piece.folder
    # Root of the whole machine (not of a container's user namespace, which
    # cannot switch to the pool's uids): a host uid of its own, and cgroups.
    if os.geteuid() == 0 and pool_uids_mapped():
        piece.lease = UidLease.acquire(zlib.crc32(folder.name.encode()))
        confinement.uid = piece.lease.uid
        try:
            confinement.cgroups = sandbox_cgroups(folder.name, confinement.limits)
        except LimitError as exc:  # read-only cgroupfs (a container): only rlimits would be left
            if require_limits:
                raise LimitUnavailableError(folder.name, str(exc)) from exc
            log.warning("local sandbox %s without cgroups: %s", folder.name, exc)
    # o+x only: the sandbox's uid must reach its folder, nobody may list them.
    folder.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    folder.mkdir(mode=0o711)
    piece.write_marker(run_label, session_id)
    if confinement.uid is not None:  # a sized tmpfs in the mount hub; fs/ points at it
        mount = mount_hub() / f"{folder.name}-{zlib.crc32(str(folder).encode()):08x}"
        if mount.exists():
            remove_sandbox_folder(folder, mount)
            folder.mkdir(mode=0o711)
        mount.mkdir(mode=0o755)
        piece.mount = mount
        piece.write_marker(run_label, session_id)
        mount_tmpfs(mount, confinement.limits.storage_mb, confinement.uid, confinement.uid)
        piece.fs.symlink_to(mount)
    else:
        piece.fs.mkdir(mode=0o700)  # no other host user may read it
    write_base_tree(piece.mount or piece.fs, confinement.uid, "early")  # the late part: while bwrap starts
    piece.root_fd = os.open(piece.mount or piece.fs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def start_keeper(piece: Piece, tools: Tools, *, restart: bool = False) -> None:
    """Launch the long-lived bwrap (forked by the keeper thread) and wait for its init's ``ready``.

    ``restart``: a new keeper over a sandbox whose files are in use already
    (:meth:`~.LocalEnvironment.end_agent_processes`); its base tree is not written again.

    bwrap reports the host pid of the sandbox's PID 1 on ``--info-fd``; the
    init prints ``ready`` once bwrap has finished the setup (mounts, pivot,
    capabilities). The namespace files are opened then and kept until
    ``stop()``: an exec enters them through files passed down to it, so a
    recycled pid can never send it into another process's namespaces.
    """
    info_read, info_write = os.pipe2(os.O_CLOEXEC)
    ready_read, ready_write = os.pipe2(os.O_CLOEXEC)
    try:
        argv = keeper_argv(tools, piece.mount or piece.fs, info_write, piece.confinement, piece.folder)
        with open(piece.folder / "keeper.log", "wb") as keeper_log:
            process = KEEPER_THREAD.submit(lambda: subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=ready_write, stderr=keeper_log,
                pass_fds=(info_write,), start_new_session=True,
            )).result()  # fmt: skip
        piece.keeper = Keeper(process)
        os.close(info_write)
        os.close(ready_write)
        info_write = ready_write = -1
        # Nothing of the sandbox runs before the start returns (the init only waits), and this
        # part is nothing bubblewrap or the init reads: written here, it overlaps bwrap's setup.
        if not restart:
            write_base_tree(piece.mount or piece.fs, piece.confinement.uid, "late")
        text = _read_line(ready_read, time.monotonic() + KEEPER_START_TIMEOUT)
        if text != "ready":
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
            detail = (piece.folder / "keeper.log").read_text(errors="replace").strip()
            raise SandboxBuildFailedError(
                f"bubblewrap could not create local sandbox {piece.folder.name}: "
                f"{detail or f'exit code {process.returncode}'}"
            )
        piece.keeper.attach(json.loads(os.read(info_read, 65536) or b"{}"))
        if os.geteuid() == 0:
            # The OOM killer of a full memory cgroup must not pick PID 1 (the
            # sandbox would die with it); only root may lower the score.
            with contextlib.suppress(OSError):
                Path(f"/proc/{piece.keeper.init_pid}/oom_score_adj").write_text("-1000")
    finally:
        for fd in (info_read, info_write, ready_read, ready_write):
            if fd >= 0:
                os.close(fd)


def _read_line(fd: int, deadline: float) -> str:
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SandboxBuildFailedError(f"bubblewrap did not come up within {KEEPER_START_TIMEOUT:g} s")
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def discard_piece(piece: Piece) -> None:
    """Remove everything of a piece: its keeper (and every process with it), root fd, cgroups, mount, folder, uid."""
    keeper, piece.keeper = piece.keeper, None
    if keeper is not None:
        keeper.kill_init()
        try:
            keeper.process.wait(5)
        except subprocess.TimeoutExpired:
            keeper.process.kill()
            keeper.process.wait()
        keeper.close()
    if piece.root_fd is not None:  # an open fd would keep the tmpfs busy
        os.close(piece.root_fd)
        piece.root_fd = None
    if piece.confinement.cgroups is not None:
        left = piece.confinement.cgroups.remove()
        if left:
            log.warning("local sandbox %s: cgroups not removed: %s", piece.folder.name, left)
    try:
        remove_sandbox_folder(piece.folder, piece.mount)
    finally:
        if piece.lease is not None:
            piece.lease.release()


#: base folder, run label, limits, limits required, host binds (--mounts: the keeper makes them)
Key = tuple[str, str, ResourceLimits, bool, tuple[HostBind, ...]]


class RootPool:
    """Ready pieces per :data:`Key`, refilled by one thread for the run labels engines hold."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._ready: dict[Key, list[Piece]] = {}
        self._target: dict[Key, int] = {}
        self._tools: Tools | None = None
        self._holders: dict[str, int] = {}  # run label -> engines holding it
        self._building: Key | None = None  # the kind of the piece being built
        self._own_builds = 0  # starts that found none ready, building their own now
        self._failed: dict[Key, float] = {}  # kinds whose last piece could not be made: when
        self._thread: threading.Thread | None = None
        self.taken = self.missed = 0

    def hold(self, run_label: str) -> Callable[[], None]:
        """Keep pieces of ``run_label`` ready until the returned function is called (once); an engine holds
        its run's label while open."""
        with self._lock:
            self._holders[run_label] = self._holders.get(run_label, 0) + 1
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self._release(run_label)

        return release

    def holds(self, run_label: str) -> bool:
        """Whether an engine holds ``run_label`` (its tasks' parts are then read once, see :mod:`.template`)."""
        return run_label in self._holders

    def take(self, key: Key, tools: Tools) -> Piece | None:
        """A ready piece of ``key`` (None: none ready, or nobody holds its run label); asks for more."""
        with self._lock:
            if key[1] not in self._holders:
                return None
            self._tools = tools
            pieces = self._ready.setdefault(key, [])
            target = self._target.setdefault(key, POOL_START)
            piece = pieces.pop(0) if pieces else None
            if piece is None:
                self.missed += 1
                failed = self._failed.get(key)
                if failed is not None and time.monotonic() - failed >= RETRY_FAILED_AFTER:
                    del self._failed[key]
                    target = POOL_START  # its failure may have been passing (bwrap slow under load): try again
                self._target[key] = 0 if key in self._failed else min(POOL_CAP, target * 2)
            else:
                self.taken += 1
            self._wake()
        return piece

    @contextlib.contextmanager
    def building_own(self) -> Iterator[None]:
        """Around a start's :meth:`take` and, if it found none ready, its own build: the thread makes none meanwhile.

        Pieces are made ahead with time the starts leave over; while starts
        build their own the machine is busy with them, and a piece made then
        competes with them for the CPU (at a burst of starts, most such pieces
        would wait for starts that never come). Entered before the take, so
        the thread its miss wakes already sees it.
        """
        with self._lock:
            self._own_builds += 1
        try:
            yield
        finally:
            with self._lock:
                self._own_builds -= 1
                self._lock.notify_all()

    def ready(self, settle: float = 0.0) -> list[Piece]:
        """The pieces ready now (for tests and diagnostics), after waiting up to ``settle`` s for one being built."""
        with self._lock:
            self._lock.wait_for(lambda: self._building is None, timeout=settle)
            return [piece for pieces in self._ready.values() for piece in pieces]

    def wanted(self) -> list[Key]:
        """The kinds the thread would make a piece of now (for tests and diagnostics): none while starts build
        their own. The thread makes nothing else, so an empty list means nothing more is made until a take."""
        with self._lock:
            return [] if self._own_builds else self._short()

    def _wake(self) -> None:
        if self._thread is None:
            thread = threading.Thread(target=self._refill, name="harbor-async-local-pool", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # interpreter exit: nothing more is made, and no release waits for a piece
                return
            self._thread = thread
        self._lock.notify_all()

    def _short(self) -> list[Key]:
        """The kinds with fewer pieces ready than their target (under the lock)."""
        return [key for key, target in self._target.items() if len(self._ready.get(key, [])) < target]

    def _next_key(self) -> Key | None:
        short = self._short()
        return short[0] if short else None

    def _refill(self) -> None:
        while True:
            with self._lock:
                while self._own_builds or self._next_key() is None:
                    self._lock.wait()
                key, tools = self._next_key(), self._tools
                self._building = key
            try:
                self._make(key, tools)
            except BaseException:  # noqa: BLE001 - the pool must outlive one bad piece; releases wait on it
                log.exception("local sandbox pool: making a piece failed")
            finally:
                with self._lock:
                    self._building = None
                    self._lock.notify_all()

    def _make(self, key: Key | None, tools: Tools | None) -> None:
        assert key is not None and tools is not None
        base, label, limits, require, binds = key
        session = f"{POOL_SESSION_PREFIX}{os.getpid()}-{next(_numbers)}"
        folder = Path(base) / local_folder_name(label, session)
        try:
            piece: Piece | None = build_piece(folder, label, limits, require, tools, session, binds)
        except Exception as exc:  # noqa: BLE001 - starts then build their own, and report the error
            log.warning("local sandbox pool: cannot make %s (starts build their own): %s", folder.name, exc)
            piece = None
        with self._lock:
            if piece is not None and label in self._holders:
                self._ready.setdefault(key, []).append(piece)
                piece = None
            elif piece is None and key in self._target:
                self._target[key] = 0  # this kind fails: starts build their own, and a later miss tries again
                self._failed[key] = time.monotonic()
        if piece is not None:  # its label released meanwhile: gone before that release returns
            try:
                discard_piece(piece)
            except OSError as exc:
                log.warning("local sandbox pool: cannot remove %s: %s", piece.folder, exc)

    def close(self) -> None:
        """Remove every ready piece now, whoever holds the pool (at interpreter exit)."""
        with self._lock:
            labels = list(self._holders)
            self._holders = {label: 1 for label in labels}
        for label in labels:
            self._release(label)

    def _release(self, run_label: str) -> None:
        with self._lock:
            count = self._holders.get(run_label, 0)  # 0: close() at exit released it already
            if count > 1:
                self._holders[run_label] = count - 1
                return
            if count == 0:
                return
            del self._holders[run_label]
            keys = [key for key in {*self._ready, *self._target} if key[1] == run_label]
            pieces = [piece for key in keys for piece in self._ready.pop(key, [])]
            for key in keys:  # before the wait: the thread must not begin another of them
                self._target.pop(key, None)
                self._failed.pop(key, None)
            # A piece of this run being made is discarded by the thread itself, before this wait ends
            # (kept, if an engine of the same label holds the pool again meanwhile).
            self._lock.wait_for(
                lambda: self._building is None or self._building[1] != run_label or run_label in self._holders
            )
            forget(run_label)  # its tasks' parts are read again by a later run (their files may have changed)
            if not self._holders:
                forget()  # and the host's /etc
        for piece in pieces:
            try:
                discard_piece(piece)
            except OSError as exc:
                log.warning("local sandbox pool: cannot remove %s: %s", piece.folder, exc)


#: The process's pool (pieces are per base folder, run label and limits).
POOL = RootPool()
# An engine releases its hold when it closes; one never closed must not leave mounts and cgroups.
atexit.register(POOL.close)
