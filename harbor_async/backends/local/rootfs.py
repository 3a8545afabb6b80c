"""The sandbox's root folder on the host: its sized filesystem, its folders, a minimal ``/etc``, COPY.

``<sandbox folder>/fs`` becomes the sandbox's ``/``. As root it is a tmpfs of
``storage_mb`` mounted there (``nosuid``, ``nodev``, owned by the sandbox's host
uid): one sandbox filling its disk gets ENOSPC without touching its
neighbours, and its files count against its memory cgroup as a Docker tmpfs
does. Without root it is a plain folder of the caller's (no size).

``/etc`` is made for the sandbox, never the host's: ``passwd``/``group`` with
root and nobody, ``hosts``, ``hostname``, an empty ``resolv.conf`` (there is no
network), the loader's cache and configuration, CA certificates,
``/etc/alternatives`` (``awk`` and friends resolve through it) and a few
configuration files the userland reads. Never ``shadow``, ``gshadow``, ssh
keys, ``machine-id`` or credentials (``pip.conf``, ``.npmrc``, ``gitconfig``).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import posixpath
import shutil
from pathlib import Path

from harbor_async.backends.local.dockerfile import CopyStep
from harbor_async.backends.local.errors import SandboxPathError, TaskPathEscapeError
from harbor_async.backends.local.layout import (
    SANDBOX_DIRS,
    SPECIAL_DIRS,
    SYSTEM_DIRS,
    under,
)
from harbor_async.core.errors import TaskDefinitionError
from harbor_async.core.files import remove_tree
from harbor_async.tasks.suite import task_path_escapes

#: Host /etc entries copied into the sandbox's /etc (public, read by the userland).
ETC_COPIED = (
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl/certs", "ssl/openssl.cnf",
    "localtime", "timezone", "os-release", "debian_version", "lsb-release", "bash.bashrc", "profile",
    "profile.d", "inputrc", "environment", "shells", "mime.types", "protocols", "services", "rpc",
    "python3", "python3.*", "perl", "magic", "magic.mime", "locale.alias", "gai.conf", "host.conf",
    "terminfo", "skel", "login.defs", "xattr.conf", "manpath.config",
)  # fmt: skip
ETC_WRITTEN = {
    "passwd": "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "hostname": "sandbox\n",
    "resolv.conf": "# no network in a local sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
    "protocols: files\nservices: files\n",
}
#: The tasks' folders whose symlinks must stay inside the task folder.

_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)


#: Where, as root, each sandbox's tmpfs is mounted: a root-owned folder every
#: uid can traverse, so the sandbox's uid reaches its root wherever the sandbox
#: folder is (pytest's and mkdtemp's folders are closed to other users).
#: ``<sandbox folder>/fs`` is then a symlink to the mount.
MOUNT_HUBS = ("/run/harbor-async-local", "/tmp/harbor-async-local-mounts")


def mount_hub() -> Path:
    """The folder of the sandboxes' mount points (made 0711 if missing).

    Raises:
        OSError: none of :data:`MOUNT_HUBS` can be made.
    """
    problem: OSError | None = None
    for name in MOUNT_HUBS:
        hub = Path(name)
        try:
            hub.mkdir(mode=0o711, exist_ok=True)
            info = hub.lstat()
            if info.st_uid == 0 and not hub.is_symlink() and info.st_mode & 0o022 == 0:
                hub.chmod(0o711)
                return hub
        except OSError as exc:
            problem = exc
    raise problem or OSError(f"no usable mount folder among {MOUNT_HUBS}")


def mount_tmpfs(target: Path, size_mb: int | None, uid: int, gid: int) -> None:
    """Mount a tmpfs of ``size_mb`` (None: the kernel's default, half the memory) at ``target``,
    owned by ``uid``:``gid`` (root only).

    Raises:
        OSError: the mount failed.
    """
    size = f"size={size_mb}m,nr_inodes={max(16_384, size_mb * 256)}," if size_mb else ""
    options = f"{size}mode=0700,uid={uid},gid={gid}".encode()  # no other host user may read it
    if _libc.mount(b"harbor-async", os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount tmpfs on {target}: {os.strerror(code)}")


def unmount(target: Path) -> None:
    """Detach a mount (lazily: a process still using it keeps it until it lets go)."""
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
            raise OSError(code, f"umount {target}: {os.strerror(code)}")


def mounts_under(folder: Path) -> list[Path]:
    """Mount points at or below ``folder`` (deepest first), from this mount namespace's table."""
    prefix = str(folder)
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        point = line.split()[4].encode().decode("unicode_escape")  # octal escapes: \040 ...
        if point == prefix or point.startswith(prefix + "/"):
            found.append(Path(point))
    return sorted(set(found), key=lambda p: -len(p.parts))


def remove_sandbox_folder(folder: Path, mount: Path | None = None) -> None:
    """Unmount what is mounted in a sandbox folder (and its ``mount`` in the hub), then remove both."""
    for point in mounts_under(folder):
        unmount(point)
    if mount is not None:
        remove_mount(mount)
    remove_tree(folder)


def remove_mount(mount: Path) -> None:
    """Unmount a sandbox's tmpfs from the mount hub and remove its mount point (nothing else)."""
    if str(mount.parent) not in MOUNT_HUBS:
        return  # not ours (a forged marker): leave it alone
    unmount(mount)
    try:
        mount.rmdir()
    except FileNotFoundError:
        pass


def build_tree(fs: Path) -> None:
    """The folders every sandbox has, the mount points of the host folders, a minimal /etc."""
    for name in SANDBOX_DIRS:
        (fs / name).mkdir(parents=True, exist_ok=True)
    (fs / "tmp").chmod(0o1777)
    (fs / "var/tmp").chmod(0o1777)
    (fs / "root").chmod(0o700)
    for name in SYSTEM_DIRS:  # mount points; bwrap makes /proc, /dev and /sys itself
        mount_point = fs / name.lstrip("/")
        if os.path.islink(name):  # merged /usr: /bin -> usr/bin, same inside
            mount_point.symlink_to(os.readlink(name))
        elif os.path.isdir(name):
            mount_point.mkdir(exist_ok=True)
    build_etc(fs / "etc")


def build_etc(etc: Path) -> None:
    """The sandbox's own /etc (see the module's docstring)."""
    etc.mkdir(exist_ok=True)
    for pattern in ETC_COPIED:
        for source in sorted(glob.glob(f"/etc/{pattern}")):
            target = etc / os.path.relpath(source, "/etc")
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                if os.path.isdir(source) and not os.path.islink(source):
                    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
                else:
                    shutil.copy2(source, target, follow_symlinks=False)
            except OSError:
                continue  # unreadable: the userland does without it
    for name, text in ETC_WRITTEN.items():
        (etc / name).write_text(text)
    mtab = etc / "mtab"
    mtab.unlink(missing_ok=True)
    mtab.symlink_to("../proc/self/mounts")


def chown_tree(fs: Path, uid: int, gid: int) -> None:
    """Give the whole tree to the sandbox's host uid (its root), links included, not followed."""
    os.lchown(fs, uid, gid)
    for folder, dirnames, filenames in os.walk(fs):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(folder, name), uid, gid)


def chown_made(fs: Path, made: list[Path], uid: int) -> None:
    """Give ``uid`` each host path in ``made`` under the root ``fs``, the folders between, and all below them."""
    for path in made:
        try:
            relative = path.relative_to(fs)
        except ValueError:
            continue  # not in the sandbox's root (a host folder): not the sandbox's to own
        current = fs
        for part in relative.parts:
            current = current / part
            if not os.path.lexists(current):
                break
            if os.lstat(current).st_uid != uid:
                os.lchown(current, uid, uid)
        if os.path.isdir(path) and not os.path.islink(path):
            chown_tree(path, uid, uid)


def check_task_paths(task_dir: Path) -> None:
    """Refuse a task whose instruction, tests, solution or environment is a symlink out of the task.

    Raises:
        TaskPathEscapeError: naming the path and where it leads.
    """
    for path, target in task_path_escapes(task_dir):
        raise TaskPathEscapeError(path, target)


def apply_copy(fs: Path, context: Path, step: CopyStep, workdir: str) -> None:
    """Copy one COPY/ADD line's build-context sources (or heredoc text) into the (not yet started) sandbox.

    Done on the host before any sandbox process exists, so no process can swap
    a path meanwhile. Symlinks inside a copied folder are kept as links (they
    name sandbox paths); a source that leads out of the build context is refused.

    Raises:
        TaskPathEscapeError: a source (or a symlink it is) leads out of the context.
        TaskDefinitionError: a source does not exist, or is outside the context by ``..``.
    """
    if step.content is not None:  # COPY <<EOF /dest
        host = host_path(fs, workdir, step.dest, writable=True)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_text(step.content, encoding="utf-8")
        return
    context = context.resolve()
    for pattern in step.sources:
        relative = posixpath.normpath(pattern.lstrip("/"))
        if relative.startswith(".."):
            raise TaskDefinitionError(f"COPY source {pattern!r} is outside the build context")
        matches = sorted(context.glob(relative)) if relative != "." else [context]
        if not matches:
            raise TaskDefinitionError(
                f"Dockerfile line {step.line}: COPY source {pattern!r} not found in {context}"
            )
        for source in matches:
            if not source.resolve().is_relative_to(context):
                raise TaskPathEscapeError(source, source.resolve())
            if source.is_dir():  # a folder's contents go into dest
                put_tree(fs, workdir, source, step.dest)
            elif step.dest_is_dir:
                put_file(fs, workdir, source, posixpath.join(step.dest, source.name))
            else:
                put_file(fs, workdir, source, step.dest)


def host_path(fs: Path, workdir: str, sandbox_path: str, *, writable: bool) -> Path:
    """The host path behind ``sandbox_path`` in a sandbox that runs no process yet.

    Symlinks resolve as the sandbox would (a link to ``/etc/passwd`` means the
    sandbox's). Only for building: once the sandbox runs, its processes could
    swap a path between this check and its use; transfers then go through
    the sandbox's own namespaces (:mod:`.transfers`).

    Raises:
        SandboxPathError: under /proc, /dev, /sys, (``writable``) under a
            read-only host folder, or a symlink loop.
    """
    pending = posixpath.join(workdir, sandbox_path).split("/")
    resolved = "/"
    hops = 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            resolved = posixpath.dirname(resolved)
            continue
        candidate = posixpath.join(resolved, name)
        host = _host_location(fs, candidate)
        if host.is_symlink():
            hops += 1
            if hops > 40:
                raise SandboxPathError(f"too many symlinks in {sandbox_path!r}")
            target = os.readlink(host)
            pending = target.split("/") + pending
            if target.startswith("/"):
                resolved = "/"
            continue
        resolved = candidate
    check_sandbox_path(resolved, writable=writable, shown=sandbox_path)
    return _host_location(fs, resolved)


def check_sandbox_path(resolved: str, *, writable: bool, shown: str) -> None:
    """Refuse kernel file systems, and (``writable``) the read-only host folders.

    Raises:
        SandboxPathError: as said.
    """
    if under(resolved, SPECIAL_DIRS):
        raise SandboxPathError(f"{shown!r} is a kernel file system in the sandbox")
    if writable and under(resolved, SYSTEM_DIRS):
        raise SandboxPathError(
            f"{shown!r} is on a read-only host folder in the local sandbox "
            f"({', '.join(SYSTEM_DIRS)} are read-only; every other path is writable)"
        )


def _host_location(fs: Path, resolved: str) -> Path:
    if under(resolved, SYSTEM_DIRS):
        return Path(resolved)  # bound read-only at the same path
    return fs / resolved.lstrip("/")


def put_file(fs: Path, workdir: str, source: Path, target: str) -> None:
    host = host_path(fs, workdir, target, writable=True)
    if host.is_dir():  # like cp: a file copied onto a folder lands inside it
        host = host_path(fs, workdir, posixpath.join(target, source.name), writable=True)
    host.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, host)


def put_tree(fs: Path, workdir: str, source: Path, target: str) -> None:
    host_path(fs, workdir, target, writable=True).mkdir(parents=True, exist_ok=True)
    for folder, dirnames, filenames in os.walk(source):
        relative = Path(folder).relative_to(source).as_posix()
        base = posixpath.normpath(posixpath.join(target, relative))
        for name in [*dirnames, *filenames]:
            entry = Path(folder, name)
            if entry.is_symlink():  # kept as a link: it names a sandbox path
                link = host_path(fs, workdir, base, writable=True) / name
                if link.is_dir() and not link.is_symlink():
                    remove_tree(link)
                link.unlink(missing_ok=True)
                link.symlink_to(os.readlink(entry))
            elif entry.is_dir():
                host_path(fs, workdir, posixpath.join(base, name), writable=True).mkdir(exist_ok=True)
            elif entry.is_file():
                put_file(fs, workdir, entry, posixpath.join(base, name))
