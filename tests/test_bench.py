"""The benchmark commands run end to end on small sizes and write complete results.

Speed itself is measured by the benchmarks, not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real trainer, cluster, daemon, browser or wheel

from tests.requirements import needs_bwrap

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str, out: Path, env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "harbor_async", "bench", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={**(os.environ if env is None else env), "TRL_EXPERIMENTAL_SILENCE": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {"stdout": result.stdout, "stderr": result.stderr}


def test_grpo_step_compares_trl_and_the_shim(tmp_path):
    run = bench("grpo-step", "-b", "local", "-B", "2,3", "-T", "2", "-s", "2", out=tmp_path)
    data = json.loads((tmp_path / "grpo-step-local.json").read_text())
    assert data["machine"]["cpus"] >= 1 and data["machine"]["packages"]["trl"] == "1.16.0"
    runs = {(r["implementation"], r["batch"]): r for r in data["runs"]}
    assert set(runs) == {("trl", 2), ("shim", 2), ("trl", 3), ("shim", 3)}
    for (impl, batch), r in runs.items():
        assert len(r["steps"]) == 2 and all(s["reset"] >= 0 and s["tools"] > 0 for s in r["steps"])
        # Same tasks, same scripted answers: both implementations earn the same reward.
        assert r["mean_reward"] == runs[("trl", batch)]["mean_reward"]
    assert (tmp_path / "grpo-step-local.png").stat().st_size > 10_000
    assert "ratio shim/TRL" in run["stdout"]
    assert "benchmarks.reference" in run["stderr"]  # says how TRL's env was driven on this backend


def test_throughput_reports_rates_latencies_and_memory(tmp_path):
    bench("throughput", "-e", "simulated", "--latency", "zero", "--episodes", "12", "-n", "1,4", out=tmp_path)
    data = json.loads((tmp_path / "throughput-simulated.json").read_text())
    assert [r["concurrency"] for r in data["runs"]] == [1, 4]
    for r in data["runs"]:
        assert r["episodes"] == 12 and r["failures"] == 0 and r["episodes_per_second"] > 0
        assert r["peak_live"] == r["concurrency"]
        assert set(r["phases"]) >= {"start", "exec", "verify", "stop"}
        assert all(p["p50"] <= p["p95"] <= p["p99"] for p in r["phases"].values())


def test_overhead_reports_the_round_trip_and_capacity(tmp_path):
    # A bound no probe can meet: the ramp stops at its first size and holds nothing.
    bench("overhead", "--calls", "200", "--sizes", "20,40", "--bound-us", "0.001", out=tmp_path / "tight")
    tight = json.loads((tmp_path / "tight" / "overhead.json").read_text())
    assert [s["sandboxes"] for s in tight["capacity"]] == [20] and tight["capacity"][0]["under_bound"] is False
    assert tight["bound_us"] == 0.001 and tight["max_sandboxes_under_bound"] == 0 and tight["bound_percentile"] == "p99"
    # A bound every probe meets: both sizes are held, the largest is the answer.
    bench("overhead", "--calls", "200", "--sizes", "20,100", "--bound-us", "1000000", out=tmp_path / "loose")
    data = json.loads((tmp_path / "loose" / "overhead.json").read_text())
    rt = data["round_trip"]
    assert rt["calls"] == 200
    assert 0 < rt["direct_p50_us"] < rt["portal_p50_us"], rt  # the portal adds a thread hand-off
    assert 0 < rt["floor_p50_us"] < rt["portal_p50_us"], rt  # a bare hand-off of nothing costs less than one of an exec
    capacity = data["capacity"]
    assert [s["sandboxes"] for s in capacity] == [20, 100]
    for step in capacity:  # each step's verdict is its own p99, and the probe ran under load
        assert step["under_bound"] is True and 0 < step["probe_p50_us"] <= step["probe_p99_us"], step
        # why it held: the loop thread's share of the window (it served the probe's calls) and the collector's pauses
        assert 0 < step["loop_busy"] < 1.5, step
        assert step["collections_over_bound"] <= step["collections"] and step["longest_collection_ms"] >= 0, step
    assert data["max_sandboxes_under_bound"] == 100
    # The collector's young threshold in the window: CPython's 700 until the live count asks more (the probe's one
    # sandbox beside the load's; harbor_async.core.collector).
    assert [s["young_threshold"] for s in capacity] == [700, 101 * 10], capacity
    # Which event loop the loop thread ran: the figures depend on it.
    assert data["event_loop"] == "asyncio.unix_events._UnixSelectorEventLoop"


@needs_bwrap
def test_fork_bombs_are_killed_while_probes_exec(tmp_path):
    """The bombs go off (hundreds of processes in a bomber's cgroup), every one is ended by its timeout, and the
    probes' execs go on in both halves of the round; the ratio is the benchmark's to report, not this test's."""
    run = bench("fork-bombs", "--repeats", "1", "--seconds", "3", out=tmp_path)
    data = json.loads((tmp_path / "fork-bombs.json").read_text())
    (found,) = data["rounds"]
    assert found["kills"] >= 4 and found["bombs_ended_early"] == 0, found  # every bomb ran until its timeout ended it
    assert found["probe_execs_idle"] > 0 and found["probe_execs_bombed"] > 0, found
    assert found["host_processes"] > found["cgroup_processes"] >= 100, found  # the bomb went off, in its cgroup
    assert data["p99_ratio"]["median"] == found["p99_ratio"] > 0
    assert "p99 under bombs / idle" in run["stderr"]
    # --bomber-pids reaches the bombers' sandboxes: each bomb grows to that limit and no further.
    bench("fork-bombs", "--repeats", "1", "--seconds", "1", "--bomber-pids", "128", out=tmp_path)
    small = json.loads((tmp_path / "fork-bombs-pids128.json").read_text())
    assert small["options"]["bomber_pids"] == 128 and data["options"]["bomber_pids"] is None
    assert 32 <= small["rounds"][0]["cgroup_processes"] <= 128 < found["cgroup_processes"], small["rounds"]
    leftovers = subprocess.run(["pgrep", "-fc", "bomb"], capture_output=True, text=True)
    assert leftovers.stdout.strip() in ("", "0"), leftovers.stdout  # every bomb ended with its sandbox


def test_grpo_step_replay_with_prefetch_claims_every_later_start_and_leaves_nothing(example_tasks):
    from benchmarks.grpo_step import run_grpo_steps
    from shim import engines, prefetch

    latencies = {"start_latency": 0.2, "exec_latency": 0.01, "verify_latency": 0.05, "stop_latency": 0.0}
    kwargs = {"backend": "simulated", "batch": 4, "turns": 2, "steps": 3, "backend_kwargs": latencies}
    rounds = run_grpo_steps("shim-rounds", **kwargs)
    for implementation in ("shim-prefetch", "shim-prefetch-early"):
        ahead = run_grpo_steps(implementation, optimise_seconds=0.3, **kwargs)
        assert ahead.prefetch_hits == [0, 4, 4], implementation
        assert ahead.mean_reward == rounds.mean_reward > 0  # same tasks and answers, same verdicts
    assert prefetch.parked_count() == 0 and engines.live_sandbox_count() == 0


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def test_the_working_folder_is_named_relative_to_the_repository(tmp_path):
    from benchmarks.provenance import REPO, working_folder

    assert working_folder(REPO) == "." and working_folder(REPO / "benchmarks") == "benchmarks"
    assert working_folder(tmp_path) == "(outside the repository)"


def test_every_result_file_records_commit_command_machine_and_load(tmp_path):
    """The honest-method block: a figure can be traced to its code, its command and how busy the machine was."""
    bench("throughput", "-e", "simulated", "--latency", "zero", "--episodes", "4", "-n", "2", out=tmp_path)
    data = json.loads((tmp_path / "throughput-simulated.json").read_text())
    prov = data["provenance"]
    assert prov["commit"] == _git("rev-parse", "HEAD")
    assert prov["dirty"] == bool(_git("status", "--porcelain", "--untracked-files=no"))
    assert prov["command"] == (
        f"harbor-async bench throughput -e simulated --latency zero --episodes 4 -n 2 --out {tmp_path}"
    )
    for key in ("load_before", "load_after"):
        assert len(prov[key]) == 3 and all(isinstance(x, float | int) and x >= 0 for x in prov[key])
    assert prov["started"] <= prov["finished"]
    assert prov["cwd"] == "."  # the repository's root (bench() runs there), never this machine's path to it
    machine = data["machine"]
    assert machine["cpus"] >= 1 and machine["memory_gib"] > 0 and machine["python"] and machine["platform"]
    assert machine["packages"]["harbor-async"] and machine["packages"]["harbor"]


def test_the_settings_a_run_saw_are_recorded_beside_its_command(tmp_path):
    from benchmarks.provenance import settings

    assert settings({"HARBOR_ASYNC_LOCAL_POOL": "0", "HOME": "/root", "HARBOR_ASYNC_LOG_LEVEL": "a b"}) == (
        "HARBOR_ASYNC_LOCAL_POOL=0 'HARBOR_ASYNC_LOG_LEVEL=a b'"
    )
    assert settings({"PATH": "/bin"}) == ""
    assert settings({"HARBOR_ASYNC_API_KEY": "sk-live"}) == "'HARBOR_ASYNC_API_KEY=<redacted>'"
    env = {**os.environ, "HARBOR_ASYNC_LOCAL_POOL": "0"}
    bench("throughput", "-e", "simulated", "--latency", "zero", "--episodes", "2", "-n", "1", out=tmp_path, env=env)
    prov = json.loads((tmp_path / "throughput-simulated.json").read_text())["provenance"]
    assert "HARBOR_ASYNC_LOCAL_POOL=0" in prov["settings"].split()


def test_command_line_is_written_as_the_user_typed_it():
    from benchmarks.provenance import command_line

    main = str(REPO / "harbor_async" / "__main__.py")
    assert command_line([main, "bench", "harbor", "-p", "my suite"]) == "harbor-async bench harbor -p 'my suite'"
    assert command_line(["/venv/bin/harbor-async", "bench", "overhead"]) == "harbor-async bench overhead"
    assert command_line([str(REPO / "benchmarks" / "cluster.py"), "--out", "x.json"]) == "python -m benchmarks.cluster --out x.json"


def test_harbor_bench_runs_both_clis_on_the_same_tasks(tmp_path):
    """`bench harbor`: harbor-async run and Harbor's harbor run, same suite, agent, backend and -n, in one run."""
    run = bench("harbor", "-e", "local", "-l", "2", "--repeats", "1", "-n", "2", out=tmp_path)
    data = json.loads((tmp_path / "harbor-vs-harbor-async-local.json").read_text())
    assert data["benchmark"] == "harbor" and data["provenance"]["commit"] == _git("rev-parse", "HEAD")
    assert "harbor-async bench harbor -e local -l 2 --repeats 1 -n 2" in data["provenance"]["command"]
    assert (data["env"], data["agent"], data["n_concurrent"], data["n_tasks"], data["repeats"]) == ("local", "oracle", 2, 2, 1)
    assert " run -y " in data["commands"]["harbor"] and "harbor_async.backends.local:LocalEnvironment" in data["commands"]["harbor"]
    # as they ran, without this machine's paths: the checkout's relative, the scratch folder named, the scripts by name
    assert data["suite"] == "harbor_async/suites/example"
    assert data["commands"]["harbor-async"].startswith("harbor-async run -p harbor_async/suites/example -e local ")
    assert data["commands"]["harbor"].startswith("harbor run -y -p harbor_async/suites/example/tasks ")
    assert "-o $SCRATCH/round-0/jobs/harbor " in data["commands"]["harbor"] + " "
    assert str(REPO) not in json.dumps(data["commands"]) and tempfile.gettempdir() not in json.dumps(data["commands"])
    for cli in ("harbor-async", "harbor"):
        side = data["clis"][cli]
        assert side["episodes"] == side["reward_one"] == 2 and side["errors"] == 0  # every episode ran, reward 1
        assert side["wall_s"]["median"] > 0 and side["episodes_per_second"]["median"] > 0
        assert set(side["phases"]) == {"start", "agent", "verify", "stop"}
        assert all(0 <= p["p50"] <= p["p99"] and p["n"] == 2 for p in side["phases"].values())
    # the per-task table: both CLIs ran the same two tasks, with the same rewards, no exception
    assert len(data["tasks"]) == 2 and all(row["same_rewards"] for row in data["tasks"].values()), data["tasks"]
    for row in data["tasks"].values():
        assert row["harbor"]["rewards"] == row["harbor-async"]["rewards"] == [1.0] and row["harbor-async"]["exceptions"] == {}
        assert row["harbor"]["seconds_p50"] > 0 and row["harbor-async"]["seconds_p50"] > 0
    assert "per task: 2 tasks, 0 whose rewards differ" in run["stdout"]
    ratio = data["ratio_episodes_per_second"]
    assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
    [only] = data["rounds"]
    assert only["ratio"] == ratio["median"] and only["first"] == "harbor-async"
    assert "harbor-async run vs harbor run" in run["stdout"]
    # `harbor-async report` shows it as tables, with the provenance beside the machine.
    from harbor_async.report.bench import benchmark_section
    from harbor_async.report.source import load_source

    [result] = load_source(tmp_path).results
    section = benchmark_section(result)
    assert [t.title for t in section.tables][1:3] == ["episodes/s ratio harbor-async / harbor", "rounds"]
    assert [row[0] for row in section.tables[0].rows] == ["harbor-async", "harbor"]
    assert dict(section.machine)["commit"] == data["provenance"]["commit"] and "load before" in dict(section.machine)


def test_docker_step_layers_each_ratio_against_trl_of_the_same_round(monkeypatch):
    """The layered ratios' method, with a deterministic stand-in for the replay (the replay itself is tested above)."""
    from benchmarks import docker_step
    from benchmarks.grpo_step import GrpoRun, StepTimes

    calls = []
    later = {"trl": [100.0, 120.0, 110.0], "shim": [20.0, 30.0, 25.0], "shim-rounds": [5.0, 6.0, 5.5], "shim-prefetch": [4.0, 4.0, 4.0]}

    def replay(implementation, *, backend, backend_kwargs, optimise_seconds, **kwargs):
        calls.append((implementation, backend, backend_kwargs, optimise_seconds))
        seconds = later[implementation][sum(1 for c in calls if c[0] == "trl") - 1]  # this round's
        if implementation == "shim" and backend_kwargs == {"fast_start": False}:
            seconds *= 2  # Harbor's own start: slower than the fast path
        run = GrpoRun(implementation, backend, 8, 3)
        run.steps = [StepTimes(seconds, 1.0, 1.0), StepTimes(seconds, 0.0, 0.0)]
        run.mean_reward = 1.0
        return run

    monkeypatch.setattr(docker_step, "run_grpo_steps", replay)
    result = docker_step.run(steps=2, repeats=3, log=lambda *_: None)
    assert all(backend == "docker" for _, backend, _, _ in calls) and len(calls) == 15
    assert [c[0] for c in calls[:5]] == ["trl", "shim", "shim", "shim-rounds", "shim-prefetch"]
    assert calls[1][2] == {"fast_start": False} and calls[2][2] == {} and calls[0][2] is None
    assert calls[4][3] == docker_step.OPTIMISE_SECONDS and calls[3][3] == 0.0
    summary = result["summary"]
    assert list(summary) == ["TRL's env", "concurrency only", "+ backend fast path", "+ trainer dispatch", "+ prefetch"]
    # Per round: TRL's later step over the layer's, the same round's TRL (100/20, 120/30, 110/25).
    assert summary["+ backend fast path"]["later_ratio_to_trl"] == {"median": 4.4, "min": 4.0, "max": 5.0}
    assert summary["concurrency only"]["later_ratio_to_trl"] == {"median": 2.2, "min": 2.0, "max": 2.5}
    assert summary["TRL's env"]["later_ratio_to_trl"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert len(result["rounds"]) == 3


def test_the_generated_task_set_is_solved_by_the_scripted_rollouts(tmp_path):
    from benchmarks.grpo_step import run_grpo_steps
    from benchmarks.task_sets import generate

    suite = generate("wide", tmp_path, tasks=3)
    assert generate("wide", tmp_path, tasks=3) == suite  # idempotent: a rerun keeps the files
    stale = suite / "wide-00" / "environment" / "Dockerfile"
    stale.write_text("FROM debian:bookworm-slim\nRUN echo an earlier release's > /etc/task-name\n")
    generate("wide", tmp_path, tasks=3)
    assert b"RUN" not in stale.read_bytes()  # an earlier release's generated file is replaced
    images = {
        tuple((suite / f"wide-{i:02d}" / "environment" / name).read_bytes() for name in ("Dockerfile", "task-name", "data.bin"))
        for i in range(3)
    }
    assert len(images) == 3 and len({files[2] for files in images}) == 3  # a distinct image per task, data and all
    assert all(b"RUN " not in files[0] for files in images)  # builds without a build network (dockerd --bridge=none)
    for implementation in ("trl", "shim"):
        run = run_grpo_steps(implementation, backend="local", batch=3, turns=2, steps=1, suite=str(suite))
        assert run.mean_reward == 1.0, implementation


def test_a_process_exits_with_trls_env_still_referenced():
    """TRL's ``__del__`` waits for its loop thread; at interpreter exit it must not (a failed benchmark hung there)."""
    script = (
        "from benchmarks.reference import ReferenceHarborBashEnv\n"
        "from harbor_async.tasks.suite import load_suite\n"
        "env = ReferenceHarborBashEnv(environment_type='simulated')\n"  # a global: collected only at exit
        "env.reset(task_dir=str(load_suite(None).tasks[0].task_dir))\n"
        "print('started', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert (done.returncode, done.stdout) == (0, "started\n"), done.stderr[-2000:]


def test_usage_window_measures_the_thread_it_names_and_the_collector():
    import gc
    import threading
    import time

    from benchmarks.window import UsageWindow

    def spin(seconds: float, tid: list) -> None:
        tid.append(threading.get_ident())
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    # A thread that only sleeps through the window is idle there; one that spins is busy.
    sleeper_id: list = []
    sleeper = threading.Thread(target=lambda: (sleeper_id.append(threading.get_ident()), time.sleep(1.0)))
    sleeper.start()
    while not sleeper_id:
        time.sleep(0.01)
    with UsageWindow(sleeper_id[0], bound_s=1.0) as idle:
        time.sleep(0.3)
    sleeper.join()
    assert idle.usage.busy < 0.2 and idle.usage.seconds >= 0.3

    spinner_id: list = []
    spinner = threading.Thread(target=spin, args=(1.0, spinner_id))
    spinner.start()
    while not spinner_id:
        time.sleep(0.01)
    with UsageWindow(spinner_id[0], bound_s=0.0) as busy:
        time.sleep(0.3)
        garbage = [[] for _ in range(1000)]
        for a, b in zip(garbage, garbage[1:]):  # cycles only the collector frees
            a.append(b)
            b.append(a)
        del garbage, a, b
        assert gc.collect() > 0
    spinner.join()
    assert busy.usage.busy > max(0.1, 3 * idle.usage.busy)  # a loaded runner (two test workers, load 4) shares the cores: not 1.0
    # the collection above, timed; a zero bound counts every pause as over it
    assert busy.usage.collections >= 1 and busy.usage.longest_collection_ms > 0
    assert busy.usage.collections_over_bound == busy.usage.collections
    assert busy._on_collection not in gc.callbacks  # the callback leaves with the window


def test_the_openenv_side_by_side_finds_every_episode_that_differs():
    """The benchmark's claim of "the same episodes" is a comparison of reward, calls and captured tokens per task."""
    from benchmarks.openenv_side import compare

    def side(**episodes: tuple) -> dict:
        return {"episodes": {task: dict(zip(("reward", "calls", "tokens"), row, strict=True)) for task, row in episodes.items()}}

    same = compare(side(a=(1.0, 3, 427), b=(0.0, 2, 90)), side(a=(1.0, 3, 427), b=(0.0, 2, 90)))
    assert same == {"same_episodes": True, "differences": []}
    found = compare(side(a=(1.0, 3, 427), b=(0.0, 2, 90)), side(a=(1.0, 3, 426), c=(1.0, 3, 1)))
    assert not found["same_episodes"]
    assert found["differences"] == [
        {"task": "a", "field": "tokens", "openenv": 427, "harbor-async": 426},
        {"task": "b", "missing_from": "harbor-async"},
        {"task": "c", "missing_from": "openenv"},
    ]
