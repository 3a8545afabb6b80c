"""``evaluate``: the bundled suite against the scripted server, on real bubblewrap sandboxes.

The scripted server (tests/scripted_server.py) solves each task with a real
tool call, so rewards must be the verifier's 1.0; its other model names
misbehave on purpose.
"""

from __future__ import annotations

import json

import pytest

from harbor_async import evaluate_sync
from harbor_async.backends.simulated import SimulatedEnvironment
from harbor_async.core.errors import FailureClass
from harbor_async.jobs.folder import JobFolder
from tests.scripted_server import ScriptedServer


@pytest.fixture
def server():
    with ScriptedServer(slow_seconds=2.0) as scripted:
        yield scripted


def _eval(server, tmp_path, models, **kwargs):
    kwargs.setdefault("n_tasks", 2)
    kwargs.setdefault("n_concurrent", 4)
    return evaluate_sync(models, None, base_url=server.base_url, jobs_dir=tmp_path, job_name="job", **kwargs)


@pytest.mark.range
def test_solver_scores_one_and_records_everything(server, tmp_path) -> None:
    result = _eval(server, tmp_path, ["solver"], n_attempts=2)
    assert len(result.records) == 4 and result.ran == 4
    assert [r.reward for r in result.records] == [1.0] * 4
    assert sorted((r.task, r.attempt) for r in result.records) == sorted(
        (t, a) for t in ("count-log-files", "csv-column-sum") for a in (0, 1)
    )
    record = result.records[0]
    assert record.model == "solver" and record.checkpoint == "solver" and record.agent == "bash"
    assert record.finish_reason == "stop" and record.error_class is None
    roles = [m["role"] for m in record.transcript]
    assert roles == ["user", "assistant", "tool", "assistant"]
    call = record.transcript[1]["tool_calls"][0]
    assert call["function"]["name"] == "bash" and "answer.txt" in json.loads(call["function"]["arguments"])["command"]
    assert record.transcript[2]["tool_call_id"] == call["id"]
    assert record.usage["requests"] == 2 and record.usage["total_tokens"] > 0 and record.usage["tool_calls"] == 1
    assert {"start", "verify", "model", "tools", "total"} <= set(record.seconds)
    # Real phase spans, in the order they ran (what the report's timeline draws); "total" is no phase.
    assert [p.phase for p in record.phases] == ["start", "agent", "verify", "stop"]
    assert all(a.end <= b.start + 1e-3 for a, b in zip(record.phases, record.phases[1:]))
    assert record.rewards == {"reward": 1.0}
    # the job folder: config, flushed records, summary
    job = JobFolder.open(result.job_dir)
    assert job.config["models"] == ["solver"] and job.config["command"] == "eval"
    assert len(job.records()) == 4
    summary = json.loads((result.job_dir / "summary.json").read_text())
    assert summary["mean_reward"] == 1.0 and summary["pass_at_k"]["2"]["value"] == 1.0
    assert summary["models"]["solver"]["episodes"] == 4


@pytest.mark.range
def test_prompt_and_tools_are_the_training_ones(server, tmp_path) -> None:
    """The user message is instruction + PROMPT_SUFFIX, and the harness's tools are offered."""
    from harbor_async.tasks.suite import load_suite
    from shim.harnesses import HarborTerminalEnv

    result = _eval(server, tmp_path, ["solver"], agent="terminal", n_tasks=1)
    task = load_suite(None).tasks[0]
    record = result.records[0]
    assert record.reward == 1.0
    assert record.transcript[0] == {"role": "user", "content": task.instruction + HarborTerminalEnv.PROMPT_SUFFIX}
    assert record.transcript[1]["tool_calls"][0]["function"]["name"] == "run"
    names = ["list_background", "read_notes", "read_output", "run", "start_background", "stop_background", "write_note"]
    # the schemas themselves are compared with the installed GRPOTrainer's in tests/test_trl_api.py
    assert [t["function"]["name"] for t in server.tools["solver"]] == names


def test_malformed_arguments_and_unknown_tool_go_back_to_the_model(server, tmp_path) -> None:
    result = _eval(server, tmp_path, ["misbehave"], n_tasks=1)
    record = result.records[0]
    tool_texts = [m["content"] for m in record.transcript if m["role"] == "tool"]
    assert tool_texts[0].startswith("{'error': 'Invalid JSON in the arguments of tool bash")
    assert tool_texts[1] == "{'error': 'Tool no_such_tool not found.'}"
    assert record.usage["tool_failures"] == 2 and record.usage["tool_calls"] == 3
    assert record.reward == 1.0 and record.error_class is None


@pytest.mark.slow
@pytest.mark.range
@pytest.mark.parametrize("model", ["flaky-429", "flaky-500"])
def test_transient_server_errors_are_retried(server, tmp_path, model) -> None:
    result = _eval(server, tmp_path, [model], n_tasks=1, limits={"retry_max_wait": 0.2})
    record = result.records[0]
    assert record.reward == 1.0 and record.error_class is None
    assert record.usage["retries"] == 2 and record.usage["requests"] == 4


@pytest.mark.range
def test_a_server_that_keeps_failing_is_a_model_server_failure(server, tmp_path) -> None:
    result = _eval(server, tmp_path, ["always-500"], n_tasks=1, limits={"retries": 2, "retry_max_wait": 0.1})
    record = result.records[0]
    assert record.failure is FailureClass.MODEL_SERVER and record.rerun
    assert record.reward is None and "HTTP 500" in record.error
    assert record.usage["requests"] == 3
    assert result.summary["failures"] == {"model_server": 1}
    assert result.summary["mean_reward"] is None and result.summary["not_judged"] == 1  # not a 0.000


@pytest.mark.range
def test_context_overflow_ends_the_episode_and_it_is_scored(server, tmp_path) -> None:
    record = _eval(server, tmp_path, ["context"], n_tasks=1).records[0]
    assert record.finish_reason == "context_length" and record.error_class is None
    assert record.reward == 1.0  # the solution ran before the overflow


@pytest.mark.slow
def test_limits_end_the_loop(server, tmp_path) -> None:
    turns = _eval(server, tmp_path / "a", ["misbehave"], n_tasks=1, limits={"max_turns": 1}).records[0]
    assert turns.finish_reason == "max_turns" and turns.reward == 0.0 and turns.error_class is None
    tokens = _eval(server, tmp_path / "b", ["solver"], n_tasks=1, limits={"max_total_tokens": 10}).records[0]
    assert tokens.finish_reason == "max_total_tokens" and tokens.reward == 1.0
    slow = _eval(server, tmp_path / "c", ["slow"], n_tasks=1, limits={"timeout": 0.5}).records[0]
    assert slow.finish_reason == "agent_timeout" and slow.failure is FailureClass.AGENT
    assert slow.reward == 0.0  # judged: the verifier found no answer
    late = _eval(server, tmp_path / "d", ["slow"], n_tasks=1, episode_timeout=4.0).records[0]
    assert late.finish_reason == "episode_deadline" and late.failure is FailureClass.AGENT
    assert late.reward == 0.0 and "4 s deadline" in late.error


def test_quitter_scores_zero(server, tmp_path) -> None:
    record = _eval(server, tmp_path, ["quitter"], n_tasks=1).records[0]
    assert record.reward == 0.0 and record.finish_reason == "stop" and record.error_class is None


def test_a_harness_from_a_file_and_a_seed_per_attempt(server, tmp_path) -> None:
    harness = tmp_path / "my_harness.py"
    harness.write_text(
        "from shim import HarborEnv\n\n\n"
        "class Shell(HarborEnv):\n"
        "    PROMPT_SUFFIX = '\\n\\nUse the shell tool.'\n\n"
        "    def shell(self, command: str) -> str:\n"
        '        """\n        Run a command.\n\n        Args:\n            command: The command.\n        """\n'
        "        return self._exec(command)\n"
    )
    result = _eval(
        server,
        tmp_path / "jobs",
        ["solver"],
        agent=f"{harness}:Shell",
        n_tasks=1,
        n_attempts=2,
        sampling={"seed": 7, "temperature": 0.5},
    )
    assert [r.reward for r in result.records] == [1.0, 1.0]
    assert result.records[0].transcript[0]["content"].endswith("\n\nUse the shell tool.")
    assert [t["function"]["name"] for t in server.tools["solver"]] == ["shell"]
    assert server.seeds == {7, 8}


@pytest.mark.slow
def test_attempts_running_at_once_keep_their_own_seed(server, tmp_path) -> None:
    # "slow" holds every reply 2 s, so both attempts' conversations are open at once on one shared agent.
    result = _eval(server, tmp_path / "jobs", ["slow"], n_tasks=1, n_attempts=2, sampling={"seed": 7})
    assert [r.reward for r in result.records] == [1.0, 1.0]
    # Each conversation's two requests (before and after its tool call) carry its attempt's seed.
    assert sorted(server.seed_turns) == [(0, 7), (0, 8), (1, 7), (1, 8)]


def test_a_bad_harness_is_refused_before_any_job_folder(server, tmp_path) -> None:
    from harbor_async.core.errors import EvalConfigError

    with pytest.raises(EvalConfigError, match="no_such_module"):
        _eval(server, tmp_path, ["solver"], agent="no_such_module:Cls")
    assert not (tmp_path / "job").exists()


class AnswerExecFailsEnvironment(SimulatedEnvironment):
    """A simulated sandbox whose backend cannot run the command that writes the answer (a lost connection)."""

    async def exec(self, command: str, *args, **kwargs):
        if "answer.txt" in command and "/tests/" not in command:
            raise ConnectionResetError("simulated: connection to the sandbox lost")
        return await super().exec(command, *args, **kwargs)


def test_sandbox_failures_are_infrastructure_not_scored(server, tmp_path) -> None:
    start = _eval(
        server, tmp_path / "a", ["solver"], n_tasks=1, environment_type="tests.broken_backend:FailingStartEnvironment"
    )
    record = start.records[0]
    assert record.failure is FailureClass.INFRASTRUCTURE and record.error_phase == "start"
    assert record.reward is None and record.rerun and record.transcript is None
    assert server.requests["solver"] == 0  # the model is not asked about a sandbox that never started

    execs = _eval(server, tmp_path / "b", ["solver"], n_tasks=1, environment_type=f"{__name__}:AnswerExecFailsEnvironment")
    record = execs.records[0]
    assert record.failure is FailureClass.INFRASTRUCTURE and record.error_phase == "exec"
    assert record.reward is None and "could not be run" in record.transcript[2]["content"]


def test_api_key_comes_from_the_named_variable(server, tmp_path, monkeypatch) -> None:
    from harbor_async.core.errors import EvalConfigError

    monkeypatch.delenv("EVAL_TEST_KEY", raising=False)
    with pytest.raises(EvalConfigError, match="EVAL_TEST_KEY is not set"):
        _eval(server, tmp_path, ["solver"], api_key_name="EVAL_TEST_KEY")
    assert not (tmp_path / "job").exists()
    monkeypatch.setenv("EVAL_TEST_KEY", "sekret")
    result = _eval(server, tmp_path, ["solver"], n_tasks=1, api_key_name="EVAL_TEST_KEY")
    assert result.records[0].reward == 1.0 and server.auth == {"Bearer sekret"}
    assert "sekret" not in (result.job_dir / "harbor-async.json").read_text()


def test_task_name_globs_select_as_harbor_run_does(server, tmp_path) -> None:
    result = _eval(server, tmp_path, ["solver"], n_tasks=None, include=["csv-*"], exclude=["csv-group-by"])
    tasks = sorted({r.task for r in result.records})
    assert tasks and all(t.startswith("csv-") for t in tasks) and "csv-group-by" not in tasks
    assert [r.reward for r in result.records] == [1.0] * len(result.records)


@pytest.mark.slow
def test_the_names_of_the_previous_release_still_work(server, tmp_path) -> None:
    with pytest.warns(DeprecationWarning, match=r"attempts= is deprecated; use n_attempts="):
        result = evaluate_sync(
            ["solver"], None, base_url=server.base_url, jobs_dir=tmp_path, job_name="old", num_tasks=1, attempts=2
        )
    assert len(result.records) == 2 and JobFolder.open(result.job_dir).config["n_attempts"] == 2
    # a job folder of the previous release (flat config.json, its names) resumes with its settings
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({
        "command": "eval", "models": ["solver"], "suite": None, "agent": "bash", "backend": "local", "attempts": 2,
        "concurrency": 2, "num_tasks": 1, "base_url": server.base_url, "backend_kwargs": {},
    }))  # fmt: skip
    (legacy / "episodes.jsonl").write_text(json.dumps(result.records[0].to_dict()) + "\n")
    resumed = evaluate_sync(resume=legacy)
    assert resumed.ran == 1 and len(resumed.records) == 2 and [r.reward for r in resumed.records] == [1.0, 1.0]


def test_a_sync_tool_reaches_the_sandbox_from_its_own_threads(server, tmp_path) -> None:
    """A harness may call _exec from a thread pool of its own, as in training (not only anyio's worker threads)."""
    harness = tmp_path / "pooled.py"
    harness.write_text(
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from shim import HarborEnv\n\n\n"
        "class Pooled(HarborEnv):\n"
        "    def bash(self, command: str) -> str:\n"
        '        """\n        Run a command.\n\n        Args:\n            command: The command.\n        """\n'
        "        with ThreadPoolExecutor(1) as pool:\n"
        "            return pool.submit(self._exec, command).result()\n"
    )
    result = _eval(server, tmp_path / "jobs", ["solver"], agent=f"{harness}:Pooled", n_tasks=1)
    assert [r.reward for r in result.records] == [1.0]


@pytest.mark.range
def test_evaluate_runs_under_trio(server, tmp_path) -> None:
    """The core is anyio: evaluate() on trio with an anyio-native backend, its interrupt policy armed on trio."""
    import anyio

    from harbor_async import evaluate

    async def main():
        return await evaluate(
            ["solver"], None, base_url=server.base_url, jobs_dir=tmp_path, job_name="trio", n_tasks=1
        )

    result = anyio.run(main, backend="trio")
    assert [r.reward for r in result.records] == [1.0]
