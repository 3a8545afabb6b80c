"""File transfers that never leave the sandbox: each one runs inside the sandbox's namespaces.

A check on the host followed by an open on the host races with the sandbox: a
process inside can swap a path for a symlink between the two, and the host
then writes or reads a host file. Here the host never opens a sandbox path.
Each transfer runs ``helpers/transfer.sh`` inside the sandbox (joined like an
exec, as the sandbox's root, in its cgroups): paths resolve in the sandbox's
own mount namespace, so a symlink can only lead to another sandbox file, and
what an upload creates belongs to the sandbox's user. Data travels through
pipes (a tar stream for folders), so memory stays bounded.
"""

from __future__ import annotations

import functools
import os
import posixpath
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import anyio

from harbor_async.backends.local.errors import SandboxPathError, TaskPathEscapeError
from harbor_async.backends.local.layout import BASE_ENV
from harbor_async.backends.local.proctree import kill_exec_tree
from harbor_async.backends.local.rootfs import check_sandbox_path
from harbor_async.backends.local.sandboxing import helper
from harbor_async.errors import HarborAsyncError

#: A transfer that takes longer than this is killed (the sandbox may be wedged).
TRANSFER_TIMEOUT = 600.0
_SCRIPT: str | None = None


class TransferError(HarborAsyncError, OSError):
    """A transfer failed inside the sandbox (its stderr is in the message)."""


class SandboxTransfers:
    """The file-transfer half of :class:`~harbor_async.backends.local.LocalEnvironment` (Harbor's four methods)."""

    environment_dir: Path
    session_id: str
    _workdir: str
    _started: bool
    _keeper: Any

    def _join(self, env: dict[str, str], cwd: str, command: list[str]) -> tuple[list[str], tuple[int, ...]]:
        raise NotImplementedError

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file to ``target_path`` in the sandbox (into it when it is a folder), owned by its root.

        Raises:
            SandboxPathError: the target is on a read-only or kernel file system.
            TaskPathEscapeError: the source is in the task folder but a symlink out of it.
        """
        source = Path(source_path)
        check_source(source, self._task_dir)
        target = sandbox_path(self._workdir, target_path, writable=True)
        mode = f"{source.stat().st_mode & 0o7777:o}"
        await self._transfer(
            ["put-file", target, source.name, mode], shown=target_path, stdin=file_writer(source)
        )

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
        await self._transfer(["put-tree", target], shown=target_dir, stdin=tar_writer(source.resolve()))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a sandbox file (symlinks resolved inside the sandbox) to ``target_path`` on the host.

        Raises:
            FileNotFoundError: no regular file there.
        """
        source = sandbox_path(self._workdir, source_path, writable=False)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(target, "wb") as file:
                await self._transfer(["get-file", source], shown=source_path, stdout=file)
        except BaseException:
            target.unlink(missing_ok=True)
            raise

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox folder's regular files into ``target_dir`` on the host (overwriting).

        Symlinked folders are not entered; file symlinks are followed inside the sandbox.

        Raises:
            FileNotFoundError: no folder there.
        """
        source = sandbox_path(self._workdir, source_dir, writable=False)
        await self._transfer(["get-tree", source], shown=source_dir, stdout=tar_reader(Path(target_dir)))

    @property
    def _task_dir(self) -> Path | None:
        task_dir = self.environment_dir.parent
        return task_dir if (task_dir / "task.toml").is_file() else None

    async def _transfer(
        self,
        args: list[str],
        *,
        shown: str,
        stdin: Callable[[IO[bytes]], None] | None = None,
        stdout: IO[bytes] | Callable[[IO[bytes]], None] | None = None,
    ) -> None:
        """Run the transfer helper inside the sandbox (see the module's docstring)."""
        if not self._started or self._keeper is None:
            raise RuntimeError(f"local sandbox {self.session_id} is not started")
        argv, fds = self._join(dict(BASE_ENV), "/", ["sh", "-c", script(), "transfer.sh", *args])
        reader = stdout if callable(stdout) else None
        with tempfile.TemporaryFile() as errors:
            # Spawned with no await since the check above: stop() cannot close
            # the namespace files in between (their numbers could be reused).
            process = spawn(
                argv, fds, stdin=stdin is not None, stdout=None if reader else stdout, reader=reader is not None,
                errors=errors,
            )  # fmt: skip
            # Not cancellable: a transfer ends by itself, or when stop() ends the sandbox.
            await anyio.to_thread.run_sync(
                functools.partial(finish, process, errors, stdin=stdin, reader=reader, shown=shown)
            )


def script() -> str:
    """The transfer helper's text (it runs with the sandbox's ``sh``; the file itself is not visible inside)."""
    global _SCRIPT
    if _SCRIPT is None:
        _SCRIPT = Path(helper("transfer.sh")).read_text()
    return _SCRIPT


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


def spawn(
    argv: list[str], fds: tuple[int, ...], *, stdin: bool, stdout: IO[bytes] | None, reader: bool, errors: IO[bytes]
) -> subprocess.Popen[bytes]:
    """Start one transfer process (milliseconds; called on the loop, right after the sandbox was seen started)."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE if reader else (stdout or subprocess.DEVNULL),
        stderr=errors, pass_fds=fds, env={}, start_new_session=True,
    )  # fmt: skip


def finish(
    process: subprocess.Popen[bytes],
    errors: IO[bytes],
    *,
    stdin: Callable[[IO[bytes]], None] | None,
    reader: Callable[[IO[bytes]], None] | None,
    shown: str,
) -> None:
    """Feed and drain a transfer process (blocking: call it from a worker thread); map its exit code.

    Raises:
        FileNotFoundError: exit 2.
        SandboxPathError: exit 3 or 4.
        TransferError: any other failure.
    """
    try:
        if stdin is not None:
            assert process.stdin is not None
            try:
                stdin(process.stdin)
                process.stdin.close()
            except BrokenPipeError:
                pass  # it stopped reading: its exit code says why
        if reader is not None:
            assert process.stdout is not None
            reader(process.stdout)
        code = process.wait(timeout=TRANSFER_TIMEOUT)
    except BaseException:
        kill_exec_tree(process.pid)  # its processes inside the sandbox too, not only the nsenter
        process.kill()
        process.wait()
        raise
    finally:
        for pipe in (process.stdin, process.stdout):
            if pipe is not None and not pipe.closed:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass
    errors.seek(0)
    detail = errors.read(4096).decode(errors="replace").strip()
    if code == 2:
        raise FileNotFoundError(f"{shown!r} does not exist in the local sandbox (or is not of the kind asked)")
    if code in (3, 4):
        raise SandboxPathError(f"{shown!r} is not writable in the local sandbox (read-only or not a folder)")
    if code != 0:
        raise TransferError(f"transfer of {shown!r} failed (exit {code}): {detail}")


def tar_writer(source: Path, *, single: str | None = None) -> Callable[[IO[bytes]], None]:
    """Write a tar stream of folder ``source``'s contents (links kept as links, owned by root)."""

    def as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    def write(pipe: IO[bytes]) -> None:
        with tarfile.open(fileobj=pipe, mode="w|", format=tarfile.GNU_FORMAT) as tar:
            for name in sorted(os.listdir(source)):
                tar.add(source / name, arcname=name, filter=as_root)  # symlinks are not followed

    return write


def file_writer(source: Path) -> Callable[[IO[bytes]], None]:
    def write(pipe: IO[bytes]) -> None:
        with open(source, "rb") as file:
            while chunk := file.read(1 << 20):
                pipe.write(chunk)

    return write


def tar_reader(target: Path) -> Callable[[IO[bytes]], None]:
    """Extract regular files (and their folders) of a tar stream the sandbox wrote, safely.

    The stream is the sandbox's: ``filter="data"`` refuses absolute names,
    ``..`` and anything landing outside ``target``; only regular files are
    taken (no links, devices or FIFOs).
    """

    def read(pipe: IO[bytes]) -> None:
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=pipe, mode="r|") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                try:
                    tar.extract(member, target, filter="data")
                except (tarfile.FilterError, OSError):
                    continue  # a hostile or odd name: skip it, never write outside target
        # drain what is left so the writer is not killed by SIGPIPE mid-stream
        while pipe.read(65536):
            pass

    return read
