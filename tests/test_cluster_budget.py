"""The cluster budget on a real Ray cluster (a head and a worker node started here): caps across processes.

Live sandboxes are counted by the backend (marker files of
tests/cluster_backend.py), never by the budget's ledger.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from harbor_async.cluster import BatchExceedsCapError, ray_budget
from harbor_async.cluster.connect import DEFAULT_ACTOR_NAME, DEFAULT_NAMESPACE
from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from tests.cluster_backend import observed_peak
from tests.cluster_helpers import REPO, child_env

pytestmark = pytest.mark.slow  # a real trainer, cluster, daemon, browser or wheel

# Sized for 2 busy cores: a heartbeat every second, a lease lost after 6 s of silence.
LEASE_TIMEOUT = 6.0


@pytest.fixture
def live_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "live"
    folder.mkdir()
    return folder


@pytest.fixture(autouse=True)
def fresh_actor(ray_cluster):
    """Each test creates the budget actor with its own caps; end it afterwards."""
    yield
    import ray

    try:
        ray.kill(ray.get_actor(DEFAULT_ACTOR_NAME, namespace=DEFAULT_NAMESPACE))
    except ValueError:
        pass


def _child(cluster, live: Path, tmp: Path, *args: object, barrier: bool = False, **env_extra: str) -> subprocess.Popen:
    (tmp / "child-tmp").mkdir(exist_ok=True)
    env = child_env(
        HARA_LIVE_DIR=str(live), TMPDIR=str(tmp / "child-tmp"), HARA_BARRIER="1" if barrier else "0", **env_extra
    )
    return subprocess.Popen(
        [sys.executable, "-m", "tests.cluster_child", cluster.address, *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _actor():
    import ray

    return ray, ray.get_actor(DEFAULT_ACTOR_NAME, namespace=DEFAULT_NAMESPACE)


def test_three_processes_never_exceed_the_cluster_cap(ray_cluster, live_dir: Path, tmp_path: Path) -> None:
    procs = [_child(ray_cluster, live_dir, tmp_path, 4, 5, 1.0, LEASE_TIMEOUT) for _ in range(3)]
    results = [_result(p, timeout=240) for p in procs]
    assert [r["errors"] for r in results] == [[], [], []]
    assert [r["started"] for r in results] == [5, 5, 5]
    # 15 sandboxes held 1 s each, demand 12 at once under a cap of 4: the backend never saw more than 4.
    assert 1 < observed_peak(live_dir) <= 4
    ray, actor = _actor()
    stats = ray.get(actor.stats.remote())
    assert stats["live_used"] == 0 and stats["live_peak"] <= 4
    assert ray.get(actor.ledger.remote())["sandboxes"] == []
    # The three processes' starts went through the actor's one start window, and each gave its place back.
    window = ray.get(actor.start_state.remote())
    assert window is not None and window["in_flight"] == 0 and window["window"] <= 4


def test_a_killed_process_loses_its_leases_within_the_heartbeat_timeout(
    ray_cluster,
    live_dir: Path,
    tmp_path: Path,
) -> None:
    holder = _child(ray_cluster, live_dir, tmp_path, 4, 4, 600, LEASE_TIMEOUT)
    for _ in range(4):  # it holds the whole cap
        line = holder.stdout.readline()
        assert line.startswith("started"), holder.stderr.read()[-3000:] if not line else line
    ray, actor = _actor()
    assert ray.get(actor.stats.remote())["live_used"] == 4
    waiter = _child(ray_cluster, live_dir, tmp_path, 4, 2, 0.2, LEASE_TIMEOUT)
    deadline = time.monotonic() + 90
    while ray.get(actor.stats.remote())["live_waiting"] < 1:  # the waiter asks and is made to wait
        assert waiter.poll() is None and time.monotonic() < deadline, waiter.stderr.read()[-3000:]
        time.sleep(0.2)
    killed_at = time.monotonic()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    while any(row["pid"] == holder.pid for row in ray.get(actor.ledger.remote())["sandboxes"]):
        assert time.monotonic() - killed_at < 60, "the killed holder kept its leases"
        time.sleep(0.2)
    released_after = time.monotonic() - killed_at
    # Released once the holder was silent for the timeout (its last beat came shortly before the
    # kill; a stalled beat earlier), within the reaper's period (1 s) plus slack for a busy machine.
    assert LEASE_TIMEOUT / 2 < released_after < LEASE_TIMEOUT + 5
    assert _result(waiter, timeout=120) == {"started": 2, "errors": []}  # the waiter got the slots
    ledger = ray.get(actor.ledger.remote())
    assert ledger["sandboxes"] == []
    assert {row["pid"] for row in ledger["orphans"]} == {holder.pid}  # what the killed rank left behind
    assert len(ledger["orphans"]) == 4

    # The command line reads the same ledger, and reaping clears this host's orphans.
    cli = [sys.executable, "-m", "harbor_async", "sandboxes"]
    listed = subprocess.run(
        [*cli, "list", "--ray", "--ray-address", ray_cluster.address, "--json"],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-2000:]
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [row["state"] for row in rows] == ["orphaned"] * 4 and {row["pid"] for row in rows} == {holder.pid}
    reaped = subprocess.run(
        [*cli, "reap", "--ray", "--ray-address", ray_cluster.address, "--older-than", "1s"],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert reaped.returncode == 0, reaped.stderr[-2000:]
    assert "4 orphans cleared" in reaped.stdout
    assert ray.get(actor.ledger.remote())["orphans"] == []


def test_batches_are_leased_all_or_nothing_so_ranks_take_turns(
    ray_cluster,
    live_dir: Path,
    tmp_path: Path,
) -> None:
    # Two "ranks" each need 3 sandboxes live at once (a barrier); the cap is 4.
    # Per-sandbox leases could leave each with 2 and waiting forever; batch leases make them take turns.
    procs = [_child(ray_cluster, live_dir, tmp_path, 4, 3, 1.0, LEASE_TIMEOUT, 3, barrier=True) for _ in range(2)]
    results = [_result(p, timeout=240) for p in procs]
    assert results == [{"started": 3, "errors": []}] * 2
    assert observed_peak(live_dir) <= 3  # one batch at a time: 3 + 3 > 4, and a split batch would reach 4
    ray, actor = _actor()
    assert ray.get(actor.stats.remote())["live_used"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_batch_above_the_cap_is_refused_naming_cap_and_batch(ray_cluster, anyio_backend) -> None:
    budget = ray_budget.factory(address=ray_cluster.address, max_live=4, batch=6, lease_timeout=LEASE_TIMEOUT)
    with pytest.raises(BatchExceedsCapError) as info:
        async with Engine(limits=Limits(live_sandboxes=None), budget=budget):
            pass
    assert info.value.cap == 4 and info.value.batch == 6
    assert "cluster cap of 4" in str(info.value) and "batch of 6" in str(info.value)


def test_ranks_of_one_run_whose_batches_exceed_the_cap_are_refused_on_every_rank(
    ray_cluster,
    live_dir: Path,
    tmp_path: Path,
) -> None:
    # Two ranks of one torchrun-style world (they would meet in collectives mid-step,
    # so they cannot take turns): batches of 2 + 2 against a cap of 3.
    world = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "t"}
    procs = [
        _child(ray_cluster, live_dir, tmp_path, 3, 2, 0.1, LEASE_TIMEOUT, 2, RANK=str(rank), **world)
        for rank in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode != 0
        assert "WorldExceedsCapError" in err, err[-3000:]
        assert "need 4 live sandboxes at once (rank 0: 2, rank 1: 2), above the cluster cap of 3" in err
    assert list(live_dir.glob("live-*")) == []  # refused before any sandbox started
    ray, actor = _actor()
    assert ray.get(actor.stats.remote())["live_used"] == 0


@pytest.mark.anyio
async def test_an_engine_under_either_loop_keeps_the_cap_and_a_cancelled_wait_leaks_nothing(
    ray_cluster,
    example_tasks,
    anyio_backend,
) -> None:
    from harbor_async.backends.simulated import SimulatedEnvironment

    budget = ray_budget.factory(address=ray_cluster.address, max_live=2, lease_timeout=LEASE_TIMEOUT)
    async with Engine(limits=Limits(live_sandboxes=None), budget=budget) as engine:

        async def one(i: int) -> None:
            async with engine.sandbox(example_tasks[i], "simulated", backend_kwargs={"start_latency": 0.05}):
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        assert 1 <= SimulatedEnvironment.peak_live <= 2  # counted by the backend: six wanted, two allowed

        ray, actor = _actor()
        async with engine.sandbox(example_tasks[0], "simulated"), engine.sandbox(example_tasks[1], "simulated"):
            with anyio.move_on_after(1.0):  # a third start waits for a slot; give up waiting
                async with engine.sandbox(example_tasks[2], "simulated"):
                    raise AssertionError("a third sandbox started under a cap of 2")
            for _ in range(50):  # the withdrawal is sent without waiting for the reply
                stats = ray.get(actor.stats.remote())
                if stats["live_waiting"] == 0:
                    break
                await anyio.sleep(0.1)
            assert stats["live_used"] == 2 and stats["live_waiting"] == 0  # the withdrawn wait is gone
        for _ in range(100):  # releases are sent without waiting for the reply
            stats = ray.get(actor.stats.remote())
            if stats["live_used"] == 0 and stats["leases"] == 0:
                break
            await anyio.sleep(0.1)
        assert stats["live_used"] == 0 and stats["leases"] == 0


@pytest.mark.range  # Ray's switch is read by Ray's own modules: both ends of its range
def test_a_driver_that_imported_ray_first_still_keeps_sigterm(ray_cluster) -> None:
    """Ray's native failure-signal handler (it prints a stack on SIGTERM, and the process may then abort) stays
    off in a process that imported Ray before harbor-async: Ray reads its switch when it is imported."""
    env = child_env()
    env.pop("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", None)
    child = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "ray_sigterm_child.py"), ray_cluster.address],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "connected"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert "SIGTERM received" not in err, err[-2000:]
    assert child.returncode == 143, err[-2000:]
