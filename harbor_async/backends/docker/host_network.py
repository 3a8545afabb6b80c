"""A docker sandbox cannot reach this host's own addresses unless the user asks (``--ek host_access=true``).

A container on a Compose project's bridge network reaches the host at the
bridge's gateway address, and through it every address of the host: a model
server listening on ``0.0.0.0``, ``harbor-async view``, anything bound to the
host's interfaces. Docker's own iptables rules separate networks from each
other, not containers from their host, and a daemon run with
``--iptables=false`` (this project's CI daemon) has none at all; so the
mechanism here uses no firewall rule.

Where the daemon does not forward IPv4 (``docker info``'s ``IPv4Forwarding``
false: no NAT, its containers reach no network beyond the host anyway), the
project's ``default`` network is created with Docker's bridge option
``com.docker.network.bridge.inhibit_ipv4``: the host's side of the bridge has
no address, so nothing in the sandbox can address the host, neither the
gateway nor, through it, any other address of the host (``No route to
host``), while the task's services still reach each other on the bridge.

Where the daemon forwards (the internet reachable through the host's NAT), no
bridge option keeps the host out and the internet in: the overlay is not
applied (an installed agent that downloads itself must still work), the host
stays reachable, and ``harbor-async doctor -b docker`` says so; an ``INPUT``
rule dropping the bridges' traffic (``iptables -I INPUT -i br-+ -j DROP``) is
the user's to add. A task's own networks (named in its compose file) are its
own and are left as written.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

#: Docker's bridge driver option that leaves the host's side of the bridge without an IPv4 address.
INHIBIT_IPV4 = "com.docker.network.bridge.inhibit_ipv4"
#: Seconds ``docker info`` may take.
DOCKER_TIMEOUT = 30.0
_FORWARDS: dict[tuple[str, str], bool] = {}
_LOCK = threading.Lock()


def _endpoint() -> tuple[str, str]:
    return os.environ.get("DOCKER_HOST", ""), os.environ.get("DOCKER_CONTEXT", "")


def daemon_forwards() -> bool | None:
    """Whether the daemon forwards IPv4 (its containers reach other networks through the host), asked once per endpoint.

    Blocking (``docker info``): call it from a worker thread. ``None``: the
    daemon could not be asked (asked again next time).
    """
    with _LOCK:
        known = _FORWARDS.get(_endpoint())
        if known is not None:
            return known
        try:
            found = subprocess.run(
                ["docker", "info", "--format", "{{json .IPv4Forwarding}}"],
                capture_output=True, text=True, timeout=DOCKER_TIMEOUT,
            )  # fmt: skip
            value = json.loads(found.stdout) if found.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
            value = None
        if not isinstance(value, bool):
            return None
        _FORWARDS[_endpoint()] = value
        return value


def isolation_overlay(folder: Path) -> Path:
    """Write a Compose file whose ``default`` network leaves the host without an address on it; return its path."""
    path = folder / "harbor-async-network.json"
    path.write_text(json.dumps({"networks": {"default": {"driver_opts": {INHIBIT_IPV4: "true"}}}}))
    return path


def describe(forwards: bool | None) -> tuple[bool, str]:
    """(whether sandboxes are kept off the host, what ``doctor`` says) for a daemon that forwards or not."""
    if forwards is None:
        return False, "the daemon could not be asked whether it forwards IPv4"
    if not forwards:
        return True, (
            "sandboxes cannot reach this host's addresses: the daemon forwards no IPv4, so each sandbox's "
            "default network leaves the host without an address on it (--ek host_access=true: reachable)"
        )
    return False, (
        "sandboxes CAN reach this host's addresses: the daemon forwards IPv4 (NAT to the internet), which a "
        "bridge without a host address would cut; add a firewall rule (iptables -I INPUT -i br-+ -j DROP)"
    )
