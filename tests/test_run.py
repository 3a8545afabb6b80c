"""The main job: the bundled suite through the engine on the local backend, and `harbor-async run`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harbor_async.core.errors import FailureClass
from harbor_async.core.policy import Limits, Timeouts
from harbor_async.core.policy import failure_class as classify
from harbor_async.engine.engine import Engine
from harbor_async.episodes.runner import PlannedEpisode, run_suite
from tests.cli_helpers import harbor_async, records


@pytest.mark.slow
@pytest.mark.range
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_oracle_solutions_score_one_on_the_local_backend(example_tasks):
    async with Engine(limits=Limits(live_sandboxes=4)) as engine:
        found = await run_suite(engine, example_tasks, "local", agent="oracle", concurrency=4)
        stats = engine.stats()
    assert len(found) == len(example_tasks) >= 8
    assert [r.task for r in found] == [t.name for t in example_tasks]
    assert [r.task_path for r in found] == [str(t.paths.task_dir) for t in example_tasks]
    assert {r.task: r.reward for r in found} == {t.name: 1.0 for t in example_tasks}
    assert all(r.error is None and r.error_class is None for r in found)
    assert stats.peak_live <= 4 and stats.live == 0
    multi = [r for r in found if len(r.rewards) > 1]
    assert multi and all(set(r.rewards) >= {"reward"} for r in multi)
    # Phases are spans from the episode's start, in order, and the verifier's output is kept.
    for r in found:
        assert [p.phase for p in r.phases] == ["start", "agent", "verify", "stop"]
        assert r.phases[0].start == 0.0 and all(a.end <= b.start + 1e-3 for a, b in zip(r.phases, r.phases[1:]))
        assert r.verifier_output  # every bundled test script says what it checked


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_wrong_or_missing_answers_score_zero(example_tasks):
    by_name = {t.name: t for t in example_tasks}
    async with Engine() as engine:
        async with engine.sandbox(by_name["csv-column-sum"], "local") as sandbox:
            wrote = await sandbox.exec("echo 1.00 > /workdir/answer.txt && cat /workdir/answer.txt")
            assert wrote.output.strip() == "1.00" and wrote.exit_code == 0
            assert (await sandbox.verify()).reward == 0.0
        found = await run_suite(engine, example_tasks, "local", agent="none", concurrency=4)
    assert all(r.reward == 0.0 for r in found), found


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_failures_are_classified_and_blamed_on_their_first_phase(example_tasks, tmp_path):
    task = example_tasks[0]
    # A verifier that writes no reward file: the verifier's failure, scored 0, its output kept.
    broken = tmp_path / "no-reward"
    shutil.copytree(task.paths.task_dir, broken)
    (broken / "tests" / "test.sh").write_text("#!/bin/sh\necho checking the answer [environment]\nexit 3\n")
    # A verifier that hangs: timed out, the verifier's too.
    hung = tmp_path / "hung"
    shutil.copytree(task.paths.task_dir, hung)
    (hung / "tests" / "test.sh").write_text("#!/bin/sh\necho started\nsleep 600\n")
    toml = hung / "task.toml"  # the task's own verifier budget (30 s) is the one that counts: make it short
    toml.write_text(toml.read_text().replace("[verifier]\ntimeout_sec = 30.0", "[verifier]\ntimeout_sec = 2.0"))
    from harbor_async.tasks.suite import load_task

    tasks = [load_task(broken), load_task(hung)]
    async with Engine(timeouts=Timeouts(verify=2)) as engine:
        no_reward, timed_out = await run_suite(engine, [PlannedEpisode(t, 3) for t in tasks], "local", concurrency=2)
    assert no_reward.error_class == "verifier" and no_reward.error_phase == "verify"
    assert no_reward.reward == 0.0 and no_reward.attempt == 3
    assert "checking the answer [environment]" in no_reward.verifier_output
    assert timed_out.error_class == "verifier" and timed_out.error_type == "VerifierFailure"
    assert timed_out.reward == 0.0 and "started" in (timed_out.verifier_output or "")
    assert timed_out.seconds["verify"] < 15  # the task's budget, not the 600 s sleep
    assert classify(RuntimeError("bug")) is FailureClass.INFRASTRUCTURE


@pytest.mark.slow
@pytest.mark.range
def test_cli_run_scores_the_bundled_suite_ten_of_ten(tmp_path):
    out = tmp_path / "export.jsonl"
    result = harbor_async("run", "-n", "4", "-o", str(tmp_path / "jobs"), "--job-name", "main", "--json", str(out))
    assert result.returncode == 0, result.stderr
    job = tmp_path / "jobs" / "main"
    found = records(job)
    assert len(found) == 10
    assert all(r["reward"] == 1.0 and r["error"] is None for r in found)
    assert all({"start", "agent", "verify", "stop"} <= set(r["seconds"]) for r in found)
    assert [json.loads(line) for line in out.read_text().splitlines()] == sorted(found, key=lambda r: r["task"])
    summary = json.loads((job / "summary.json").read_text())
    assert summary["mean_reward"] == summary["mean_reward_completed"] == 1.0 and summary["complete"]
    assert "10 episodes: mean reward 1.000 over the 10 judged; failures: none" in result.stdout
    assert "csv-column-sum" in result.stdout


@pytest.mark.slow
def test_cli_run_fails_on_infrastructure_errors(tmp_path):
    result = harbor_async(
        "run", "-e", "tests.broken_backend:FailingStartEnvironment", "-l", "2", "-o", str(tmp_path), "--job-name", "j"
    )
    assert result.returncode == 1, result.stderr
    assert "infrastructure failure" in result.stderr
    found = records(tmp_path / "j")
    assert len(found) == 2
    assert all(r["error_class"] == "infrastructure" and r["error_phase"] == "start" for r in found)
    assert all("disk full" in r["error"] and r["reward"] is None for r in found)
    assert "mean reward - over the 0 judged, 2 not judged (2 infrastructure: rerun by --resume)" in result.stdout  # never a mean of nothing dressed as a score


@pytest.mark.slow
def test_cli_json_logs_carry_phase_events_and_info_one_line_per_episode(tmp_path):
    result = harbor_async("run", "-l", "2", "--log-level", "debug", "--log-format", "json", "-o", str(tmp_path))
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    phases = {e["phase"] for e in events if e.get("event") == "phase"}
    assert phases >= {"start", "agent", "verify", "stop"}
    assert all({"task", "sandbox", "seconds", "outcome", "start_attempt"} <= set(e) for e in events if e.get("event") == "phase")
    info = harbor_async("run", "-l", "3", "--log-level", "info", "--log-format", "json", "-o", str(tmp_path))
    lines = [json.loads(line) for line in info.stderr.splitlines() if line.startswith("{")]
    episodes = [e for e in lines if e.get("event") == "episode"]
    assert len(episodes) == 3 and all(e["reward"] == 1.0 and e["level"] == "info" for e in episodes)
    assert not [e for e in lines if e.get("event") == "phase"]  # phases are debug


@pytest.mark.slow
@pytest.mark.range
@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "-p", "/no/such/suite"], "does not exist"),
        (["run", "-e", "dockr"], "unknown backend 'dockr'"),
        (["run", "-e", "no_such_module:Env"], "cannot be loaded"),
        (["run", "-a", "claude"], "unknown agent"),
        (["run", "-l", "2", "--indices", "1"], "not both"),
        (["run", "--indices", "abc"], "'abc' is not an integer"),
        (["run", "--indices", "99"], "out of range"),
        (["run", "--episode-timeout", "0"], "--episode-timeout must be a positive number of seconds"),
        (["run", "--episode-timeout", "-1"], "--episode-timeout must be a positive number of seconds"),
        (["run", "--episode-timeout", "nan"], "got nan"),
        (["run", "--start-timeout", "0"], "--start-timeout must be"),
        (["run", "--slot-timeout", "0"], "--slot-timeout must be a positive number of seconds"),
        (["run", "--start-attempts", "0"], "--start-attempts must be an integer >= 1"),
        (["run", "--start-retry-wait", "-1"], "--start-retry-wait must be a positive number of seconds"),
        (["run", "--timeout-multiplier", "0"], "--timeout-multiplier must be a positive number"),
        (["run", "--verifier-timeout-multiplier", "inf"], "--verifier-timeout-multiplier must be"),
        (["run", "--log-level", "loud"], "log level 'loud' (given) is not one of"),
        (["run", "--log-format", "xml"], "log format 'xml' (given) is not one of"),
        (["run", "--ek", "novalue"], "expected key=value"),
        (["run", "-n", "0"], "--n-concurrent"),
        (["run", "-k", "zero"], "--n-attempts"),
        (["run", "-p", ".", "-d", "org/name"], "give one suite"),
        (["tasks", "--indices", "1,x"], "'x' is not an integer"),
        (["sandboxes", "list", "-e", "podman"], "-e/--env must be one of"),
        (["sandboxes", "reap", "--older-than", "soon"], "--older-than"),
    ],
)
def test_cli_bad_input_is_a_one_line_error(args, message, tmp_path):
    result = harbor_async(*args, "-o", str(tmp_path)) if args[0] == "run" else harbor_async(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("Bytecode")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert not list(tmp_path.iterdir()), "a job folder was made for bad input"


@pytest.mark.slow
def test_cli_log_settings_flag_then_environment_then_default(tmp_path):
    env = {"HARBOR_ASYNC_LOG_FORMAT": "json", "HARBOR_ASYNC_LOG_LEVEL": "info"}
    # One jobs folder a run: two runs in the same second would otherwise pick the same job name.
    from_env = harbor_async("run", "-l", "1", "-o", str(tmp_path / "env"), env=env)
    events = [json.loads(line) for line in from_env.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in events if e["level"] == "info"].count("episode") == 1
    flag_wins = harbor_async(
        "run", "-l", "1", "-o", str(tmp_path / "flag"), "--log-format", "console", "--log-level", "warning", env=env
    )
    assert flag_wins.returncode == 0, flag_wins.stderr
    assert not any(line.startswith("{") for line in flag_wins.stderr.splitlines()) and "info" not in flag_wins.stderr
    bad_env = harbor_async("run", "-l", "1", "-o", str(tmp_path / "bad"), env={"HARBOR_ASYNC_LOG_LEVEL": "chatty"})
    assert bad_env.returncode == 2 and "from $HARBOR_ASYNC_LOG_LEVEL" in bad_env.stderr


@pytest.mark.slow
def test_cli_reports_invalid_tasks_once_and_runs_the_rest(tmp_path, suite_root):
    suite = tmp_path / "suite"
    shutil.copytree(suite_root / "tasks" / "csv-column-sum", suite / "tasks" / "good")
    broken = suite / "tasks" / "broken"
    shutil.copytree(suite_root / "tasks" / "csv-column-sum", broken)
    (broken / "task.toml").write_text("this is = = not toml")
    result = harbor_async("run", "-p", str(suite), "-o", str(tmp_path / "jobs"))
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("broken") == 1 and "skipped invalid task" in result.stderr
    assert "1 episodes: mean reward 1.000" in result.stdout


@pytest.mark.slow
def test_cli_tasks_lists_the_suite():
    result = harbor_async("tasks")
    assert result.returncode == 0, result.stderr
    assert "word-frequency" in result.stdout and "csv-group-by" in result.stdout


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_failed_stop_is_the_infrastructures_but_keeps_the_verdict(example_tasks):
    async with Engine(backend_kwargs={"stop_failure_rate": 1.0}) as engine:
        (record,) = await run_suite(engine, example_tasks[:1], "simulated")
    assert record.error_class == "infrastructure" and record.error_phase == "stop"
    assert record.reward == 1.0 and record.rerun  # judged, and the leak still reruns it


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_interruption_after_a_scored_failure_leaves_the_episode_unjudged(example_tasks):
    """The agent failed, then a signal stopped the verifier: no verdict, so not the model's 0."""
    import anyio

    from harbor_async.episodes.runner import run_episode

    done = []
    async with Engine(timeouts=Timeouts(agent=0.2), backend_kwargs={"exec_latency": 1.0, "verify_latency": 30}) as engine:
        with anyio.move_on_after(3):
            await run_episode(engine, example_tasks[0], "simulated", "oracle", on_done=done.append)
    (record,) = done
    assert record.error_class == "cancelled" and record.reward is None and record.rerun
    assert [p.phase for p in record.phases] == ["start", "agent", "verify", "stop"]


#: E2B's SDK hidden from a child process, as where it is not installed (the dev environment has it).
WITHOUT_E2B = {"PYTHONPATH": str(Path(__file__).parent / "missing_packages")}


@pytest.mark.slow
@pytest.mark.range
def test_a_backend_whose_package_is_missing_is_one_line_before_anything_starts(tmp_path) -> None:
    result = harbor_async("run", "-e", "e2b", "-o", str(tmp_path / "jobs"), env=WITHOUT_E2B)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: backend 'e2b' needs the 'e2b' package, which is not installed: pip install 'harbor[e2b]'"]
    assert not (tmp_path / "jobs").exists()  # no job folder, no episode
