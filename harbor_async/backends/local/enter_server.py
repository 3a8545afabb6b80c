"""The warm enter server: one ``helpers/enter_server.py`` per host process forks each exec's ``enter.py``.

Starting ``python enter.py SPEC`` costs about 20 ms of CPU per exec, most of
an episode's CPU on a small machine. The server loads ``enter.py`` once and
forks a child per exec that does exactly what ``enter.py`` does (see both
files). The host sends it the SPEC and the descriptors (stdio, namespace
files) over a unix socket; it answers, on a socketpair of that exec's own,
a pidfd of the child and later its exit status, and reaps the child only
after the host closes that socketpair (:class:`ServedProcess` is the host's
handle, used as anyio's ``Process`` is).

The server is forked by :data:`~.keeper.KEEPER_THREAD` and dies with it
(``PR_SET_PDEATHSIG``), and when its socket closes. Where it cannot serve
(not started, died, a SPEC over the socket's size) an exec starts
``enter.py`` itself, as before; ``HARBOR_ASYNC_LOCAL_ENTER_SERVER=0`` always does.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

import anyio

from harbor_async.backends.local.keeper import KEEPER_THREAD
from harbor_async.backends.local.proctree import pidfd_signal
from harbor_async.backends.local.sandboxing import enter_argv, helper

#: Set to 0 to start one ``enter.py`` per exec instead of using the warm server.
ENTER_SERVER_ENV = "HARBOR_ASYNC_LOCAL_ENTER_SERVER"
_MAX_SPEC = 192 * 1024  # a request is one datagram: the socket's send buffer bounds it
_SEND_BUFFER = 1 << 20


class ServedProcess:
    """One exec's child of the server: pid, returncode, ``wait``, ``kill``, ``aclose`` as anyio's ``Process``."""

    def __init__(self, pid: int, pidfd: int, reply: socket.socket) -> None:
        self.pid, self.pidfd, self._reply = pid, pidfd, reply
        self.returncode: int | None = None
        self._reader: anyio.Event | None = None  # set when the task reading the status is done or cancelled
        self.stdin: Any = None
        self.stdout: Any = None
        self.stderr: Any = None

    async def wait(self) -> int:
        """The exit status (negative: killed by that signal); any number of tasks may wait at once."""
        while self.returncode is None:
            if self._reader is not None:  # another task reads: wait until it is done or gives up
                await self._reader.wait()
                continue
            self._reader = anyio.Event()
            try:
                await anyio.wait_readable(self._reply)
                try:
                    message = self._reply.recv(64)
                except BlockingIOError:
                    continue
                if message.startswith(b"exit "):
                    self.returncode = int(message[5:])
                elif not message:  # the server died: the status is lost; wait for the child's end at least
                    await anyio.wait_readable(self.pidfd)
                    self.returncode = -signal.SIGKILL
            finally:
                reader, self._reader = self._reader, None
                reader.set()
        return self.returncode

    def kill(self) -> None:
        if self.pidfd >= 0:
            pidfd_signal(self.pidfd, signal.SIGKILL)

    def terminate(self) -> None:
        if self.pidfd >= 0:
            pidfd_signal(self.pidfd, signal.SIGTERM)

    async def aclose(self) -> None:
        """Wait for the exit, then let the server reap the child (its pid is free only from here)."""
        try:
            with anyio.CancelScope(shield=True):
                await self.wait()
        finally:
            self._reply.close()
            if self.pidfd >= 0:
                os.close(self.pidfd)
                self.pidfd = -1
            for pipe in (self.stdin, self.stdout, self.stderr):
                if pipe is not None:
                    await pipe.aclose()


class EnterServer:
    """The host's side of the server process (started lazily, restarted if it died)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def _start(self) -> None:
        """Fork the server from the keeper thread (blocking: call from a worker thread)."""
        with self._lock:
            if self._live():
                return
            self.close()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
                argv = [sys.executable, "-I", "-S", "-B", helper("enter_server.py"), str(theirs.fileno()), str(os.getpid())]
                popen = functools.partial(
                    subprocess.Popen, argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),), env={}, cwd="/", start_new_session=True,
                )  # fmt: skip
                self._process = KEEPER_THREAD.submit(popen).result()
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self._socket = ours

    def _live(self) -> bool:
        return self._socket is not None and self._process is not None and self._process.poll() is None

    def close(self) -> None:
        """Close the socket (the server exits at EOF); its running children run on."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None:
            try:
                self._process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._process = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._live() and self._process is not None else None

    async def spawn(self, spec: dict[str, Any], stdio: Sequence[int]) -> ServedProcess | None:
        """Have the server run ``spec`` with ``stdio`` (stdin, stdout, stderr); None: it cannot."""
        names = list(spec["ns"])
        text = json.dumps({**spec, "ns": {name: index for index, name in enumerate(names)}}).encode()
        if len(text) > _MAX_SPEC:
            return None
        if not self._live():
            await anyio.to_thread.run_sync(self._start)
        listener = self._socket
        if listener is None:
            return None
        reply, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                socket.send_fds(listener, [text], [theirs.fileno(), *stdio, *(spec["ns"][name] for name in names)])
            except OSError:  # the server is gone
                return None
            finally:
                theirs.close()
            reply.setblocking(False)
            while True:
                await anyio.wait_readable(reply)
                try:
                    message, received, _flags, _address = socket.recv_fds(reply, 256, 1)
                except BlockingIOError:
                    continue
                break
            if not message.startswith(b"pid ") or len(received) != 1:
                for fd in received:
                    os.close(fd)
                return None
        except BaseException:
            reply.close()
            raise
        return ServedProcess(int(message[4:]), received[0], reply)


SERVER = EnterServer()


def enabled() -> bool:
    return os.environ.get(ENTER_SERVER_ENV, "1").strip().lower() not in ("0", "false", "no")


class _Pipe:
    """The host's end of a child's stdin pipe: closing it is all the host does with it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)

    async def aclose(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _ReadPipe(_Pipe):
    """The host's end of a child's stdout or stderr pipe, read as an anyio byte stream."""

    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            await anyio.wait_readable(self.fd)
            try:
                data = os.read(self.fd, max_bytes)
            except BlockingIOError:
                continue
            if not data:
                raise anyio.EndOfStream
            return data


async def open_join(spec: dict[str, Any], *, stdin: Any, stdout: Any, stderr: Any) -> Any:
    """Run ``spec`` (from :func:`.sandboxing.join_spec`) through the server, else as ``enter.py`` of its own.

    ``stdin``/``stdout``/``stderr``: a descriptor, ``subprocess.DEVNULL`` or
    ``subprocess.PIPE`` (the result's ``stdin``/``stdout``/``stderr``). Either
    result has ``pid``, ``returncode``, ``wait``, ``kill`` and ``aclose``; its
    pid leads its own session.
    """
    if enabled():
        ours: list[int | None] = [None, None, None]
        theirs: list[int] = []
        served: ServedProcess | None = None
        try:
            for index, wanted in enumerate((stdin, stdout, stderr)):
                if wanted == subprocess.DEVNULL:
                    theirs.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
                elif wanted == subprocess.PIPE:
                    read, write = os.pipe2(os.O_CLOEXEC)
                    ours[index], child = (write, read) if index == 0 else (read, write)
                    theirs.append(child)
                else:
                    theirs.append(os.dup(wanted))
            served = await SERVER.spawn(spec, theirs)
        finally:
            for fd in theirs:
                os.close(fd)
            if served is None:
                for own in ours:
                    if own is not None:
                        os.close(own)
        if served is not None:
            served.stdin = None if ours[0] is None else _Pipe(ours[0])
            served.stdout = None if ours[1] is None else _ReadPipe(ours[1])
            served.stderr = None if ours[2] is None else _ReadPipe(ours[2])
            return served
    return await anyio.open_process(
        enter_argv(spec), stdin=stdin, stdout=stdout, stderr=stderr,
        start_new_session=True, env={}, pass_fds=tuple(spec["ns"].values()),
    )  # fmt: skip
