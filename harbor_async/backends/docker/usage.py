"""A docker sandbox's resource use, asked of the daemon: its stats and its writable layer's size.

One ``GET /containers/{id}/stats?stream=false&one-shot=true`` gives the main
container's CPU time and (on a cgroup v1 host) its peak memory, and one
``GET /containers/{id}/json?size=1`` its writable layer's apparent size
(``SizeRw``: what the sandbox wrote). Where the daemon is on this machine and
the container's cgroup can be read, ``pids.peak`` gives its most processes at
once, and ``memory.peak`` its peak memory where the daemon reports none (cgroup
v2). Both calls run in a worker thread, over one connection pool per process.

The daemon is reached at ``DOCKER_HOST`` (a unix socket, the default one, or
plain ``tcp://``); behind TLS, ssh or a ``DOCKER_CONTEXT`` nothing is read and
the record says so (no ``source``). Only the main container is measured: a
task's other Compose services are not.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import httpx

from harbor_async.core.usage import ResourceUsage

#: Seconds one call to the daemon may take.
DAEMON_TIMEOUT = 10.0
DEFAULT_SOCKET = "/var/run/docker.sock"
_CGROUP = Path("/sys/fs/cgroup")
_clients: dict[tuple[str, str], httpx.Client] = {}
_lock = threading.Lock()


def _client() -> httpx.Client | None:
    """The daemon's HTTP client for this process's endpoint (``None``: not one we can reach plainly)."""
    host, context = os.environ.get("DOCKER_HOST", ""), os.environ.get("DOCKER_CONTEXT", "")
    if context or (host.startswith("tcp://") and os.environ.get("DOCKER_TLS_VERIFY")):
        return None
    with _lock:
        client = _clients.get((host, context))
        if client is None:
            if not host or host.startswith("unix://"):
                socket = host.removeprefix("unix://") or DEFAULT_SOCKET
                transport, base = httpx.HTTPTransport(uds=socket), "http://docker"
            elif host.startswith("tcp://"):
                transport, base = httpx.HTTPTransport(), "http://" + host.removeprefix("tcp://")
            else:
                return None
            client = _clients[(host, context)] = httpx.Client(transport=transport, base_url=base, timeout=DAEMON_TIMEOUT)
    return client


def container_usage(container: str) -> ResourceUsage | None:
    """What ``container`` used since it last started (blocking: a worker thread's); ``None``: the daemon cannot be asked.

    Raises:
        httpx.HTTPError: the daemon did not answer, or answered an error.
    """
    client = _client()
    if client is None:
        return None
    stats = client.get(f"/containers/{container}/stats", params={"stream": "false", "one-shot": "true"})
    stats.raise_for_status()
    inspect = client.get(f"/containers/{container}/json", params={"size": "1"})
    inspect.raise_for_status()
    answer: dict[str, Any] = stats.json()
    total = (answer.get("cpu_stats") or {}).get("cpu_usage", {}).get("total_usage")
    memory = (answer.get("memory_stats") or {}).get("max_usage") or _cgroup_number(container, "memory", "memory.peak")
    size = inspect.json().get("SizeRw")
    return ResourceUsage(
        cpu_seconds=None if total is None else total / 1e9,
        memory_peak_bytes=memory,
        disk_written_bytes=size if isinstance(size, int) else None,
        processes_peak=_cgroup_number(container, "pids", "pids.peak"),
        source="docker daemon",
    )


def _cgroup_number(container: str, controller: str, name: str) -> int | None:
    """A counter of ``container``'s cgroup, where the daemon is on this machine (cgroupfs or systemd driver, v1 or v2)."""
    host = os.environ.get("DOCKER_HOST", "")
    if host and not host.startswith("unix://"):
        return None
    for folder in (
        _CGROUP / controller / "docker" / container,
        _CGROUP / controller / "system.slice" / f"docker-{container}.scope",
        _CGROUP / "docker" / container,
        _CGROUP / "system.slice" / f"docker-{container}.scope",
    ):
        try:
            return int((folder / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None
