"""The dynamic loader's files in a sandbox's ``/etc``, put back to the host's before a new init starts over it.

Every dynamically linked program started in the sandbox's mount namespace is
loaded by the host's loader, which reads the sandbox's own ``/etc/ld.so.preload``
(libraries loaded into every program) and ``/etc/ld.so.cache`` (where each
library is found). Both are the agent's to write. When the agent's processes
are ended before the verifier by a new keeper over the same files
(:meth:`~.LocalEnvironment.end_agent_processes`), the new init (a shell) and
every program it starts would load what the agent named there: a library whose
constructor forks a daemon in the new PID namespace would outlive the kill the
restart is for. So, while no process of the sandbox runs, the preload list is
moved aside (its name gains :data:`HIDDEN_SUFFIX`: nothing is lost) and the
cache is the host's copy again, as the base tree wrote it (the agent's is kept
beside it, under the same suffix).

Paths are resolved with ``openat2`` within the sandbox's root (an ``/etc`` the
agent made a link resolves as the loader resolves it); nothing is followed out
of it, and nothing of the sandbox is executed.
"""

from __future__ import annotations

import contextlib
import os
import stat

from harbor_async.backends.local import hostfs
from harbor_async.verification.isolation import CACHE, HIDDEN_SUFFIX, PRELOAD

HOST_CACHE = "/etc/ld.so.cache"


def reset_loader_files(root_fd: int, uid: int | None) -> list[str]:
    """Move the sandbox's ``/etc/ld.so.preload`` aside and restore the host's ``/etc/ld.so.cache``.

    Call only while no process of the sandbox runs (the agent could swap the
    files back meanwhile). ``uid``: the host uid the restored cache belongs to
    (the sandbox's; ``None``: ours). Returns the sandbox paths changed.
    """
    try:
        etc = hostfs.openat2(root_fd, "etc", os.O_PATH | os.O_DIRECTORY)
    except OSError:  # no /etc the loader could read (missing, a file, a link out of the root)
        return []
    changed = []
    try:
        if _exists(etc, PRELOAD):
            os.replace(PRELOAD, PRELOAD + HIDDEN_SUFFIX, src_dir_fd=etc, dst_dir_fd=etc)
            changed.append(f"/etc/{PRELOAD}")
        if _cache_differs(etc):
            if _exists(etc, CACHE):
                os.replace(CACHE, CACHE + HIDDEN_SUFFIX, src_dir_fd=etc, dst_dir_fd=etc)
            _write_host_cache(etc, uid)
            changed.append(f"/etc/{CACHE}")
    finally:
        os.close(etc)
    return changed


def _exists(folder: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _cache_differs(etc: int) -> bool:
    """Whether the sandbox's cache is anything but a regular file equal to the host's (absent on both: no)."""
    host_exists = os.path.isfile(HOST_CACHE)
    try:
        fd = os.open(CACHE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=etc)
    except FileNotFoundError:
        return host_exists
    except OSError:  # a link, a FIFO ...: not the host's
        return True
    with os.fdopen(fd, "rb") as sandbox:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not host_exists:
            return True
        if os.fstat(fd).st_size != os.stat(HOST_CACHE).st_size:
            return True
        with open(HOST_CACHE, "rb") as host:
            return not _same_stream(sandbox, host)


def _same_stream(first: object, second: object) -> bool:
    chunk = 1 << 16
    while True:
        a, b = first.read(chunk), second.read(chunk)  # type: ignore[attr-defined]
        if a != b:
            return False
        if not a:
            return True


def _write_host_cache(etc: int, uid: int | None) -> None:
    if not os.path.isfile(HOST_CACHE):
        return
    temporary = CACHE + ".harbor-async-new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary, dir_fd=etc)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=etc)
    with os.fdopen(fd, "wb") as target, open(HOST_CACHE, "rb") as source:
        while block := source.read(1 << 20):
            target.write(block)
        if uid is not None:
            os.fchown(fd, uid, uid)
    os.replace(temporary, CACHE, src_dir_fd=etc, dst_dir_fd=etc)
