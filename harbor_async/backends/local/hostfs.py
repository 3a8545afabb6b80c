"""Sandbox files read and written from the host, never outside the sandbox's root, with bounds.

Every path is resolved by the kernel with ``openat2`` beneath a directory fd
(the sandbox's root, or the verifier's output folder): ``RESOLVE_IN_ROOT``
scopes ``..`` and absolute symlinks to that root, ``RESOLVE_NO_MAGICLINKS``
refuses ``/proc/PID/fd``-style links, ``RESOLVE_NO_XDEV`` keeps it on the
sandbox's own file system. The resolution is atomic, so a sandbox process that
swaps a path for a symlink mid-transfer can only send it to another sandbox
file. Files are opened non-blocking and must be regular (a FIFO never blocks a
transfer), sizes are apparent sizes (a sparse file counts in full), and a
transfer stops at its byte limit. Nothing in the sandbox is executed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import posixpath
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harbor_async.core.errors import TransferLimitError
from harbor_async.verification.transfer_budget import MAX_DEPTH, Budget

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
#: Paths the caller names: symlinks followed, but only within the root.
IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
#: One entry of a folder being walked: no symlink at all.
ENTRY = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (the generic syscall table)
_CHUNK = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = IN_ROOT) -> int:
    """``openat2(2)``: open ``path`` beneath ``dirfd`` as ``resolve`` allows (close-on-exec).

    Raises:
        OSError: the kernel's error (``ELOOP`` for a symlink refused, ``EXDEV`` for a mount crossed).
    """
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path or "."), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    return int(fd)


def openat2_available() -> bool:
    """Whether this kernel has ``openat2`` (Linux 5.6 and later)."""
    try:
        os.close(openat2(os.open("/", os.O_PATH | os.O_CLOEXEC), ".", os.O_PATH))
    except OSError as exc:
        return exc.errno != errno.ENOSYS
    return True


@contextlib.contextmanager
def as_fsuid(uid: int | None) -> Iterator[None]:
    """This thread's file-system uid and gid set to ``uid`` for the body (Linux's fsuid is per thread).

    A tmpfs mounted inside the sandbox's user namespace (the verifier's own
    folders) refuses files made by a uid it does not map, host root included
    (``EOVERFLOW``): the host writes there as the sandbox's root.
    """
    if uid is None:
        yield
        return
    before_uid, before_gid = _libc.setfsuid(uid), _libc.setfsgid(uid)
    try:
        yield
    finally:
        _libc.setfsgid(before_gid)
        _libc.setfsuid(before_uid)


def _copy(source: int, target: int, size: int, budget: Budget) -> None:
    """Copy at most ``size`` bytes (already taken from ``budget``): a file growing meanwhile is cut there."""
    left = size
    while left > 0:
        budget.checkpoint()
        chunk = os.read(source, min(_CHUNK, left))
        if not chunk:
            break
        left -= len(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(target, view) :]


def _open_regular(dirfd: int, path: str, resolve: int) -> tuple[int, os.stat_result]:
    """A regular file opened for reading without blocking (a FIFO or device is "not found").

    Raises:
        FileNotFoundError: nothing there, or not a regular file.
    """
    try:
        fd = openat2(dirfd, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, resolve=resolve)
    except OSError as exc:
        raise FileNotFoundError(errno.ENOENT, f"no regular file there ({exc.strerror})", path) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "not a regular file", path)
    return fd, info


def _host_file(target: Path) -> int:
    return os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def read_file(root: int, path: str, target: Path, budget: Budget) -> None:
    """Copy the sandbox's regular file ``path`` (relative to ``root``) to the host file ``target``.

    Raises:
        FileNotFoundError: no regular file there (a symlink is followed only within the root).
        TransferLimitError: larger than the budget (nothing is written).
    """
    source, info = _open_regular(root, path, IN_ROOT)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _copy_to_host(source, info.st_size, target, budget)
    finally:
        os.close(source)


def _copy_to_host(source: int, size: int, target: Path, budget: Budget) -> None:
    """Take ``size`` from the budget, then copy the open sandbox file into the host file ``target``."""
    budget.take(size)
    out = _host_file(target)
    try:
        _copy(source, out, size, budget)
    finally:
        os.close(out)


def read_tree(root: int, path: str, target: Path, budget: Budget) -> None:
    """Copy the sandbox folder ``path``'s regular files and folders to ``target`` (symlinks are skipped).

    Raises:
        FileNotFoundError: no folder there.
        TransferLimitError: the files' apparent sizes add up past the budget, or the tree is too big.
    """
    try:
        top = openat2(root, path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise FileNotFoundError(errno.ENOENT, f"no folder there ({exc.strerror})", path) from None
    try:
        target.mkdir(parents=True, exist_ok=True)
        _read_folder(top, target, budget, 0)
    finally:
        os.close(top)


def _read_folder(folder: int, target: Path, budget: Budget, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TransferLimitError(budget.shown, budget.limit or 0, f"folders deeper than {MAX_DEPTH}")
    for name in os.listdir(folder):
        budget.entry()
        try:
            info = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile
        if stat.S_ISDIR(info.st_mode):
            try:
                child = openat2(folder, name, os.O_RDONLY | os.O_DIRECTORY, resolve=ENTRY)
            except OSError:
                continue  # swapped for something else meanwhile
            try:
                (target / name).mkdir(exist_ok=True)
                _read_folder(child, target / name, budget, depth + 1)
            finally:
                os.close(child)
        elif stat.S_ISREG(info.st_mode):
            try:
                source, info = _open_regular(folder, name, ENTRY)
            except FileNotFoundError:
                continue
            try:
                _copy_to_host(source, info.st_size, target / name, budget)
            finally:
                os.close(source)


def _owned(uid: int | None, dirfd: int, name: str) -> None:
    if uid is not None:
        os.chown(name, uid, uid, dir_fd=dirfd, follow_symlinks=False)


def make_folders(root: int, path: str, uid: int | None) -> int:
    """Open the sandbox folder ``path``, making it and its parents as needed (owned by ``uid``).

    Raises:
        NotADirectoryError: a component exists and is not a folder.
    """
    parts = [part for part in path.split("/") if part]
    current = os.dup(root)
    try:
        for part in parts:
            try:
                child = openat2(current, part, os.O_PATH | os.O_DIRECTORY, resolve=IN_ROOT)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=current)
                _owned(uid, current, part)
                child = openat2(current, part, os.O_PATH | os.O_DIRECTORY, resolve=ENTRY)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise NotADirectoryError(errno.ENOTDIR, "not a folder", path) from None
                raise
            os.close(current)
            current = child
        return current
    except BaseException:
        os.close(current)
        raise


def write_file(
    root: int, path: str, source: Path, uid: int | None, mode: int, budget: Budget, fsuid: int | None = None
) -> None:
    """Write the host file ``source`` to the sandbox path ``path`` (into it when it is a folder).

    A symlink at ``path`` is followed within the root, as ``cp`` inside the sandbox would.
    ``fsuid``: make the sandbox's files as this uid (see :func:`as_fsuid`).
    """
    with open(source, "rb") as host, as_fsuid(fsuid):  # the host file as ourselves, the sandbox's as fsuid
        full = path.rstrip("/") or "/"
        try:
            os.close(openat2(root, full, os.O_PATH | os.O_DIRECTORY))
            full = f"{full.rstrip('/')}/{source.name}"
        except OSError:
            pass
        parent, _, name = full.rpartition("/")
        folder = make_folders(root, parent, uid)
        try:
            link = os.readlink(name, dir_fd=folder)  # a dangling link's folders are made, as before
        except OSError:
            link = None
        finally:
            os.close(folder)
        if link is not None:
            os.close(make_folders(root, posixpath.dirname(posixpath.join(parent or "/", link)), uid))
        size = os.fstat(host.fileno()).st_size
        budget.take(size)
        out = openat2(root, full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(out).st_mode):
                raise IsADirectoryError(errno.EISDIR, "not a regular file", path)
            if uid is not None:
                os.fchown(out, uid, uid)
            os.fchmod(out, mode)
            _copy(host.fileno(), out, size, budget)
        finally:
            os.close(out)


def write_tree(root: int, path: str, source: Path, uid: int | None, budget: Budget, fsuid: int | None = None) -> None:
    """Copy the host folder ``source``'s contents into the sandbox folder ``path`` (symlinks kept as links)."""
    with as_fsuid(fsuid):
        folder = make_folders(root, path, uid)
    try:
        _write_folder(folder, source, uid, budget, fsuid)
    finally:
        os.close(folder)


def _write_folder(folder: int, source: Path, uid: int | None, budget: Budget, fsuid: int | None) -> None:
    for entry in sorted(os.scandir(source), key=lambda e: e.name):  # the host's side as ourselves
        budget.entry()
        name = entry.name
        if entry.is_dir(follow_symlinks=False):
            with as_fsuid(fsuid):
                child = _sandbox_folder(folder, name, entry.stat().st_mode & 0o7777, uid)
            try:
                _write_folder(child, Path(entry.path), uid, budget, fsuid)
            finally:
                os.close(child)
            continue
        link = os.readlink(entry.path) if entry.is_symlink() else None
        host = open(entry.path, "rb") if link is None and entry.is_file() else None  # noqa: SIM115
        try:
            with as_fsuid(fsuid):
                _write_entry(folder, name, link, host, uid, budget)
        finally:
            if host is not None:
                host.close()


def _sandbox_folder(folder: int, name: str, mode: int, uid: int | None) -> int:
    """The sandbox folder ``name`` in ``folder`` (made, or put in place of a non-folder), opened."""
    try:
        there = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        there = None
    if there is None or not stat.S_ISDIR(there.st_mode):
        if there is not None:
            os.unlink(name, dir_fd=folder)
        os.mkdir(name, mode, dir_fd=folder)
        _owned(uid, folder, name)
    return openat2(folder, name, os.O_PATH | os.O_DIRECTORY, resolve=ENTRY)


def _write_entry(folder: int, name: str, link: str | None, host: Any, uid: int | None, budget: Budget) -> None:
    """One link (``link``) or file (``host``, open) of an upload, replacing what the sandbox put there."""
    try:
        there = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        there = None
    if link is not None:
        if there is not None and not stat.S_ISDIR(there.st_mode):
            os.unlink(name, dir_fd=folder)
        os.symlink(link, name, dir_fd=folder)
        _owned(uid, folder, name)
        return
    if host is None:
        return  # neither file, folder nor link (a socket in the task folder): not copied
    if there is not None and not stat.S_ISREG(there.st_mode) and not stat.S_ISDIR(there.st_mode):
        os.unlink(name, dir_fd=folder)  # a link or FIFO the sandbox put there: replaced, not followed
    info = os.fstat(host.fileno())
    budget.take(info.st_size)
    out = openat2(
        folder, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_NOFOLLOW, 0o644, resolve=ENTRY
    )
    try:
        if uid is not None:
            os.fchown(out, uid, uid)
        os.fchmod(out, info.st_mode & 0o7777)
        _copy(host.fileno(), out, info.st_size, budget)
    finally:
        os.close(out)
