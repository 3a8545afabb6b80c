"""Command output kept within a byte limit: its head and its tail, the middle counted and dropped.

Shared by every backend this project drives directly (the local backend's
exec pipes, Harbor's docker exec), so that a command printing without end
costs the host a bounded amount of memory.
"""

from __future__ import annotations

import collections


class HeadTail:
    """The first ``limit // 2`` bytes as they come and a sliding window of the last ``limit // 2``.

    What falls between is counted in :attr:`dropped`, never held. ``limit=None`` keeps everything.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.head: list[bytes] = []  # everything when unlimited
        self._head_left = limit // 2 if limit is not None else None
        self._tail_limit = limit - limit // 2 if limit is not None else 0
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_size = 0
        self.dropped = 0

    def keep(self, data: bytes) -> None:
        """Take the next bytes of the stream."""
        if self._head_left is None:
            self.head.append(data)
            return
        if self._head_left > 0:
            head, data = data[: self._head_left], data[self._head_left :]
            self.head.append(head)
            self._head_left -= len(head)
        if not data:
            return
        self._tail.append(data)
        self._tail_size += len(data)
        while self._tail_size > self._tail_limit:  # slide: forget the oldest bytes
            excess = self._tail_size - self._tail_limit
            oldest = self._tail[0]
            if len(oldest) <= excess:
                self._tail.popleft()
                self._tail_size -= len(oldest)
                self.dropped += len(oldest)
            else:
                self._tail[0] = oldest[excess:]
                self._tail_size -= excess
                self.dropped += excess

    def data(self) -> bytes:
        """Head, a note of what was dropped (if anything), tail."""
        middle = f"\n[... {self.dropped} bytes of output dropped ...]\n".encode() if self.dropped else b""
        return b"".join(self.head) + middle + b"".join(self._tail)

    def text(self) -> str | None:
        """:meth:`data` decoded (``None`` when empty, as Harbor's ``ExecResult`` has it)."""
        return self.data().decode(errors="replace") or None
