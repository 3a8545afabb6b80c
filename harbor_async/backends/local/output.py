"""Output capture of an exec: pipes read without blocking the loop, and a sink for what outlives its exec."""

from __future__ import annotations

import os
import select
import threading
import time

import anyio

from harbor_async.backends.local.layout import OUTPUT_SETTLE_SEC
from harbor_async.core.bounded_output import HeadTail


class OutputPipe:
    """One output pipe of an exec, read without blocking the loop, kept within ``limit`` bytes.

    The head and tail of what it carries are kept (:class:`~harbor_async.core.bounded_output.HeadTail`),
    so the caller's memory stays flat however much a command prints. ``limit=None`` keeps everything.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.kept = HeadTail(limit)
        self.eof = False

    @property
    def chunks(self) -> list[bytes]:
        """The head kept so far (everything, when unlimited)."""
        return self.kept.head

    @property
    def dropped(self) -> int:
        return self.kept.dropped

    async def pump(self) -> None:
        while not self.eof:
            if not self._read_some():
                await anyio.wait_readable(self.read_fd)

    def _read_some(self) -> bool:
        """Read what the pipe holds now; False when it holds nothing yet."""
        try:
            data = os.read(self.read_fd, 65536)
        except BlockingIOError:
            return False
        if data:
            self.kept.keep(data)
        else:
            self.eof = True
        return True

    def settle(self) -> None:
        """Read what is already in the pipe (all the ended shell wrote), briefly."""
        deadline = time.monotonic() + OUTPUT_SETTLE_SEC
        while not self.eof and time.monotonic() < deadline and self._read_some():
            pass

    def data(self) -> bytes:
        """Head, a note of what was dropped (if anything), tail."""
        return self.kept.data()

    def text(self) -> str | None:
        return self.kept.text()

    def close_write_end(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def close(self) -> None:
        self.close_write_end()
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1


class OutputSink:
    """Reads and discards what background processes write to the pipes of execs that returned.

    Closing those pipes would kill such a process with SIGPIPE at its next
    write; not reading them would block it once 64 KiB are buffered. One
    daemon thread serves every sandbox and exits when it has no pipe left; a
    pipe is closed at its EOF, when its last writer ends (at the latest when
    its sandbox stops and the PID namespace dies), or when its sandbox drops
    it (each sandbox keeps at most :data:`MAX_ADOPTED` such pipes open).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[int, object]] = []
        self._dropped: list[tuple[int, object]] = []
        self._owner: dict[int, object] = {}  # watched fd -> the token adopt() gave for it
        self._thread: threading.Thread | None = None
        self._wake_read = self._wake_write = -1

    def adopt(self, fds: list[int]) -> list[tuple[int, object]]:
        """Take over ``fds``; returns a handle for each, for :meth:`drop`."""
        handles = [(fd, object()) for fd in fds]
        if not handles:
            return handles
        with self._lock:
            self._pending.extend(handles)
            if self._thread is None:
                self._wake_read, self._wake_write = os.pipe()
                self._thread = threading.Thread(target=self._run, name="harbor-async-output-sink", daemon=True)
                self._thread.start()
            else:
                os.write(self._wake_write, b"\0")
        return handles

    def drop(self, handles: list[tuple[int, object]]) -> None:
        """Close these pipes now if still open (a writer then gets SIGPIPE); a reused fd number is never closed."""
        with self._lock:
            if self._thread is None:
                return
            self._dropped.extend(handles)
            os.write(self._wake_write, b"\0")

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_read, select.POLLIN)
        while True:
            with self._lock:
                for fd, token in self._pending:
                    poller.register(fd, select.POLLIN)
                    self._owner[fd] = token
                self._pending.clear()
                for fd, token in self._dropped:
                    if self._owner.get(fd) is token:
                        poller.unregister(fd)
                        del self._owner[fd]
                        os.close(fd)
                self._dropped.clear()
                if not self._owner:  # nothing left: end (adopt() starts a new thread)
                    os.close(self._wake_read)
                    os.close(self._wake_write)
                    self._thread = None
                    return
            for fd, _events in poller.poll():
                if fd == self._wake_read:
                    os.read(fd, 4096)
                    continue
                if fd not in self._owner:
                    continue
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    with self._lock:
                        poller.unregister(fd)
                        del self._owner[fd]
                        os.close(fd)


#: Pipes of returned execs one sandbox may keep open (its background writers); older ones are closed.
MAX_ADOPTED = 32
OUTPUT_SINK = OutputSink()


def read_available(fd: int) -> bytes:
    """What a pipe holds now, without waiting (bwrap wrote its info before the init ran)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)
