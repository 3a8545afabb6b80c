"""File transfers (Harbor's four methods) done by the host, through the sandbox's root, bounded.

Nothing runs inside the sandbox for a transfer: code the sandbox planted (an
``ld.so.preload``, a ``tar`` on its PATH) has nothing to hook, and no host file
descriptor is ever handed to a sandbox process. Paths resolve beneath the
sandbox's root with ``openat2`` (:mod:`.hostfs`); every download stops at the
backend's ``transfer_limit_mb`` (apparent sizes) and is cancellable between
chunks, so the phase's deadline holds. While the verifier runs, its output
folder is its own (:mod:`.verifier_ns`) and is read from there.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread

from harbor_async.backends.local import hostfs
from harbor_async.backends.local.errors import SandboxPathError, TaskPathEscapeError
from harbor_async.backends.local.rootfs import check_sandbox_path
from harbor_async.core.offload import off_loop
from harbor_async.verification import disk_bounds
from harbor_async.verification.transfer_budget import Budget

#: Default bound of one download (``transfer_limit_mb``), apparent size.
DEFAULT_TRANSFER_LIMIT_MB = 512


class SandboxTransfers:
    """The file-transfer half of :class:`~harbor_async.backends.local.LocalEnvironment`."""

    environment_dir: Path
    session_id: str
    _workdir: str
    _started: bool
    _root_fd: int | None
    _transfer_limit: int | None
    _private_dirs: dict[str, int]  # the verifier's own folders while it runs: sandbox path -> fd

    def _sandbox_uid(self) -> int | None:
        raise NotImplementedError

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file to ``target_path`` in the sandbox (into it when it is a folder), owned by its root.

        Raises:
            SandboxPathError: the target is on a read-only or kernel file system, or not writable.
            TaskPathEscapeError: the source is in the task folder but a symlink out of it.
        """
        source = Path(source_path)
        check_source(source, self._task_dir)
        target = sandbox_path(self._workdir, target_path, writable=True)
        mode = source.stat().st_mode & 0o7777
        root, relative = self._resolve(target)
        try:
            await self._run(hostfs.write_file, root, relative, source, self._sandbox_uid(), mode, shown=target_path)
        except (NotADirectoryError, IsADirectoryError) as exc:
            raise SandboxPathError(f"{target_path!r} is not writable in the local sandbox: {exc.strerror}") from exc

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy a host folder's contents into ``target_dir`` in the sandbox (symlinks kept as links).

        Raises:
            NotADirectoryError: ``source_dir`` is not a folder.
            SandboxPathError, TaskPathEscapeError: as for :meth:`upload_file`.
        """
        source = Path(source_dir)
        if not source.is_dir():
            raise NotADirectoryError(f"{source} is not a folder")
        check_source(source, self._task_dir)
        target = sandbox_path(self._workdir, target_dir, writable=True)
        root, relative = self._resolve(target)
        try:
            await self._run(hostfs.write_tree, root, relative, source.resolve(), self._sandbox_uid(), shown=target_dir)
        except (NotADirectoryError, IsADirectoryError) as exc:
            raise SandboxPathError(f"{target_dir!r} is not writable in the local sandbox: {exc.strerror}") from exc

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a sandbox file (symlinks followed within the sandbox) to ``target_path`` on the host.

        Raises:
            FileNotFoundError: no regular file there (FIFOs and devices are not files).
            TransferLimitError: larger than ``transfer_limit_mb``; nothing is kept.
        """
        source = sandbox_path(self._workdir, source_path, writable=False)
        target = Path(target_path)
        root, relative = self._resolve(source)
        try:
            await self._run(hostfs.read_file, root, relative, target, shown=source_path, limited=True)
        except BaseException:
            target.unlink(missing_ok=True)
            raise

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox folder's regular files and folders into ``target_dir`` on the host (overwriting).

        Symlinks, FIFOs and devices are skipped.

        Raises:
            FileNotFoundError: no folder there.
            TransferLimitError: the files add up past ``transfer_limit_mb``; what was copied stays.
        """
        source = sandbox_path(self._workdir, source_dir, writable=False)
        root, relative = self._resolve(source)
        await self._run(hostfs.read_tree, root, relative, Path(target_dir), shown=source_dir, limited=True)

    async def download_dir_with_exclusions(self, *, source_dir: str, target_dir: Path | str, exclude: list[str]) -> None:
        """:meth:`download_dir` (within the transfer budget), then the ``exclude`` globs dropped.

        Harbor's own route packs a gzip in the sandbox and unpacks it on the
        host, where nothing bounds what it expands to.
        """
        from harbor_async.verification.artifacts import prune_excluded

        await self.download_dir(source_dir, target_dir)
        await off_loop(prune_excluded, Path(target_dir), exclude)  # a walk

    @property
    def _task_dir(self) -> Path | None:
        task_dir = self.environment_dir.parent
        return task_dir if (task_dir / "task.toml").is_file() else None

    def _resolve(self, path: str) -> tuple[int, str]:
        """The directory fd a sandbox path resolves beneath, and the path relative to it."""
        if not self._started or self._root_fd is None:
            raise RuntimeError(f"local sandbox {self.session_id} is not started")
        for folder, fd in self._private_dirs.items():
            if path == folder or path.startswith(folder + "/"):
                return fd, path[len(folder) :] or "."
        return self._root_fd, path

    async def _run(self, function: Callable[..., None], *args: Any, shown: str, limited: bool = False) -> None:
        """Run one transfer in a worker thread; cancelling the caller stops it at the next chunk."""
        budget = Budget(  # a download also charges its episode's disk bound (harbor_async.verification.disk_bounds)
            self._transfer_limit if limited else None, shown, anyio.from_thread.check_cancelled,
            disk_bounds.current() if limited else None,
        )
        extra: dict[str, Any] = {}
        if args[0] in self._private_dirs.values() and function in (hostfs.write_file, hostfs.write_tree):
            extra["fsuid"] = self._sandbox_uid()  # a tmpfs of the sandbox's user namespace: as its root
        await anyio.to_thread.run_sync(functools.partial(function, *args, budget, **extra))


def sandbox_path(workdir: str, path: str, *, writable: bool) -> str:
    """``path`` made absolute against ``workdir``.

    Kernel file systems are refused, and (``writable``) the read-only host folders.

    Raises:
        SandboxPathError: as said.
    """
    resolved = posixpath.normpath(posixpath.join(workdir, path))
    check_sandbox_path(resolved, writable=writable, shown=path)
    return resolved


def check_source(source: Path, task_dir: Path | None) -> None:
    """Refuse an upload source inside the task folder that is a symlink out of it.

    Raises:
        TaskPathEscapeError: naming the source.
    """
    if task_dir is None:
        return
    root = task_dir.resolve()
    absolute = source.absolute()
    if absolute.is_relative_to(task_dir.absolute()) or absolute.is_relative_to(root):
        if not source.resolve().is_relative_to(root):
            raise TaskPathEscapeError(source, source.resolve())


__all__ = ["DEFAULT_TRANSFER_LIMIT_MB", "SandboxPathError", "SandboxTransfers", "check_source", "sandbox_path"]
