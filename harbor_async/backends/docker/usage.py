"""A docker sandbox's resource use: its cgroup's counters where the daemon is on this machine, else the daemon's stats.

Where the daemon runs on this machine (``DOCKER_HOST`` unset or a unix socket)
and the main container's cgroup can be read (the cgroupfs or systemd driver,
v1 or v2), its counters are read as the local backend reads its own: CPU time
(``cpuacct.usage`` or ``cpu.stat``), peak memory (``memory.max_usage_in_bytes``
or ``memory.peak``) and ``pids.peak``. Elsewhere one ``GET
/containers/{id}/stats?stream=false&one-shot=true`` gives the CPU time and
(on a cgroup v1 host) the peak memory; no process peak. The daemon's stats
call took about 450 ms per container here while other containers started and
stopped (5 ms idle), against well under a millisecond for the files: the
files come first. Either way one ``GET /containers/{id}/json?size=1`` gives the
writable layer's apparent size (``SizeRw``: what the sandbox wrote). Every
call runs in a worker thread, over one connection pool per process.

The daemon is reached at ``DOCKER_HOST`` (a unix socket, the default one, or
plain ``tcp://``); behind TLS, ssh or a ``DOCKER_CONTEXT`` nothing is read and
the record says so (no ``source``). A task's other Compose services
(:func:`side_services`: the project's running containers but ``main``) are
measured the same way and added (:meth:`ResourceUsage.beside`): their CPU
time and disk add up, and so do their peaks, an upper bound.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from harbor_async.backends.docker.cleanup import docker_is_local
from harbor_async.core.usage import ResourceUsage, counter, counter_field

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


def container_usage(container: str, *, disk: bool = True) -> ResourceUsage | None:
    """What ``container`` used since it last started (blocking: a worker thread's); ``None``: the daemon cannot be asked.

    ``disk=False``: not its writable layer's size (the daemon walks the layer for it), for a reading whose
    disk figure a later one replaces (before a strict verify's restart, which keeps the files).

    Raises:
        httpx.HTTPError: the daemon did not answer, or answered an error.
    """
    client = _client()
    if client is None:
        return None
    written = None
    if disk:
        inspect = client.get(f"/containers/{container}/json", params={"size": "1"})
        inspect.raise_for_status()
        size = inspect.json().get("SizeRw")
        written = size if isinstance(size, int) else None
    local = cgroup_usage(container)
    if local is not None:
        return replace(local, disk_written_bytes=written)
    stats = client.get(f"/containers/{container}/stats", params={"stream": "false", "one-shot": "true"})
    stats.raise_for_status()
    answer: dict[str, Any] = stats.json()
    total = (answer.get("cpu_stats") or {}).get("cpu_usage", {}).get("total_usage")
    return ResourceUsage(
        cpu_seconds=None if total is None else total / 1e9,
        memory_peak_bytes=(answer.get("memory_stats") or {}).get("max_usage"),
        disk_written_bytes=written,
        source="docker daemon",
    )


def side_services(project: str) -> list[str]:
    """The running containers of Compose project ``project`` other than its ``main`` service (blocking; ``[]``:
    the daemon cannot be asked plainly).

    Raises:
        httpx.HTTPError: the daemon did not answer, or answered an error.
    """
    client = _client()
    if client is None:
        return []
    listed = client.get("/containers/json", params={"filters": json.dumps({"label": [f"com.docker.compose.project={project}"]})})
    listed.raise_for_status()
    return [
        row["Id"] for row in listed.json()
        if (row.get("Labels") or {}).get("com.docker.compose.service") != "main"
    ]  # fmt: skip


def cgroup_usage(container: str) -> ResourceUsage | None:
    """``container``'s counters from its cgroup on this machine (``None``: the daemon is elsewhere, or none is readable)."""
    if not docker_is_local():
        return None
    v1 = {name: _first(_CGROUP / name / "docker" / container, _CGROUP / name / "system.slice" / f"docker-{container}.scope")
          for name in ("cpuacct", "memory", "pids")}  # fmt: skip
    if v1["cpuacct"] is not None:
        nanoseconds = counter(v1["cpuacct"] / "cpuacct.usage")
        return ResourceUsage(
            cpu_seconds=None if nanoseconds is None else nanoseconds / 1e9,
            memory_peak_bytes=counter(v1["memory"] / "memory.max_usage_in_bytes") if v1["memory"] else None,
            processes_peak=counter(v1["pids"] / "pids.peak") if v1["pids"] else None,
            source="docker cgroup v1",
        )
    v2 = _first(_CGROUP / "docker" / container, _CGROUP / "system.slice" / f"docker-{container}.scope")
    if v2 is None:
        return None
    microseconds = counter_field(v2 / "cpu.stat", "usage_usec")
    return ResourceUsage(
        cpu_seconds=None if microseconds is None else microseconds / 1e6,
        memory_peak_bytes=counter(v2 / "memory.peak"),
        processes_peak=counter(v2 / "pids.peak"),
        source="docker cgroup v2",
    )


def _first(*folders: Path) -> Path | None:
    return next((folder for folder in folders if folder.is_dir()), None)
