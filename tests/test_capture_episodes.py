"""``--capture``: a Harbor agent's model calls recorded through the engine's capture proxy, in real episodes.

terminus-2 runs on real local sandboxes against the scripted model server
(model ``terminus``), which speaks vLLM's token fields when asked: the
trial's ``agent/capture.json`` must hold every call with the server's own
token ids, agree with Harbor's own trajectory of the same episode, and the
record must say so. What cannot be captured is refused before any sandbox.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_helpers import harbor_async, records
from tests.scripted_server import ScriptedServer, chat_ids, token_ids
from tests.test_harbor_agents import echo_suite

pytestmark = pytest.mark.slow  # real sandboxes, a real agent, CLI processes


def _captured_run(
    tmp_path: Path, *extra: str, multi_step: bool = False, model: str = "terminus"
) -> tuple[dict, Path, ScriptedServer]:
    suite = echo_suite(tmp_path / "suite", multi_step=multi_step)
    with ScriptedServer(suite / "tasks") as server:
        result = harbor_async(
            "run", "-p", str(suite), "-a", "terminus-2", "-m", f"hosted_vllm/{model}", "--ak", f"api_base={server.base_url}",
            "--capture", "-o", str(tmp_path / "jobs"), *extra,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (job,) = [p for p in (tmp_path / "jobs").iterdir() if p.is_dir()]
    record = records(job)[0]  # the first attempt's (-k N runs more)
    return record, job / record["trial"], server


def test_run_capture_records_every_call_with_the_servers_tokens(tmp_path: Path, host_tmux: None) -> None:
    record, trial, server = _captured_run(tmp_path)
    assert record["reward"] == 1.0
    assert record["capture"] == {
        "calls": 3, "refused": 0, "retokenize": False, "files": ["agent/capture.json"],
        # terminus-2's own record of its ids (collect_rollout_details, asked by the capture) agrees turn by turn
        "rollout_details": {"turns": 3, "mismatches": 0, "missing": 0},
        # and so does its ATIF trajectory (agent/trajectory.json), step by step
        "trajectory": {"steps": 3, "mismatches": 0},
        "row": record["capture"]["row"],  # below, against the calls
    }  # fmt: skip
    capture = json.loads((trial / "agent" / "capture.json").read_text())
    calls = capture["calls"]
    # The episode as one sequence: the model's tokens (1) and what the terminal and terminus-2 added between calls (0)
    row, answers = capture["row"], [t for call in calls for t in call["completion_token_ids"]]
    assert row["prompt_ids"] == calls[0]["prompt_token_ids"] and (row["calls"], row["dropped"]) == (3, 0)
    assert row["prompt_ids"] + row["completion_ids"] == calls[-1]["prompt_token_ids"] + calls[-1]["completion_token_ids"]
    assert [t for t, m in zip(row["completion_ids"], row["env_mask"], strict=True) if m] == answers
    environment = len(row["env_mask"]) - len(answers)
    assert environment > 0 and record["capture"]["row"] == {
        "calls": 3, "dropped": 0, "model_tokens": len(answers), "environment_tokens": environment,
    }  # fmt: skip
    assert len(calls) == server.requests["terminus"] == 3  # every call of the agent went through the proxy
    for call in calls:
        content = call["reply"]["choices"][0]["message"]["content"]
        assert call["status"] == 200 and call["tokens_from_server"]
        assert call["completion_token_ids"] == token_ids(content)  # the server's own ids, not a re-tokenization
        assert call["prompt_token_ids"] == chat_ids(call["request"]["messages"])
        assert len(call["logprobs"]) == len(call["completion_token_ids"])
        assert call["request"]["return_token_ids"] is True  # terminus-2 asked itself: collect_rollout_details is on
    # Harbor's own trajectory of the same episode: one agent step per captured call, the same answers.
    trajectory = json.loads((trial / "agent" / "trajectory.json").read_text())
    agent_steps = [step for step in trajectory["steps"] if step["source"] == "agent"]
    assert len(agent_steps) == len(calls)
    for step, call in zip(agent_steps, calls):
        answer = json.loads(call["reply"]["choices"][0]["message"]["content"])
        assert step["message"] == f"Analysis: {answer['analysis']}\nPlan: {answer['plan']}"
    first_prompt = next(step["message"] for step in trajectory["steps"] if step["source"] == "user")
    assert calls[0]["request"]["messages"][0]["content"] == first_prompt


def test_a_history_the_template_rewrites_ends_the_row_and_the_trace_counts_the_dropped_calls(
    tmp_path: Path, host_tmux: None
) -> None:
    """A template that drops earlier answers (the server's ``terminus-forgetful``): the second call's prompt does not
    extend the first call's prompt and answer, so the row holds the first call and the record counts two dropped."""
    record, trial, _server = _captured_run(tmp_path, model="terminus-forgetful")
    assert record["reward"] == 1.0 and record["capture"]["calls"] == 3
    calls = json.loads((trial / "agent" / "capture.json").read_text())["calls"]
    first = len(calls[0]["completion_token_ids"])
    assert record["capture"]["row"] == {"calls": 1, "dropped": 2, "model_tokens": first, "environment_tokens": 0}


def test_capture_keeps_each_steps_calls_beside_that_steps_trajectory(tmp_path: Path, host_tmux: None) -> None:
    record, trial, server = _captured_run(tmp_path, multi_step=True)
    assert record["reward"] == 1.0
    assert record["capture"]["files"] == ["steps/first/agent/capture.json", "steps/second/agent/capture.json"]
    per_step = [json.loads((trial / name).read_text())["calls"] for name in record["capture"]["files"]]
    assert [[c["index"] for c in calls] for calls in per_step] == [[0, 1, 2], [3, 4, 5]]
    assert record["capture"]["calls"] == server.requests["terminus"] == 6
    for name, calls in zip(("first", "second"), per_step):
        trajectory = json.loads((trial / "steps" / name / "agent" / "trajectory.json").read_text())
        assert len([s for s in trajectory["steps"] if s["source"] == "agent"]) == len(calls)
        assert f"/app/{'answer' if name == 'first' else 'second'}" in calls[0]["request"]["messages"][0]["content"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "-a", "oracle", "--capture"], "calls no model"),
        (["run", "-e", "docker", "-a", "claude-code", "-m", "anthropic/claude-x", "--capture"], "runs inside the sandbox"),
        (["run", "-a", "terminus-2", "-m", "openai/gpt-x", "--capture"], "calls no OpenAI-compatible server of its own"),
        (["eval", "-a", "bash", "-m", "solver", "--base-url", "http://127.0.0.1:9/v1", "--capture"], "is a tool harness"),
    ],
)
def test_what_cannot_be_captured_is_refused_before_any_sandbox(tmp_path: Path, argv: list[str], said: str) -> None:
    suite = echo_suite(tmp_path / "suite")
    result = harbor_async(*argv, "-p", str(suite), "-o", str(tmp_path / "jobs"))
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert said in result.stderr
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())  # no job folder, no sandbox


def test_export_writes_the_captured_episodes_as_a_datasets_dataset(tmp_path: Path, host_tmux: None) -> None:
    import datasets

    record, trial, _server = _captured_run(tmp_path, "-k", "2")
    job = trial.parent
    result = harbor_async("export", str(job), "-o", str(tmp_path / "data"))
    assert result.returncode == 0, result.stderr
    assert "wrote 2 episodes (6 model calls)" in result.stdout
    rows = datasets.load_from_disk(str(tmp_path / "data"))
    assert len(rows) == 2 and sorted(rows["attempt"]) == [0, 1] and rows["reward"] == [1.0, 1.0]
    assert set(rows["model"]) == {"hosted_vllm/terminus"} and not any(rows["retokenize"])
    for row in rows:
        found = next(r for r in records(job) if r["attempt"] == row["attempt"])
        files = [json.loads((job / found["trial"] / name).read_text())["calls"] for name in found["capture"]["files"]]
        captured = [call for calls in files for call in calls]
        assert [c["completion_token_ids"] for c in row["calls"]] == [c["completion_token_ids"] for c in captured]
        assert [c["prompt_token_ids"] for c in row["calls"]] == [c["prompt_token_ids"] for c in captured]
        assert [json.loads(c["request"]) for c in row["calls"]] == [c["request"] for c in captured]
        # the episode as one sequence: the last call's prompt and answer, the model's own tokens unmasked
        assert row["prompt_ids"] + row["completion_ids"] == captured[-1]["prompt_token_ids"] + captured[-1]["completion_token_ids"]
        assert [t for t, m in zip(row["completion_ids"], row["env_mask"]) if m] == [t for c in captured for t in c["completion_token_ids"]]
        assert 0 in row["env_mask"] and row["dropped_calls"] == 0
    # a job run without --capture: nothing to export, one line, exit 2
    plain = harbor_async("run", "-p", str(job.parent.parent / "suite"), "-a", "oracle", "-o", str(tmp_path / "plain"))
    assert plain.returncode == 0, plain.stderr
    (plain_job,) = [p for p in (tmp_path / "plain").iterdir() if p.is_dir()]
    refused = harbor_async("export", str(plain_job))
    assert refused.returncode == 2 and "none of its episodes was captured (run it with --capture)" in refused.stderr
    assert harbor_async("export", str(tmp_path)).returncode == 2  # not a job folder
