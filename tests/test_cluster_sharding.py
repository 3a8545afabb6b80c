"""Episodes sharded over a real local Ray cluster (a head and a worker node), records in the driver's job folder."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import anyio
import pytest

from harbor_async.cluster.sharding import ShardedRunner
from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from harbor_async.jobs.folder import JobFolder
from harbor_async.jobs.scoring import summarize
from harbor_async.suites import example_suite_path
from tests.cluster_episodes import items, simulated_episode

pytestmark = [pytest.mark.slow]

TASKS = sorted(str(p.parent) for p in (example_suite_path() / "tasks").glob("*/task.toml"))


def _local_run(episodes, job: JobFolder) -> None:
    async def main() -> None:
        async with Engine(limits=Limits(live_sandboxes=8)) as engine, anyio.create_task_group() as tg:
            for _, item in episodes:

                async def one(item=item) -> None:
                    job.append(await simulated_episode(engine, item))

                tg.start_soon(one)

    anyio.run(main)


@pytest.mark.range
def test_a_sharded_run_gives_the_local_summary_and_resumes(ray_cluster, tmp_path: Path) -> None:
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


@pytest.mark.range
def test_a_worker_killed_mid_run_loses_and_duplicates_nothing(ray_cluster, tmp_path: Path) -> None:
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


def test_run_episodes_sharded_give_the_records_of_a_local_run(ray_cluster, tmp_path: Path) -> None:
    from harbor_async.cluster.episodes import run_item, run_items
    from harbor_async.cluster.sharding import run_on_cluster
    from harbor_async.episodes.runner import PlannedEpisode, run_suite
    from harbor_async.tasks.suite import load_suite

    tasks = load_suite(example_suite_path()).tasks
    todo = [PlannedEpisode(task, attempt) for task in tasks for attempt in range(2)]
    local = JobFolder.create(tmp_path, "local", {})

    async def local_run() -> None:
        async with Engine(limits=Limits(live_sandboxes=None)) as engine:
            await run_suite(engine, todo, "simulated", agent="oracle", concurrency=8, on_done=local.append)

    anyio.run(local_run)
    items = run_items(todo, "simulated", "oracle")
    job = JobFolder.create(tmp_path, "cluster", {})
    done = run_on_cluster(run_item, items, job=job, address=ray_cluster.address, concurrency=4)
    assert set(done) == {key for key, _ in items} == set(local.latest())  # the same keys as `run` writes
    order = {key: i for i, (key, _) in enumerate(items)}

    def in_order(folder: JobFolder) -> list:
        return sorted(folder.latest().values(), key=lambda r: order[r.key])

    assert [(r.key, r.reward, r.error_class) for r in in_order(job)] == [
        (r.key, r.reward, r.error_class) for r in in_order(local)
    ]
    assert summarize(in_order(job)) == summarize(in_order(local))


def test_the_run_command_shards_over_the_cluster_and_leases_from_its_budget(ray_cluster, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.cluster_helpers import REPO, child_env

    command = [
        sys.executable, "-m", "harbor_async", "run", "-e", "simulated", "-l", "4", "-k", "2", "-o", str(tmp_path),
        "--job-name", "sharded", "--ray", "--ray-address", ray_cluster.address,
        "--budget", "ray", "--cluster-max-live", "3",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "sharded" / "summary.json").read_text())
    assert summary["episodes"] == 8 and summary["mean_reward"] == 1.0 and summary["failures"] == {}
    records = JobFolder.open(tmp_path / "sharded").records()
    assert len({r.key for r in records}) == len(records) == 8  # each episode once


def test_an_eval_sharded_over_the_cluster_gives_the_local_summary(ray_cluster, tmp_path: Path) -> None:
    from harbor_async.evaluation import evaluate_sync
    from tests.scripted_server import ScriptedServer

    def comparable(summary: dict) -> dict:
        return {k: summary[k] for k in ("episodes", "tasks", "completed", "failures", "mean_reward", "pass_at_k")}

    with ScriptedServer() as server:
        common = dict(base_url=server.base_url, jobs_dir=tmp_path, n_tasks=3, n_attempts=2, n_concurrent=4)
        local = evaluate_sync(["solver"], None, job_name="local", **common)
        sharded = evaluate_sync(["solver"], None, job_name="sharded", ray=True, ray_address=ray_cluster.address, **common)
    assert sharded.ran == 6 and comparable(sharded.summary) == comparable(local.summary)
    assert sharded.summary["mean_reward"] == 1.0
    records = JobFolder.open(sharded.job_dir).records()
    assert len({r.key for r in records}) == len(records) == 6  # each episode once
    assert all(r.transcript and r.model == "solver" for r in records)


@pytest.mark.range
def test_the_eval_command_shards_over_the_cluster_with_the_ray_budget(ray_cluster, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.cluster_helpers import REPO, child_env
    from tests.scripted_server import ScriptedServer

    with ScriptedServer() as server:
        command = [
            sys.executable, "-m", "harbor_async", "eval", "-m", "solver", "--base-url", server.base_url, "-l", "2",
            "-k", "2", "-o", str(tmp_path), "--job-name", "sharded", "--ray", "--ray-address", ray_cluster.address,
            "--budget", "ray", "--max-live", "3",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "sharded" / "summary.json").read_text())
    assert summary["episodes"] == 4 and summary["mean_reward"] == 1.0


def test_run_eval_a_cluster_worker_and_the_shim_write_one_record_shape(ray_cluster, tmp_path: Path) -> None:
    """One task through `run`, `eval` (local and on a cluster worker) and the shim: one runner, one record shape."""
    import json
    import re
    import subprocess
    import sys

    from harbor_async.evaluation import evaluate_sync
    from harbor_async.tasks.suite import load_suite
    from shim import HarborBashEnv
    from tests.cluster_helpers import REPO, child_env
    from tests.scripted_server import ScriptedServer

    suite = example_suite_path()
    loaded = load_suite(suite)
    task = loaded.tasks[0]
    command = [
        sys.executable, "-m", "harbor_async", "run", "-p", str(suite), "-i", task.name, "-e", "local",
        "-o", str(tmp_path), "--job-name", "run",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    (ran,) = JobFolder.open(tmp_path / "run").records()
    with ScriptedServer() as server:
        common = dict(base_url=server.base_url, jobs_dir=tmp_path, include=[task.name], environment_type="local")
        (local,) = evaluate_sync(["solver"], str(suite), job_name="eval", **common).records
        (worker,) = evaluate_sync(
            ["solver"], str(suite), job_name="sharded", ray=True, ray_address=ray_cluster.address, **common
        ).records
    env = HarborBashEnv("local")
    env.reset(task_dir=str(task.paths.task_dir))
    env.bash((task.paths.solution_dir / "solve.sh").read_text())
    assert env.reward == 1.0
    shim = env.episode_record
    env.close()

    records = {"run": ran, "eval": local, "cluster": worker, "shim": shim}
    for name, record in records.items():
        assert record.reward == 1.0 and record.error_class is None, name
        assert record.task == task.name and record.sandbox, name
        # the same phases, in the same order, each a span inside the episode and after the one before
        assert [p.phase for p in record.phases] == ["start", "agent", "verify", "stop"], name
        ends = [0.0] + [p.end for p in record.phases]
        assert all(p.start >= prev - 1e-3 and p.end >= p.start for p, prev in zip(record.phases, ends, strict=False)), name
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", record.started_at), name
        assert {"start", "stop", "total"} <= set(record.seconds) and record.start_attempts == 1, name
        assert set(json.loads(json.dumps(record.to_dict()))) == set(ran.to_dict()), name
    # jobs name the task by its path in the suite; the shim, given a folder, by that folder
    assert ran.task_path == local.task_path == worker.task_path == task.paths.task_dir.relative_to(loaded.root).as_posix()
    assert Path(shim.task_path) == task.paths.task_dir
    # eval on the driver and on a worker: the same conversation
    assert [m["role"] for m in local.transcript] == [m["role"] for m in worker.transcript]
    assert local.agent == worker.agent == shim.agent == "bash" and ran.agent == "oracle"


def test_a_worker_opens_one_engine_for_the_episodes_that_arrive_together() -> None:
    """The actor's first episodes arrive at once: one engine serves them all, close() closes it, none opens later."""
    from harbor_async.cluster import WorkerClosedError
    from harbor_async.cluster.sharding import EpisodeWorker

    engines: list[Engine] = []

    class Record:
        def to_dict(self) -> dict:
            return {}

    async def episode(engine: Engine, item: int) -> Record:
        engines.append(engine)
        await anyio.sleep(0.01)
        return Record()

    async def main() -> None:
        worker = EpisodeWorker(episode, {})
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(worker.run, i)
        assert len(engines) == 8 and len({id(e) for e in engines}) == 1
        assert not engines[0].closed
        await worker.close()
        assert engines[0].closed
        # an episode that arrives late opens no engine nothing would close
        with pytest.raises(WorkerClosedError):
            await worker.run(8)
        assert len(engines) == 8 and worker._engine is None and worker._holder is None

    anyio.run(main)


def test_eval_over_the_cluster_stops_on_a_failing_model_server_as_a_local_eval_does(ray_cluster, tmp_path: Path) -> None:
    """--max-model-server-failures over Ray: the same stop, the same error and summary as a local eval."""
    from harbor_async.core.errors import ModelServerDownError
    from harbor_async.evaluation import evaluate_sync
    from tests.scripted_server import ScriptedServer

    outcomes = {}
    with ScriptedServer() as server:
        common = dict(
            base_url=server.base_url, jobs_dir=tmp_path, n_tasks=8, n_concurrent=2, max_model_server_failures=2,
            limits={"retries": 1, "retry_max_wait": 0.1}, environment_type="simulated",
        )  # fmt: skip
        for name, where in (("local", {}), ("sharded", {"ray": True, "ray_address": ray_cluster.address})):
            with pytest.raises(ModelServerDownError) as caught:
                evaluate_sync(["always-500"], None, job_name=name, **common, **where)
            assert caught.value.failures == 2 and server.base_url in str(caught.value)
            import json

            summary = json.loads((tmp_path / name / "summary.json").read_text())
            records = JobFolder.open(tmp_path / name).records()
            failed = sum(r.error_class == "model_server" for r in records)
            assert {r.error_class for r in records} <= {"model_server", "cancelled"}
            assert 2 <= failed < 8, failed  # it stopped: not every episode went to the dead server
            outcomes[name] = (summary["stopped_by"], summary["completed"], summary["mean_reward"])
    assert outcomes["sharded"] == outcomes["local"] == ("the model server failed 2 episodes in a row", 0, None)


def test_a_ray_job_interrupted_then_resumed_with_no_flags_runs_on_the_cluster_again(ray_cluster, tmp_path: Path) -> None:
    """SIGINT stops a `run --ray` (records kept); `--resume` alone runs the rest on the cluster, as stored."""
    import subprocess
    import sys
    import time

    from harbor_async.core.naming import owner_from_session
    from tests.cluster_helpers import REPO, child_env

    job = tmp_path / "j"
    first = subprocess.Popen(
        [sys.executable, "-m", "harbor_async", "run", "-e", "simulated", "--ek", "start_latency=0.5", "-k", "3", "-n", "2",
         "--ray", "--ray-address", ray_cluster.address, "-o", str(tmp_path), "--job-name", "j", "-q"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not ((job / "episodes.jsonl").exists() and len((job / "episodes.jsonl").read_text().splitlines()) >= 2):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
        time.sleep(0.1)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 130, err[-3000:]
    kept = {r.key for r in JobFolder.open(job).records() if not r.rerun}
    assert 2 <= len(kept) < 30

    moved = subprocess.run(
        [sys.executable, "-m", "harbor_async", "run", "--resume", str(job), "--ray-address", "127.0.0.1:1"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert moved.returncode == 2 and ray_cluster.address in moved.stderr and "127.0.0.1:1" in moved.stderr

    resumed = subprocess.Popen(
        [sys.executable, "-m", "harbor_async", "run", "--resume", str(job), "-q"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    latest = JobFolder.open(job).latest()
    assert len(latest) == 30 and all(r.judged for r in latest.values())
    owners = {owner_from_session(r.sandbox)[1] for k, r in latest.items() if k not in kept}
    assert owners and resumed.pid not in owners  # the resume's episodes ran on the cluster's workers, not in its own process


def test_harbor_agents_run_on_the_cluster_as_they_run_locally(ray_cluster, tmp_path: Path, host_tmux: None) -> None:
    """run and eval with -a terminus-2 --capture over --ray: the records of a local run (agent, model, reward, tokens, calls captured)."""
    from tests.cli_helpers import harbor_async, records
    from tests.scripted_server import ScriptedServer
    from tests.test_harbor_agents import echo_suite

    suite = echo_suite(tmp_path / "suite")
    cluster = ["--ray", "--ray-address", ray_cluster.address]
    seen: dict[str, list[tuple]] = {}
    with ScriptedServer(suite / "tasks") as server:
        commands = {
            "run": ["run", "-p", str(suite), "-a", "terminus-2", "-m", "hosted_vllm/terminus", "--ak",
                    f"api_base={server.base_url}", "-k", "2", "--capture"],
            "eval": ["eval", "-p", str(suite), "-a", "terminus-2", "-m", "terminus", "--base-url", server.base_url,
                     "-k", "2", "--capture"],
        }  # fmt: skip
        for name, argv in commands.items():
            for where, extra in (("local", []), ("ray", cluster)):
                job = f"{name}-{where}"
                done = harbor_async(*argv, *extra, "-o", str(tmp_path / "jobs"), "--job-name", job, timeout=600)
                assert done.returncode == 0, (job, done.stderr[-3000:])
                found = records(tmp_path / "jobs" / job)
                assert all(r["usage"]["n_input_tokens"] > 0 for r in found), job
                for r in found:  # each worker's engine served its own capture proxy; the file came back with the trial
                    assert json.loads((tmp_path / "jobs" / job / r["trial"] / "agent" / "capture.json").read_text())["calls"], job
                seen[job] = sorted(
                    (r["agent"], r["model"], r["attempt"], r["reward"], r["error_class"], r["capture"]["calls"], r["capture"]["retokenize"])
                    for r in found
                )
    assert seen["run-ray"] == seen["run-local"] == [("terminus-2", "hosted_vllm/terminus", a, 1.0, None, 3, False) for a in (0, 1)]
    assert seen["eval-ray"] == seen["eval-local"] == [("terminus-2", "terminus", a, 1.0, None, 3, False) for a in (0, 1)]
