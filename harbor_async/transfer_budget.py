"""The bounds of one file transfer out of a sandbox: bytes (apparent sizes), entries, depth, cancellation.

Shared by every backend whose transfers this project does itself (the local
backend's ``openat2`` copies, the docker backend's ``docker cp`` streams).
"""

from __future__ import annotations

from collections.abc import Callable

from harbor_async.errors import TransferLimitError

#: A folder deeper than this, or with more entries, is refused (a tar bomb of the sandbox's).
MAX_DEPTH = 64
MAX_ENTRIES = 100_000


class Budget:
    """Bytes a transfer may still move, and a check called between chunks (cancellation)."""

    def __init__(self, limit: int | None, shown: str, checkpoint: Callable[[], None] = lambda: None) -> None:
        self.limit, self.left, self.shown, self.checkpoint = limit, limit, shown, checkpoint
        self.entries = 0

    def take(self, size: int) -> None:
        """Reserve ``size`` bytes (an apparent size, before any is copied).

        Raises:
            TransferLimitError: past the limit.
        """
        if self.left is not None:
            if size > self.left:
                raise TransferLimitError(self.shown, self.limit or 0)
            self.left -= size

    def entry(self) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise TransferLimitError(self.shown, self.limit or 0, f"more than {MAX_ENTRIES} entries")
        self.checkpoint()
