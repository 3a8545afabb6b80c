"""A docker sandbox cannot reach this host's own addresses unless the user asks (issue 44, item 8).

The attack is an oracle solution a model could write: it connects to a
listener of the host's (as a model server on ``0.0.0.0`` is), at the bridge's
gateway and at each of the host's own addresses, and writes what it reached;
the test gives 1 only when it reached nothing. With ``--ek host_access=true``
the same probe reaches the host (the listener counts its connections), so
the probe is a real one. The task's two services still reach each other.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import psutil
import pytest

from tests.cli_helpers import TASK_TOML, harbor_async, records

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("docker_daemon")]

TOML = TASK_TOML
COMPOSE = """services:
  peer:
    image: debian:bookworm-slim
    command: ["sleep", "infinity"]
"""
# The gateway from the routing table; each address: "reached", else bash's own error (no route, refused, timeout).
PROBE = """#!/bin/bash
gw=$(awk '$2 == "00000000" {print $3; exit}' /proc/net/route)
gwip=$(printf '%d.%d.%d.%d' 0x${gw:6:2} 0x${gw:4:2} 0x${gw:2:2} 0x${gw:0:2})
mkdir -p /app
echo "gateway $gwip" > /app/probe.txt
for addr in $gwip {addresses}; do
  if timeout 3 bash -c "exec 3<>/dev/tcp/$addr/{port}" 2>/dev/null; then echo "reached $addr" >> /app/probe.txt; fi
done
timeout 3 bash -c 'exec 3<>/dev/tcp/peer/9' 2>> /app/peer.txt; true
"""
TEST = """#!/bin/bash
cat /app/probe.txt /app/peer.txt
peer_ok() { [ ! -e /tests/peer ] || grep -q refused /app/peer.txt; }  # a task with a peer service reaches it
if grep -q '^gateway [0-9]' /app/probe.txt && ! grep -q '^reached' /app/probe.txt && peer_ok; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


class Listener:
    """A TCP listener on all of the host's addresses, counting the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def host_addresses() -> list[str]:
    """Every IPv4 address of this host but loopback's."""
    found = []
    for addresses in psutil.net_if_addrs().values():
        found += [a.address for a in addresses if a.family == socket.AF_INET and not a.address.startswith("127.")]
    return found


def make_task(root: Path, port: int, peer: bool) -> Path:
    task = root / "tasks" / "reach-host"
    for folder in ("environment", "solution", "tests"):
        (task / folder).mkdir(parents=True)
    (task / "task.toml").write_text(TOML)
    (task / "instruction.md").write_text("Reach nothing.\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    if peer:  # two services (Harbor's start); else one (the fast start)
        (task / "environment" / "docker-compose.yaml").write_text(COMPOSE)
        (task / "tests" / "peer").write_text("")
    probe = PROBE.replace("{addresses}", " ".join(host_addresses())).replace("{port}", str(port))
    (task / "solution" / "solve.sh").write_text(probe)
    (task / "tests" / "test.sh").write_text(TEST)
    return root


@pytest.mark.parametrize("peer", [False, True], ids=["one-service", "with-a-peer"])
def test_a_docker_sandbox_reaches_no_address_of_the_host_unless_asked(tmp_path: Path, peer: bool) -> None:
    listener = Listener()
    try:
        suite = make_task(tmp_path / "suite", listener.port, peer)
        jobs = tmp_path / "jobs"
        kept_off = harbor_async("run", "-p", str(suite), "-e", "docker", "-o", str(jobs), "--job-name", "off", timeout=600)
        assert kept_off.returncode == 0, kept_off.stderr[-3000:]
        (record,) = records(jobs / "off")
        assert record["reward"] == 1.0, record["verifier_output"]
        assert listener.accepted == 0
        allowed = harbor_async(
            "run", "-p", str(suite), "-e", "docker", "--ek", "host_access=true", "-o", str(jobs), "--job-name", "on",
            timeout=600,
        )  # fmt: skip
        assert allowed.returncode == 0, allowed.stderr[-3000:]
        (record,) = records(jobs / "on")
        assert record["reward"] == 0.0 and "reached" in (record["verifier_output"] or ""), record["verifier_output"]
        assert listener.accepted >= 1
    finally:
        listener.close()


def test_doctor_says_whether_sandboxes_are_kept_off_the_host() -> None:
    from harbor_async.backends.docker.host_network import daemon_forwards

    done = " ".join(harbor_async("doctor", "-b", "docker").stdout.split())
    if daemon_forwards():  # a daemon with NAT: said plainly, not hidden
        assert "docker host network: sandboxes CAN reach this host's addresses" in done, done
    else:  # this project's CI daemon
        assert "ok docker host network: sandboxes cannot reach this host's addresses" in done, done
