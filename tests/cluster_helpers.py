"""A real Ray cluster on this machine for the cluster tests: a head and worker nodes, stopped at teardown.

Each node is a ``ray start --block`` process in its own session, so that
teardown ends exactly the processes this test run started (by process group,
then any straggler whose command line names this cluster's folder).
"""

from __future__ import annotations

import json
import os

# Before anything imports Ray: under `uv run`, Ray would otherwise re-run every
# worker with `uv run` in a copy of the working folder (see harbor_async.cluster.connect).
os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
# A test cluster on 127.0.0.1 that does not depend on (or write) a token in ~/.ray.
os.environ["RAY_AUTH_MODE"] = "disabled"
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every process of the cluster and of the test's child processes."""
    env = dict(os.environ)
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"  # workers run this interpreter, not `uv run`
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


class RayCluster:
    """A head node and ``workers`` worker nodes on 127.0.0.1, each with one CPU and a resource ``node<i>``."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        # Ray's socket paths must stay short: a folder straight under /tmp.
        self.temp_dir = tempfile.mkdtemp(prefix="hara-", dir="/tmp")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []

    def _start_node(self, index: int) -> None:
        common = [
            "--block",
            "--num-cpus=1",
            "--disable-usage-stats",
            f"--resources={json.dumps({f'node{index}': 1})}",
            "--node-ip-address=127.0.0.1",
        ]
        if index == 0:
            args = ["--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
        else:
            args = [f"--address={self.address}"]
        log = open(Path(self.temp_dir) / f"node{index}.log", "w")  # noqa: SIM115 - closed with the process
        self.nodes.append(
            subprocess.Popen(
                [RAY, "start", *args, *common],
                env=child_env(TMPDIR=self.temp_dir),  # what a killed worker leaves stays in the cluster's folder
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def start(self, timeout: float = 180.0) -> RayCluster:
        """Start the head, then the workers; return once every node is alive (or stop what started)."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> RayCluster:
        import ray

        self._start_node(0)
        deadline = time.monotonic() + timeout
        while True:  # the head must answer before workers can join
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or self.nodes[0].poll() is not None:
                    self.stop()
                    raise RuntimeError(f"the Ray head did not start: {self.log(0)}") from None
                time.sleep(0.5)
        for index in range(1, self.workers + 1):
            self._start_node(index)
        ray.init(address=self.address, namespace="harbor-async-tests", log_to_driver=False, logging_level="WARNING")
        while len([n for n in ray.nodes() if n["Alive"]]) < self.workers + 1:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the Ray worker nodes did not join in time")
            time.sleep(0.5)
        return self

    def log(self, index: int) -> str:
        try:
            return (Path(self.temp_dir) / f"node{index}.log").read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Disconnect, end every node's process group, then any process still naming this cluster's folder."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for proc in reversed(self.nodes):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.nodes:
            try:
                proc.wait(timeout=4)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(self.temp_dir in part for part in proc.info["cmdline"] or []):
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        import shutil

        shutil.rmtree(self.temp_dir, ignore_errors=True)


def connect(cluster: RayCluster) -> None:
    """Connect this process to ``cluster`` (again), as :meth:`RayCluster.start` does."""
    import ray

    if not ray.is_initialized():
        ray.init(address=cluster.address, namespace="harbor-async-tests", log_to_driver=False, logging_level="WARNING")


def clean_up_after_a_test() -> None:
    """What one test may leave on the shared cluster for the next: the named budget actor (created detached,
    with that test's caps, which a later test asking for other caps would be refused)."""
    import ray

    from harbor_async.cluster.connect import DEFAULT_ACTOR_NAME, DEFAULT_NAMESPACE

    if not ray.is_initialized():
        return
    try:
        ray.kill(ray.get_actor(DEFAULT_ACTOR_NAME, namespace=DEFAULT_NAMESPACE))
    except ValueError:  # none was created
        pass
