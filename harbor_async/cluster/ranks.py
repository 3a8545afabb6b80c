"""Rank awareness without Ray: process-local limits divided by the world size of a distributed launch.

``torchrun`` and ``accelerate launch`` start one process per rank and set
``WORLD_SIZE`` and ``RANK`` in each. Every rank has its own engine and
limits, so ``max_live_sandboxes=64`` on 8 ranks means 512 live sandboxes.
Opt in (``HarborSpec(..., per_rank_limits=True)``, ``--per-rank-limits``) and
each rank gets its share: the live cap and the exec cap divided by the world
size (rounded down, at least 1), the create rate divided exactly. It is a
static split (a rank cannot lend unused slots to another); for one shared
pool use the cluster budget (``budget="ray"``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from harbor_async.core.policy import Limits


@dataclass(frozen=True)
class World:
    """This process's rank and the number of ranks (1 and 0 outside a distributed launch)."""

    rank: int = 0
    size: int = 1


def current_world() -> World:
    """The launch's world: ``WORLD_SIZE``/``RANK`` (torchrun, accelerate), else torch.distributed if
    initialised, else a world of one."""
    size, rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    if size is not None:
        try:
            return World(rank=int(rank or 0), size=max(1, int(size)))
        except ValueError:
            pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return World(rank=dist.get_rank(), size=dist.get_world_size())
    except ImportError:
        pass
    return World()


def divide_limits(limits: Limits, world_size: int | None = None) -> Limits:
    """``limits`` split evenly over the ranks (``None``: the current world's size); unlimited stays unlimited."""
    size = world_size if world_size is not None else current_world().size
    if size <= 1:
        return limits

    def share(value: int | None) -> int | None:
        return None if value is None else max(1, value // size)

    return replace(
        limits,
        live_sandboxes=share(limits.live_sandboxes),
        concurrent_execs=share(limits.concurrent_execs),
        creates_per_second=None if limits.creates_per_second is None else limits.creates_per_second / size,
    )
