"""The cluster's errors: typed, so callers tell a cap problem from a missing cluster."""

from __future__ import annotations

from collections.abc import Mapping

from harbor_async.core.errors import HarborAsyncError


class ClusterError(HarborAsyncError):
    """Base of every error of :mod:`harbor_async.cluster`."""


class RayNotInstalledError(ClusterError, ImportError):
    """``budget="ray"`` or ``--ray`` without the ``ray`` extra installed."""

    def __init__(self) -> None:
        super().__init__("Ray is not installed: install the extra, e.g. pip install 'harbor-async[ray]'")


class ClusterUnavailableError(ClusterError, ConnectionError):
    """No Ray cluster answers at the given address."""

    def __init__(self, address: str | None, detail: str) -> None:
        self.address = address
        where = address or "auto (RAY_ADDRESS or the local cluster)"
        super().__init__(f"cannot reach a Ray cluster at {where}: {detail}")


class ClusterBudgetConfigError(ClusterError, ValueError):
    """The budget actor exists with other caps than this process asks for, or has no cap at all."""


class BatchExceedsCapError(ClusterError, ValueError):
    """A batch lease can never be granted: the batch alone is larger than the cluster cap.

    Leases are per batch (all or nothing), so a batch below the cap waits for
    its turn and never deadlocks; a batch above it would wait forever, so it is
    refused at once. ``batches`` are the batch sizes of the holders the actor
    knows (holder id -> slots).
    """

    def __init__(self, cap: int, batch: int, batches: Mapping[str, int] | None = None) -> None:
        self.cap, self.batch, self.batches = cap, batch, dict(batches or {})
        others = ", ".join(f"{holder}: {n}" for holder, n in self.batches.items()) or "none"
        super().__init__(
            f"a batch of {batch} live sandboxes can never fit the cluster cap of {cap} "
            f"(batches leased per holder now: {others}); lower the batch (max_live_sandboxes per "
            f"process) to at most {cap} or raise the cluster cap (--max-live / cluster_max_live)"
        )


class LeaseExpiredError(ClusterError):
    """This holder missed its heartbeats for longer than the lease timeout; its leases were taken back."""


class WorldExceedsCapError(BatchExceedsCapError):
    """The ranks of one distributed run need more live sandboxes at once than the cluster cap.

    Ranks of one torch.distributed/accelerate world meet in collectives
    between the start of a batch and its reward, so they cannot take turns:
    every rank's batch must be live at the same time. Refused when the engines
    open, on every rank, instead of hanging in the first step.
    """

    def __init__(self, cap: int, batch: int, batches: Mapping[str, int] | None = None) -> None:
        ClusterError.__init__(self)
        self.cap, self.batch, self.batches = cap, batch, dict(batches or {})
        per_rank = ", ".join(f"{holder}: {n}" for holder, n in self.batches.items())
        self.args = (
            f"the {len(self.batches)} ranks of this distributed run need {batch} live sandboxes at once "
            f"({per_rank}), above the cluster cap of {cap}; ranks meet in collectives between a batch's "
            f"start and its reward, so they cannot take turns: lower max_live_sandboxes per rank or raise "
            f"the cluster cap (cluster_max_live / --max-live) to at least {batch}",
        )


class WorldRendezvousError(ClusterError):
    """Not every rank of the distributed run joined the cluster budget in time."""


class WorkerClosedError(ClusterError):
    """An episode sent to a cluster worker after its ``close()``: its engine is gone, and a new one would outlive it."""
