"""One orchestration for `run` and `eval`: records written from each episode's own finally, one failure
budget, and a resume that runs the job as it was started.

Real processes, real local sandboxes and the scripted OpenAI-compatible server on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import anyio
import pytest

from harbor_async.core.errors import (
    FailureClass,
    ModelServerDownError,
    ModelServerRefusedError,
    ResumeConflictError,
)
from harbor_async.core.records import EpisodeRecord
from harbor_async.engine.engine import Engine
from harbor_async.episodes.runner import FailureBudget, PlannedEpisode, run_suite
from harbor_async.jobs.folder import JobFolder
from harbor_async.jobs.settings import JobSettings
from harbor_async.tasks.suite import load_suite
from tests.scripted_server import ScriptedServer

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.uvloop_pass  # .ci/run runs these again on uvloop


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harbor_async", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


def _failed(model_server: bool, error_type: str = "ModelServerError") -> EpisodeRecord:
    record = EpisodeRecord(task="t")
    if model_server:
        record.error_class, record.error_type, record.error = FailureClass.MODEL_SERVER.value, error_type, "HTTP 500"
    return record


def test_the_failure_budget_counts_model_server_failures_in_a_row(tmp_path: Path) -> None:
    budget = FailureBudget(3, "http://server/v1", tmp_path)
    assert not budget.observe(_failed(True)) and not budget.observe(_failed(True))
    assert not budget.observe(_failed(False))  # a judged episode: the server served it
    assert not budget.observe(_failed(True)) and not budget.observe(_failed(True))
    cancelled = EpisodeRecord(task="t", error_class=FailureClass.CANCELLED.value)
    assert not budget.observe(cancelled)  # not judged, not the server's: the count goes on
    assert budget.observe(_failed(True))
    assert isinstance(budget.error, ModelServerDownError) and budget.error.failures == 3
    assert "http://server/v1" in str(budget.error)
    assert not budget.observe(_failed(True))  # says stop once


def test_a_refused_request_stops_at_once_and_never_is_off(tmp_path: Path) -> None:
    budget = FailureBudget(0, "http://server/v1", tmp_path)
    for _ in range(20):  # 0: transient failures never stop the run
        assert not budget.observe(_failed(True))
    assert budget.observe(_failed(True, "ModelServerConfigError"))  # a wrong key, model or URL: at once
    assert isinstance(budget.error, ModelServerRefusedError) and "refused" in str(budget.error)


def test_run_suite_stops_on_the_budget_and_records_the_episodes_it_cancelled(tmp_path: Path) -> None:
    """The batch is cancelled when the budget says stop; every episode that began has its record."""
    tasks = load_suite(None).tasks
    seen: list[EpisodeRecord] = []

    class ServerDown:
        name = "down"

        async def setup(self, episode) -> None:
            pass

        async def act(self, episode) -> None:
            if episode.record.attempt == 0:
                from harbor_async.core.errors import ModelServerError

                episode.fail_with(ModelServerError("HTTP 500"), "model")
            else:
                await anyio.sleep(60)  # a slow episode, still running when the run stops

    budget = FailureBudget(2, "http://server/v1", tmp_path)
    planned = [PlannedEpisode(t, a) for t in tasks[:2] for a in range(3)]

    async def main() -> float:
        start = anyio.current_time()
        async with Engine() as engine:
            await run_suite(engine, planned, "simulated", agent=ServerDown(), concurrency=6, on_done=seen.append, budget=budget)
        return anyio.current_time() - start

    took = anyio.run(main)
    assert took < 30  # not the slow episodes' 60 s
    assert isinstance(budget.error, ModelServerDownError)
    assert len(seen) == len(planned)  # each began (6 slots) and each has its record
    classes = sorted(r.error_class for r in seen)
    assert classes == ["cancelled"] * 4 + ["model_server"] * 2


@pytest.mark.slow
def test_sigint_during_eval_records_every_started_episode(tmp_path: Path) -> None:
    """Ctrl-C mid-conversation: each started episode is recorded as cancelled and counted as not judged."""
    with ScriptedServer(slow_seconds=20) as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "harbor_async", "eval", "-m", "slow", "--base-url", server.base_url, "-e", "local",
             "-l", "4", "-n", "4", "-o", str(tmp_path), "--job-name", "j"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while server.requests["slow"] < 4:  # every episode is waiting on its first reply
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    records = JobFolder.open(tmp_path / "j").records()
    assert len(records) == 4 and {r.error_class for r in records} == {"cancelled"}, [r.error_class for r in records]
    summary = json.loads((tmp_path / "j" / "summary.json").read_text())
    assert summary["not_judged"] == 4 and summary["interrupted_by"] == "SIGINT"


def _overlap(records: list[EpisodeRecord]) -> int:
    """The most episodes that were running at one moment."""
    events = []
    for r in records:
        events += [(datetime.fromisoformat(r.started_at), 1), (datetime.fromisoformat(r.finished_at), -1)]
    most = now = 0
    for _, step in sorted(events):
        now += step
        most = max(most, now)
    return most


@pytest.mark.slow
def test_a_resume_with_no_flags_runs_the_rest_as_stored(tmp_path: Path) -> None:
    """Started with -n 2 and --strict-verify, interrupted: the resume runs the rest two at a time, strictly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "harbor_async", "run", "-e", "simulated", "--ek", "start_latency=1.0", "-n", "2",
         "--strict-verify", "-k", "3", "-o", str(tmp_path), "--job-name", "j", "-q"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    episodes = tmp_path / "j" / "episodes.jsonl"
    deadline = time.monotonic() + 120
    while not (episodes.exists() and len(episodes.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    before = {r.key for r in JobFolder.open(tmp_path / "j").records() if not r.rerun}

    conflict = _cli("run", "--resume", str(tmp_path / "j"), "-k", "2")
    assert conflict.returncode == 2 and conflict.stderr.count("\n") == 1, conflict.stderr
    assert "--n-attempts=3" in conflict.stderr and "--n-attempts=2" in conflict.stderr
    loose = _cli("run", "-e", "simulated", "-l", "1", "--no-strict-verify", "-o", str(tmp_path), "--job-name", "loose", "-q")
    assert loose.returncode == 0, loose.stderr[-2000:]
    stricter = _cli("run", "--resume", str(tmp_path / "loose"), "--strict-verify")  # was accepted and ignored
    assert stricter.returncode == 2 and "--strict-verify=False" in stricter.stderr, stricter.stderr

    same = _cli("run", "--resume", str(tmp_path / "j"), "-k", "3")  # equal to the stored value: accepted
    assert same.returncode == 0, same.stderr[-2000:]
    latest = JobFolder.open(tmp_path / "j").latest()
    assert len(latest) == 30 and all(r.judged for r in latest.values())
    resumed = [r for k, r in latest.items() if k not in before]
    assert len(resumed) >= 10 and _overlap(resumed) == 2  # the stored -n 2 (the flag's default is 8)
    assert JobSettings.from_dict(JobFolder.open(tmp_path / "j").config).strict_verify


def test_stored_settings_refuse_a_conflicting_value_and_take_the_server_s_new_place() -> None:
    stored = JobSettings(command="eval", n_attempts=2, ray=True, base_url="http://old/v1", models=["m"])
    assert stored.resumed({"n_attempts": 2, "ray": True}) == stored
    with pytest.warns(DeprecationWarning):  # earlier names work too, with a warning
        moved = stored.resumed({"base_url": "http://new/v1", "attempts": 2, "concurrency": 16})
    assert moved.base_url == "http://new/v1" and moved.ray and moved.n_concurrent == 16  # -n may change: same results
    with pytest.raises(ResumeConflictError) as caught:
        stored.resumed({"ray": False})
    assert caught.value.stored is True and caught.value.given is False
    with pytest.raises(TypeError):
        stored.resumed({"no_such_setting": 1})


def test_every_run_option_is_classified_for_a_resume() -> None:
    """A new flag of `run` must say whether a resume stores it, compares it or takes it as given."""
    import inspect

    from harbor_async.cli import run as run_cli

    classified = run_cli._INVOCATION_OPTIONS | run_cli._PLAN_OPTIONS | set(run_cli._SETTING_OF) | run_cli._CONVERTED_OPTIONS
    assert set(inspect.signature(run_cli.run).parameters) <= classified
    fields = set(JobSettings.model_fields)
    assert set(run_cli._SETTING_OF.values()) <= fields


@pytest.mark.slow
def test_eval_resume_checks_what_was_typed_against_the_stored_job(tmp_path: Path) -> None:
    """Typed flags are checked (a conflict is one line, exit 2); untyped defaults do not override the job."""
    with ScriptedServer() as server:
        common = ("--base-url", server.base_url)
        first = _cli("eval", "-m", "solver", *common, "-e", "simulated", "-l", "2", "-n", "2", "--temperature", "0.5",
                     "-o", str(tmp_path), "--job-name", "j")  # fmt: skip
        assert first.returncode == 0, first.stderr[-2000:]
        job = str(tmp_path / "j")
        for flags, stored, typed in ((["-k", "3"], "n_attempts=1", "n_attempts=3"), (["--temperature", "0.7"], "0.5", "0.7")):
            refused = _cli("eval", "--resume", job, *flags)
            assert refused.returncode == 2, refused.stderr[-2000:]
            assert stored in refused.stderr and typed in refused.stderr and "Traceback" not in refused.stderr
        again = _cli("eval", "--resume", job, "-n", "2", "--base-url", server.base_url)  # equal, and the server's place
        assert again.returncode == 0, again.stderr[-2000:]
    config = JobSettings.from_dict(JobFolder.open(job).config)
    assert config.n_concurrent == 2 and config.sampling.temperature == 0.5


@pytest.mark.slow
def test_one_task_selection_for_run_eval_and_the_shim(tmp_path: Path) -> None:
    """Globs first, then the first N: the same tasks whichever entry point selects them."""
    import shim
    from harbor_async.suites import example_suite_path
    from harbor_async.tasks.suite import NoMatchingTaskError

    names = [t.name for t in load_suite(None).tasks]
    pick = dict(include=["c*", "*-*"], exclude=["csv-*"], num_tasks=2)
    expected = [n for n in names if not n.startswith("csv-")][:2]
    assert [t.name for t in load_suite(None, **pick).tasks] == expected
    spec = shim.HarborSpec(example_suite_path(), environment_type="simulated", preflight=False, **pick)
    assert [Path(row["task_dir"]).name for row in spec.train_dataset] == expected
    done = _cli("tasks", "-i", "c*", "-i", "*-*", "-x", "csv-*", "-l", "2")
    assert done.returncode == 0 and all(name in done.stdout for name in expected), done.stderr
    with pytest.raises(NoMatchingTaskError, match="no task of"):
        load_suite(None, include=["no-such-*"])
    refused = _cli("run", "-e", "simulated", "-i", "no-such-*", "-o", str(tmp_path))
    assert refused.returncode == 2 and "no task of" in refused.stderr and "no-such-*" in refused.stderr


@pytest.mark.slow
def test_run_with_a_harbor_agent_stops_on_a_refused_key_as_eval_does(tmp_path: Path, host_tmux: None) -> None:
    """`run -a terminus-2` whose server refuses the key: one episode, then the run stops (exit 3), records kept."""
    from harbor_async.suites import example_suite_path
    with ScriptedServer(api_key="right") as server:
        done = _cli(
            "run", "-p", str(example_suite_path()), "-l", "4", "-n", "1", "-e", "local", "-a", "terminus-2",
            "-m", "hosted_vllm/terminus", "--ak", f"api_base={server.base_url}", "--ak", 'llm_kwargs={"api_key": "wrong"}',
            "-o", str(tmp_path), "--job-name", "j",
        )  # fmt: skip
        asked = server.requests["terminus"]
    assert done.returncode == 3, done.stderr[-3000:]
    assert "refused" in done.stderr and server.base_url in done.stderr and "--resume" in done.stderr
    records = JobFolder.open(tmp_path / "j").records()
    assert [r.error_type for r in records if r.error_class == "model_server"] == ["ModelServerConfigError"]
    assert len(records) < 4 and asked >= 1  # it stopped: the other tasks never reached the server
    summary = json.loads((tmp_path / "j" / "summary.json").read_text())
    assert "refused" in summary["stopped_by"] and summary["completed"] == 0


def test_one_agent_budget_for_every_agent_and_every_step(tmp_path: Path) -> None:
    """An agent's own timeout bounds each step of a multi-step task; without one, each step's [agent] budget does."""
    from tests.test_harbor_agents import echo_suite

    task = load_suite(echo_suite(tmp_path, multi_step=True)).tasks[0]  # [agent] timeout_sec = 120

    class Seen:
        def __init__(self, name: str, timeout: float | None) -> None:
            self.name, self.timeout, self.budgets = name, timeout, []

        async def setup(self, episode) -> None:
            pass

        async def act(self, episode) -> None:
            self.budgets.append(episode.agent_budget)

    own, tasks = Seen("own", 7.0), Seen("tasks", None)

    async def main() -> None:
        async with Engine() as engine:
            for agent in (own, tasks):
                await run_suite(engine, [task], "simulated", agent=agent)

    anyio.run(main)
    assert own.budgets == [7.0, 7.0]  # not replaced by the steps' own
    assert tasks.budgets == [120.0, 120.0]


def test_every_shim_rollout_reaches_its_job_folder_even_one_whose_launch_failed(tmp_path: Path) -> None:
    """A rollout whose sandbox never launched (a task variable not allowed) is recorded in job_dir too."""
    import shim
    from tests.test_task_env import _task

    bare = _task(tmp_path / "suite", "needs-secret", "${HARBOR_TEST_SECRET}")  # not allowed: the launch fails
    good = _task(tmp_path / "suite", "fine", "${HARBOR_TEST_SECRET:-fallback}")
    env = shim.HarborBashEnv("simulated", job_dir=tmp_path / "shim")
    try:
        rewards = []
        for task in (bare, good, bare):
            env.reset(task_dir=str(task))
            rewards.append(env.reward)
    finally:
        env.close()
    records = JobFolder.open(tmp_path / "shim").records()
    assert [(r.task, r.error_class) for r in records] == [
        ("needs-secret", "infrastructure"), ("fine", None), ("needs-secret", "infrastructure")
    ]
    assert rewards == [None, 1.0, None]


def test_a_glob_given_as_one_string_is_one_glob() -> None:
    names = [t.name for t in load_suite(None, include="csv-*").tasks]
    assert names and all(n.startswith("csv-") for n in names)


def test_the_slot_wait_and_the_start_retries_are_settable_as_every_other_limit() -> None:
    """The shim's options and a job's settings build the same engine knobs, with the engine's own defaults."""
    from harbor_async.core.policy import RetryPolicy, Timeouts
    from shim.options import EngineOptions

    knobs = dict(slot_timeout=2.5, start_attempts=4, start_retry_wait=0.2, start_retry_max_wait=1.0, start_retry_max_total=None)
    for built in (EngineOptions(**knobs).engine_kwargs(), JobSettings(**knobs).engine_kwargs()):
        assert built["timeouts"].slot == 2.5 and built["retry"] == RetryPolicy(4, 0.2, 1.0, None)
    for built in (EngineOptions().engine_kwargs(), JobSettings().engine_kwargs()):
        assert built["timeouts"].slot == Timeouts().slot and built["retry"] == RetryPolicy()
    with pytest.raises(Exception, match="start_retry_wait"):
        EngineOptions(start_retry_wait=0)


def test_the_shim_drives_the_core_episode_through_the_same_methods(tmp_path: Path) -> None:
    """A shim rollout is the core Episode itself (no subclass), begun, used, verified once and stopped as run's is."""
    import ast

    import shim
    from harbor_async.episodes.episode import Episode
    from harbor_async.episodes.runner import run_episode
    from tests.test_shim import CSV_SUM, CountingVerify

    root = Path(__file__).resolve().parents[1] / "shim"
    for path in root.rglob("*.py"):  # no episode of the shim's own: the driver is the core's
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(base).rsplit(".", 1)[-1] for base in node.bases}
                assert "Episode" not in bases, f"{path.name}: {node.name} subclasses Episode"

    env = shim.HarborBashEnv("simulated", environment_kwargs={"verify_latency": 0.2, "reward": 0.5})
    try:
        env.reset(task_dir=CSV_SUM)
        assert type(env._episode) is Episode
        assert env.bash("true").startswith("(empty output")
        counter = CountingVerify()
        with pytest.MonkeyPatch.context() as patch:
            counter.install(patch)
            assert env.reward == 0.5 and env.reward == 0.5 and counter.calls == 1  # verified once, then read
    finally:
        env.close()
    shim_record = env.record

    async def direct() -> EpisodeRecord:
        async with Engine() as engine:
            task = load_suite(None, include="csv-column-sum").tasks[0]
            return await run_episode(engine, task, "simulated", "none")

    run_record = anyio.run(direct)
    assert shim_record is not None and shim_record.reward == 0.5
    assert [p.phase for p in shim_record.phases] == [p.phase for p in run_record.phases] == [
        "start", "agent", "verify", "stop"
    ]


def test_retire_before_begin_and_during_the_start_records_an_interrupted_episode() -> None:
    """The core's retire(): a start cancelled by it is recorded as cancelled (not judged), whoever drives it."""
    import anyio.lowlevel

    from harbor_async.backends import resolve_backend
    from harbor_async.episodes.episode import Episode

    task = load_suite(None, include="csv-column-sum").tasks[0]

    async def main() -> list[EpisodeRecord]:
        records: list[EpisodeRecord] = []
        async with Engine() as engine:
            early = Episode(engine, task, resolve_backend("simulated"), on_done=records.append)
            early.retire()
            assert not await early.begin()
            slow = Episode(
                engine, task, resolve_backend("simulated"), backend_kwargs={"start_latency": 30}, on_done=records.append
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(slow.begin)
                while slow.sandbox is None:  # launched: its 30 s start is in progress
                    await anyio.lowlevel.checkpoint()
                slow.retire()
            assert await slow.verify() is None and slow.verified
            await slow.stop()
        return records

    records = anyio.run(main)
    assert [(r.error_class, r.reward, r.judged) for r in records] == [("cancelled", None, False)] * 2
