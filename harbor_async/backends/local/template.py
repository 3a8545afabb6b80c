"""The tree every sandbox starts with, read from the host once and written per sandbox in a few milliseconds.

:func:`~harbor_async.backends.local.rootfs.build_tree` (the folders, the
mount points of the host folders, the minimal ``/etc``) globs and copies
about 700 host entries with ``shutil``, and the sandbox's uid then had to be
given every one of them by a walk: 40 ms of a start. Here that tree is built
once per process into a scratch folder, read into memory (under 1 MiB) and
deleted; each sandbox gets it written by plain syscalls relative to its root,
as the sandbox's uid (the thread's fsuid), so nothing needs a ``chown``.
The scratch folder is the host's, root-owned: nothing of any sandbox's is read.
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from pathlib import Path

from harbor_async.backends.local.dockerfile import CopyStep
from harbor_async.backends.local.hostfs import as_fsuid
from harbor_async.backends.local.rootfs import apply_copy, build_tree, host_path
from harbor_async.core.files import remove_tree

_DIR, _FILE, _LINK = 0, 1, 2
_lock = threading.Lock()
Entry = tuple[int, str, int, bytes | str]  # kind, path relative to the root, mode, content or link target
_entries: list[Entry] | None = None
TaskKey = tuple[str, str, str, tuple[CopyStep, ...]]  # run label, environment folder, WORKDIR, COPY lines
_tasks: dict[TaskKey, list[Entry]] = {}
_seen: set[TaskKey] = set()  # tasks started once in their run, their part not yet read


def base_entries() -> list[Entry]:
    """The base tree as ``(kind, relative path, mode, content or link target)``, parents first (cached)."""
    global _entries
    with _lock:
        if _entries is None:
            scratch = _scratch()
            try:
                build_tree(scratch)
                _entries = _read(scratch)
            finally:
                remove_tree(scratch)
        return _entries


def _scratch() -> Path:
    """A private folder in memory where there is one (``/dev/shm``): the tree is built there once."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="harbor-async-template-", dir=shm))


def task_entries(run_label: str, environment_dir: Path, copies: list[CopyStep], workdir: str) -> list[Entry] | None:
    """What a task adds to the base tree (its WORKDIR, its COPY lines), from its second start in a run on
    (cached until :func:`forget` of the run, as Docker builds a task's image once per run); ``None`` at its
    first, which applies its lines itself.

    Reading a task's part costs a whole base tree written and read back
    (tens of milliseconds, more with starts beside it), worth paying for a
    task that starts again (a GRPO group, a second attempt), not for one
    that runs once (an eval of many tasks).

    Applied with :func:`~.rootfs.apply_copy` to a scratch copy of the base tree,
    so the rules (symlinks, folders, escapes refused) are the same; then only the
    entries the task made or changed are kept.

    Raises:
        TaskPathEscapeError, TaskDefinitionError: as :func:`~.rootfs.apply_copy`.
    """
    key = (run_label, str(environment_dir), workdir, tuple(copies))
    with _lock:
        found = _tasks.get(key)
        if found is None and key not in _seen:
            _seen.add(key)
            return None
    if found is not None:
        return found
    base = {(kind, relative, mode, content) for kind, relative, mode, content in base_entries()}
    scratch = _scratch()
    try:
        write_base_tree(scratch, None)
        host_path(scratch, "/", workdir, writable=True).mkdir(parents=True, exist_ok=True)
        for step in copies:
            apply_copy(scratch, environment_dir, step, "/")
        entries = [entry for entry in _read(scratch) if entry not in base]
    finally:
        remove_tree(scratch)
    with _lock:
        _tasks[key] = entries
    return entries


def forget(run_label: str | None = None) -> None:
    """Drop the tasks' parts read for ``run_label``'s run; without one, every cached tree: the next sandbox
    reads the host's ``/etc`` and the task's files again."""
    global _entries
    with _lock:
        if run_label is None:
            _entries = None
        for key in [key for key in {*_tasks, *_seen} if run_label is None or key[0] == run_label]:
            _tasks.pop(key, None)
            _seen.discard(key)


def _read(top: Path) -> list[Entry]:
    entries: list[Entry] = []
    for folder, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted([*dirnames, *filenames]):
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, top)
            info = os.lstat(path)
            mode = stat.S_IMODE(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                entries.append((_LINK, relative, 0, os.readlink(path)))
            elif stat.S_ISDIR(info.st_mode):
                entries.append((_DIR, relative, mode, b""))
            elif stat.S_ISREG(info.st_mode):
                with open(path, "rb") as file:
                    entries.append((_FILE, relative, mode, file.read()))
    return entries


def write_base_tree(fs: Path, uid: int | None, part: str = "all") -> None:
    """Write the base tree into the empty sandbox root ``fs``, owned by ``uid`` (None: the caller).

    ``part``: ``"all"``; or ``"early"`` then ``"late"``. The late part is
    nine in ten entries (the links of ``/etc/alternatives`` and ``/etc/ssl``)
    and nothing the keeper's start reads (bubblewrap's mount points, the
    dynamic loader's files, the init shell), so a start writes it while
    bubblewrap sets the sandbox up (see :func:`split_entries`).

    Raises:
        OSError: something is in the way, or a write failed.
    """
    entries = base_entries()
    if part != "all":
        early, late = split_entries(entries)
        entries = early if part == "early" else late
    write_entries(fs, entries, uid, fresh=True)


def split_entries(entries: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """``entries`` as (every folder, file and top-level link; the links below ``etc/``), each in order.

    A link below ``etc/`` has its folder in the first part, so the parts
    written in that order keep parents first.
    """
    early = [entry for entry in entries if entry[0] != _LINK or not entry[1].startswith("etc/")]
    late = [entry for entry in entries if entry[0] == _LINK and entry[1].startswith("etc/")]
    return early, late


def write_entries(fs: Path, entries: list[Entry], uid: int | None, *, fresh: bool = False) -> None:
    """Write ``entries`` under the sandbox root ``fs`` (not yet running anything of the sandbox's), as ``uid``.

    ``fresh``: nothing is there yet; else an entry replaces what is in its way
    (a folder is kept, its mode set). Nothing is followed: no symlink of the
    tree is ever a path this writes through (parents come first and are folders).

    Raises:
        OSError: a write failed.
    """
    root = os.open(fs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with as_fsuid(uid):  # created as the sandbox's root: its own files from the start
            for kind, relative, mode, content in entries:
                if kind == _DIR:
                    try:
                        os.mkdir(relative, 0o700, dir_fd=root)
                    except FileExistsError:
                        if fresh or not stat.S_ISLNK(os.lstat(relative, dir_fd=root).st_mode):
                            raise
                        os.unlink(relative, dir_fd=root)  # a link of the base tree the task made a folder
                        os.mkdir(relative, 0o700, dir_fd=root)
                    os.chmod(relative, mode, dir_fd=root)  # past the umask (/tmp is 1777)
                    continue
                if not fresh:
                    try:
                        os.unlink(relative, dir_fd=root)
                    except FileNotFoundError:
                        pass
                if kind == _LINK:
                    os.symlink(content, relative, dir_fd=root)
                    continue
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(relative, flags, 0o600, dir_fd=root)
                try:
                    view = memoryview(content)  # type: ignore[arg-type]
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
    finally:
        os.close(root)
