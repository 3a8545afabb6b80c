"""Episodes sharded over a real local Ray cluster (a head and a worker node), records in the driver's job folder."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio

from harbor_async.cluster.sharding import ShardedRunner
from harbor_async.engine import Engine
from harbor_async.jobs import JobFolder
from harbor_async.policy import Limits
from harbor_async.scoring import summarize
from harbor_async.suites import example_suite_path
from tests.cluster_episodes import items, simulated_episode
from tests.cluster_helpers import ray_cluster  # noqa: F401 - the fixture

TASKS = sorted(str(p.parent) for p in (example_suite_path() / "tasks").glob("*/task.toml"))


def _local_run(episodes, job: JobFolder) -> None:
    async def main() -> None:
        async with Engine(limits=Limits(live_sandboxes=8)) as engine, anyio.create_task_group() as tg:
            for _, item in episodes:

                async def one(item=item) -> None:
                    job.append(await simulated_episode(engine, item))

                tg.start_soon(one)

    anyio.run(main)


def test_a_sharded_run_gives_the_local_summary_and_resumes(ray_cluster, tmp_path: Path) -> None:  # noqa: F811
    episodes = items(TASKS, attempts=2)
    local = JobFolder.create(tmp_path, "local", {"suite": "example"})
    _local_run(episodes, local)

    job = JobFolder.create(tmp_path, "cluster", {"suite": "example"})
    with ShardedRunner(simulated_episode, address=ray_cluster.address, concurrency=4) as runner:
        assert len(runner.workers) == 2  # one engine per node
        first = runner.run(episodes[:7], job=job)  # a run that stopped early...
        pending = set(job.pending([key for key, _ in episodes]))
        assert len(pending) == len(episodes) - 7
        rest = runner.run([(k, i) for k, i in episodes if k in pending], job=job)  # ...and its resume
    assert len(first) + len(rest) == len(episodes) == 20
    assert all(n > 0 for n in runner.stats.per_worker.values())  # both nodes ran episodes
    records = job.records()
    assert sorted(r.key for r in records) == sorted(key for key, _ in episodes)  # each once
    # Records arrive in completion order (locally too): summarize both in the suite's order.
    order = {key: i for i, (key, _) in enumerate(episodes)}

    def in_order(folder: JobFolder) -> list:
        return sorted(folder.latest().values(), key=lambda r: order[r.key])

    assert summarize(in_order(job)) == summarize(in_order(local))
    assert summarize(in_order(job))["episodes"] == 20


def test_a_worker_killed_mid_run_loses_and_duplicates_nothing(ray_cluster, tmp_path: Path) -> None:  # noqa: F811
    episodes = items(TASKS, attempts=2, latency=0.4)
    job = JobFolder.create(tmp_path, "cluster", {})
    killed: list[int] = []
    with ShardedRunner(simulated_episode, address=ray_cluster.address, concurrency=3) as runner:
        pids = runner.worker_pids()
        victim = max(pids)

        def kill_one(record) -> None:
            if not killed and len(job.records()) >= 4:  # mid-run: episodes are in flight on both workers
                os.kill(pids[victim], signal.SIGKILL)
                killed.append(pids[victim])

        done = runner.run(episodes, job=job, on_record=kill_one)
    assert killed
    assert runner.stats.workers_lost == 1 and runner.stats.rerun >= 1
    assert set(done) == {key for key, _ in episodes}
    keys = [r.key for r in job.records()]
    assert len(keys) == len(set(keys)) == len(episodes)  # nothing lost, nothing twice
    expected = {key: item["reward"] for key, item in episodes}
    assert {r.key: r.reward for r in job.records()} == expected
