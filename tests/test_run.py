"""The main job: the bundled suite through the engine on the local backend, and `harbor-async run`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_async.engine import Engine
from harbor_async.policy import Limits
from harbor_async.runner import run_suite

REPO = Path(__file__).resolve().parents[1]


def harbor_async(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harbor_async", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_oracle_solutions_score_one_on_the_local_backend(example_tasks):
    async with Engine(limits=Limits(live_sandboxes=4)) as engine:
        records = await run_suite(engine, example_tasks, "local", agent="oracle", concurrency=4)
        stats = engine.stats()
    assert len(records) == len(example_tasks) >= 8
    assert [r.task for r in records] == [t.name for t in example_tasks]
    assert {r.task: r.reward for r in records} == {t.name: 1.0 for t in example_tasks}
    assert all(r.error is None for r in records)
    assert stats.peak_live <= 4 and stats.live == 0
    multi = [r for r in records if len(r.rewards) > 1]
    assert multi and all(set(r.rewards) >= {"reward"} for r in multi)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_wrong_or_missing_answers_score_zero(example_tasks):
    by_name = {t.name: t for t in example_tasks}
    async with Engine() as engine:
        async with engine.episode(by_name["csv-column-sum"], "local") as sandbox:
            wrote = await sandbox.exec("echo 1.00 > /workdir/answer.txt && cat /workdir/answer.txt")
            assert wrote.output.strip() == "1.00" and wrote.exit_code == 0
            assert (await sandbox.verify()).reward == 0.0
        records = await run_suite(engine, example_tasks, "local", agent="none", concurrency=4)
    assert all(r.reward == 0.0 for r in records), records


def test_cli_run_writes_records_and_a_table(tmp_path):
    out = tmp_path / "episodes.jsonl"
    result = harbor_async("run", "--concurrency", "4", "--json", str(out))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) >= 8
    assert all(r["reward"] == 1.0 and r["error"] is None for r in records)
    assert all({"start", "agent", "verify", "stop"} <= set(r["seconds"]) for r in records)
    assert "mean reward 1.000" in result.stdout
    assert "csv-column-sum" in result.stdout


def test_cli_run_fails_on_infrastructure_errors(tmp_path):
    out = tmp_path / "episodes.jsonl"
    result = harbor_async(
        "run", "--backend", "tests.broken_backend:FailingStartEnvironment", "-n", "2", "--json", str(out)
    )
    assert result.returncode == 1, result.stderr
    assert "infrastructure failure" in result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    assert all(r["error_kind"] == "infrastructure" and r["error_phase"] == "start" for r in records)
    assert all("disk full" in r["error"] for r in records)


def test_cli_json_logs_carry_phase_events():
    result = harbor_async("run", "-n", "1", "--log-level", "debug", "--log-format", "json")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    phases = {e["phase"] for e in events if e.get("event") == "phase"}
    assert phases >= {"start", "agent", "verify", "stop"}
    assert all({"task", "sandbox", "seconds", "outcome", "start_attempt"} <= set(e) for e in events if e.get("event") == "phase")


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "/no/such/suite"], "does not exist"),
        (["run", "--backend", "dockr"], "unknown backend 'dockr'"),
        (["run", "--backend", "no_such_module:Env"], "cannot be loaded"),
        (["run", "--agent", "claude"], "unknown agent"),
        (["run", "--num-tasks", "2", "--indices", "1"], "not both"),
    ],
)
def test_cli_bad_input_is_a_clear_error(args, message):
    result = harbor_async(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_reports_invalid_tasks_and_runs_the_rest(tmp_path, suite_root):
    suite = tmp_path / "suite"
    shutil.copytree(suite_root / "tasks" / "csv-column-sum", suite / "tasks" / "good")
    broken = suite / "tasks" / "broken"
    shutil.copytree(suite_root / "tasks" / "csv-column-sum", broken)
    (broken / "task.toml").write_text("this is = = not toml")
    result = harbor_async("run", str(suite))
    assert result.returncode == 0, result.stderr
    assert "skipped invalid task" in result.stderr and "broken" in result.stderr
    assert "1 episodes, mean reward 1.000" in result.stdout


def test_cli_tasks_lists_the_suite():
    result = harbor_async("tasks")
    assert result.returncode == 0, result.stderr
    assert "word-frequency" in result.stdout and "csv-group-by" in result.stdout
