"""The bounds of one file transfer out of a sandbox: bytes (apparent sizes), entries, depth, cancellation.

Shared by every backend whose transfers this project does itself (the local
backend's ``openat2`` copies, the docker backend's ``docker cp`` streams). A
download's budget also charges its episode's and job's disk bounds
(:mod:`harbor_async.verification.disk_bounds`), the ``host`` it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from harbor_async.core.errors import TransferLimitError

if TYPE_CHECKING:
    from harbor_async.verification.disk_bounds import EpisodeDiskBound

#: A folder deeper than this, or with more entries, is refused (a tar bomb of the sandbox's).
MAX_DEPTH = 64
MAX_ENTRIES = 100_000


class Budget:
    """Bytes a transfer may still move, and a check called between chunks (cancellation)."""

    def __init__(
        self,
        limit: int | None,
        shown: str,
        checkpoint: Callable[[], None] = lambda: None,
        host: EpisodeDiskBound | None = None,
    ) -> None:
        self.limit, self.left, self.shown, self.checkpoint = limit, limit, shown, checkpoint
        self.host = host  # the episode's disk bound (a download's; never an upload's)
        self.entries = 0

    def take(self, size: int) -> None:
        """Reserve ``size`` bytes (an apparent size, before any is copied).

        Raises:
            TransferLimitError: past the limit (an ``EpisodeDiskLimitError`` past the episode's).
            JobDiskLimitError: past the job's bound.
        """
        if self.left is not None:
            if size > self.left:
                raise TransferLimitError(self.shown, self.limit or 0)
            self.left -= size
        if self.host is not None:
            self.host.charge(size, self.shown)

    def entry(self) -> None:
        self.entries += 1
        if self.entries > MAX_ENTRIES:
            raise TransferLimitError(self.shown, self.limit or 0, f"more than {MAX_ENTRIES} entries")
        self.checkpoint()
