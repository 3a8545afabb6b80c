"""Task resources no larger than this host can give (local and docker backends).

A ``task.toml`` may ask for more than the machine has (``cpus = 1e5``,
``memory_mb = 1e8``): Docker refuses such a container, and a cgroup or tmpfs
written with the number as it is limits nothing. Both backends run on this
host, so the values are lowered to the host's CPUs and memory, with one
warning per task and value (cloud backends keep them: their hosts are not this one).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import psutil

from harbor_async.core.logs import get_logger
from harbor_async.core.printing import escape_controls

log = get_logger(__name__)
_warned: set[tuple[str, str, float]] = set()


def host_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache  # a start reads it on the loop; the host's memory does not change under a run
def host_memory_mb() -> int:
    """This host's memory in MB."""
    return int(psutil.virtual_memory().total // 2**20)


def cap(name: str, value: float | None, most: float, task: str) -> Any:
    """``value`` no larger than ``most`` (``None`` stays ``None``); a warning the first time it is lowered."""
    if value is None or value <= most:
        return value
    key = (task, name, float(value))
    if key not in _warned:
        _warned.add(key)
        log.warning(
            "task resource above this host's; lowered", task=escape_controls(task), resource=name, asked=value, host=most
        )
    return type(value)(most)


def capped_environment_config(config: Any, task: str) -> Any:
    """A copy of Harbor's ``EnvironmentConfig`` with ``cpus``, ``memory_mb`` and ``storage_mb`` capped to this host."""
    memory = host_memory_mb()
    update = {
        "cpus": cap("cpus", config.cpus, host_cpus(), task),
        "memory_mb": cap("memory_mb", config.memory_mb, memory, task),
        "storage_mb": cap("storage_mb", config.storage_mb, memory, task),  # a tmpfs lives in memory
    }
    changed = {k: v for k, v in update.items() if v != getattr(config, k)}
    return config.model_copy(update=changed) if changed else config
