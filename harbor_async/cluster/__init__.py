"""Past one machine: one sandbox budget across ranks and nodes, and episodes fanned out over Ray.

Nothing here imports Ray at module import time; Ray is the optional extra
``harbor-async[ray]``. The parts:

- :mod:`~harbor_async.cluster.budget_actor`: the named, detached actor holding
  the cluster-wide caps and the ledger of live sandboxes;
- :mod:`~harbor_async.cluster.ray_budget`: :class:`RayBudget`, a
  :class:`~harbor_async.engine.budget.Budget` that leases from that actor;
- :mod:`~harbor_async.cluster.ranks`: process-local limits divided by the
  world size of a torch.distributed/accelerate launch (no Ray needed);
- :mod:`~harbor_async.cluster.sharding`: episodes sharded over one engine per
  node, records streamed back to the driver's job folder.

Imports: core, models, tasks, engine, jobs, episodes, harnesses, agents.
"""

from harbor_async.cluster.errors import (
    BatchExceedsCapError,
    ClusterBudgetConfigError,
    ClusterError,
    ClusterUnavailableError,
    LeaseExpiredError,
    RayNotInstalledError,
    WorkerClosedError,
    WorldExceedsCapError,
    WorldRendezvousError,
)

__all__ = [
    "BatchExceedsCapError",
    "ClusterBudgetConfigError",
    "ClusterError",
    "ClusterUnavailableError",
    "LeaseExpiredError",
    "RayNotInstalledError",
    "WorkerClosedError",
    "WorldExceedsCapError",
    "WorldRendezvousError",
]
