"""HarborGRPOTrainer against GRPOTrainer on the same scripted generations, with real bubblewrap sandboxes.

One GRPO step of 4 rollouts (2 tasks x 2 generations) with mixed tool use:
a rollout with no tool call; a rollout with five calls in one turn whose
effects depend on each other (a file written by one call and read by the next,
an async call that reads what the sync calls wrote, a tool that raises, a tool
that does not exist); a rollout whose first command is slow; a rollout whose
command is fast. Both trainers must produce the same prompts, completions,
tool messages, masks, token ids and rewards; only HarborGRPOTrainer may run
different rollouts' calls at the same time.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import copy
import json
import re
import threading
import time
import warnings
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

import shim
from benchmarks.tiny_model import build_tiny_qwen3, encode_exact
from harbor_async.cli.machine_checks import SUPPORTED, TESTED
from harbor_async.suites import example_suite_path
from shim import engines
from shim.trainer import (
    FAILED_KEY,
    SUPPORTED_TRL,
    HarborGRPOTrainer,
    UnsupportedTRLVersionError,
    check_trl_version,
)
from tests.test_shim_grpo import _grpo_args

pytestmark = [pytest.mark.slow, pytest.mark.trl_api, pytest.mark.one_worker]  # a real trainer; .ci/range trains
# on both ends of TRL's range (the group: one worker builds the module's model)

INDICES = [1, 3]  # csv-column-sum, csv-max-price: tasks with a gold answer
MARKER = re.compile(r"\[r(\d)\]")

#: (start, end, env id, tool, argument) of every tool call, in the order they finished.
CALLS: list[tuple[float, float, int, str, str]] = []
_CALLS_LOCK = threading.Lock()


def _record(env: object, tool: str, argument: str, start: float) -> None:
    with _CALLS_LOCK:
        CALLS.append((start, time.monotonic(), id(env), tool, argument))


class MixedHarness(shim.HarborEnv):
    """A sync tool, an async tool and a tool that always raises."""

    def bash(self, command: str) -> str:
        """
        Run a shell command in the sandbox.

        Args:
            command: The shell command to run.

        Returns:
            The command's output.
        """
        start = time.monotonic()
        try:
            return self._exec(command)
        finally:
            _record(self, "bash", command, start)

    async def slow_bash(self, command: str) -> str:
        """
        Run a shell command in the sandbox, asynchronously.

        Args:
            command: The shell command to run.

        Returns:
            The command's output.
        """
        start = time.monotonic()
        try:
            return await self._aexec(command)
        finally:
            _record(self, "slow_bash", command, start)

    def fail(self, reason: str) -> str:
        """
        A tool that always fails.

        Args:
            reason: Why.

        Returns:
            Nothing: it raises.
        """
        _record(self, "fail", reason, time.monotonic())
        raise RuntimeError(f"tool failed on purpose: {reason}")


def _calls(*calls: tuple[str, dict]) -> str:
    return "".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>" for name, arguments in calls
    )


def _answer(gold: str) -> str:
    return f"printf '%s' '{gold}' > /workdir/answer.txt"


def scripts(golds: list[str]) -> list[list[str]]:
    """Each rollout's assistant turns (row k's turns carry the marker ``[rk]``)."""
    return [
        ["No tool needed. [r0]<|im_end|>"],
        [
            "Several at once. [r1]\n"
            + _calls(
                ("slow_bash", {"command": "sleep 0.3; cat /workdir/note"}),
                ("bash", {"command": "echo one > /workdir/note"}),
                ("bash", {"command": "cat /workdir/note; echo two >> /workdir/note"}),
                ("fail", {"reason": "boom"}),
                ("nope", {"x": 1}),
            )
            + "<|im_end|>",
            "Now submit. [r1]\n" + _calls(("bash", {"command": _answer(golds[0])})) + "<|im_end|>",
            "Done. [r1]<|im_end|>",
        ],
        [
            "Slow look. [r2]\n" + _calls(("bash", {"command": "sleep 0.6; ls /workdir"})) + "<|im_end|>",
            "Submit. [r2]\n" + _calls(("bash", {"command": _answer(golds[1])})) + "<|im_end|>",
            "Done. [r2]<|im_end|>",
        ],
        [
            "Fast look. [r3]\n" + _calls(("bash", {"command": "ls /workdir"})) + "<|im_end|>",
            "Giving up. [r3]<|im_end|>",
        ],
    ]


class ScriptedTurns:
    """``model.generate`` stand-in: row k of the first call, then by marker, gets its next scripted turn."""

    def __init__(self, tokenizer, turns: list[list[str]]) -> None:
        self.tokenizer = tokenizer
        self.turns = [[encode_exact(tokenizer, text) for text in row] for row in turns]

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        pad = self.tokenizer.pad_token_id
        rows = []
        for i, row in enumerate(input_ids.tolist()):
            text = self.tokenizer.decode([t for t in row if t != pad])
            seen = MARKER.findall(text)
            k = int(seen[0]) if seen else i % len(self.turns)
            rows.append(self.turns[k][len(seen)])
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=input_ids.device)
        return torch.cat([input_ids, completion], dim=-1)


def grpo_args(out: Path, max_steps: int = 1, batch: int = 4, generations: int = 2) -> GRPOConfig:
    return _grpo_args(out, max_steps, batch, generations, completion=1024)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    warnings.filterwarnings("ignore", category=UserWarning)
    corpus = [text for row in scripts(["0", "0"]) for text in row]
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), corpus=corpus)


def _run_one_step(trainer_cls, tmp_path: Path, tiny_model) -> dict:
    """One training step; what the step produced, for comparison."""
    model_dir, tokenizer = tiny_model
    spec = shim.HarborSpec(example_suite_path(), agent=MixedHarness, environment_type="local", indices=INDICES)
    golds = list(spec.train_dataset["gold_answer"])
    trainer = trainer_cls(
        model=str(model_dir),
        processing_class=tokenizer,
        args=grpo_args(tmp_path / trainer_cls.__name__),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )
    outputs = []
    inner = trainer._generate_and_score_completions

    def recording(inputs):
        output = inner(inputs)
        outputs.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in output.items()})
        return output

    trainer._generate_and_score_completions = recording
    conversations = []
    inner_loop = trainer._tool_call_loop

    def recording_loop(*args):  # the conversations as the tool loop leaves them (TRL < 1.16 logs decoded text)
        result = inner_loop(*args)
        conversations.append(copy.deepcopy(result[1]))
        return result

    trainer._tool_call_loop = recording_loop
    CALLS.clear()
    try:
        with patch.object(trainer.model, "generate", side_effect=ScriptedTurns(tokenizer, scripts(golds))):
            trainer.train()
        env_rows = {id(env): row for row, env in enumerate(trainer.environments)}
    finally:
        spec.close()
    (output,) = outputs
    return {
        "output": output,
        "prompts": list(trainer._logs["prompt"]),
        "completions": list(trainer._logs["completion"]),
        "conversations": conversations[0],
        "rewards": {k: list(v) for k, v in trainer._logs["rewards"].items()},
        "history": trainer.state.log_history,
        "calls": [(start, end, env_rows[env], tool, arg) for start, end, env, tool, arg in CALLS],
        "golds": golds,
    }


def _overlapping_rows(calls) -> bool:
    """Whether calls of two different rollouts ever ran at the same time."""
    return any(a[2] != b[2] and a[0] < b[1] and b[0] < a[1] for i, a in enumerate(calls) for b in calls[i + 1 :])


def test_same_step_as_grpo_trainer_with_rollouts_run_at_once(tmp_path: Path, tiny_model, leak_probe) -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    bwrap_before = leak_probe.bwrap_pids()
    plain = _run_one_step(GRPOTrainer, tmp_path, tiny_model)
    harbor = _run_one_step(HarborGRPOTrainer, tmp_path, tiny_model)

    # ── the conversations: prompts, assistant turns, tool messages in TRL's order ──
    assert harbor["prompts"] == plain["prompts"]
    assert harbor["completions"] == plain["completions"]
    assert harbor["conversations"] == plain["conversations"]
    tool_messages = [[m for m in c if m["role"] == "tool"] for c in plain["conversations"]]
    assert tool_messages[0] == []  # no tool call
    first_turn = tool_messages[1][:5]
    # sync results first, in call order; then the async one, which saw both sync writes
    assert [m["name"] for m in first_turn] == ["bash", "bash", "fail", "nope", "slow_bash"]
    assert first_turn[0]["content"] == "(empty output, rc=0)"
    assert first_turn[1]["content"] == "one\n"
    assert first_turn[2]["content"] == str({"error": "tool failed on purpose: boom"})
    assert first_turn[3]["content"] == str({"error": "Tool nope not found."})
    assert first_turn[4]["content"] == "one\ntwo\n"
    assert "sales.csv" in tool_messages[2][0]["content"] or "products.csv" in tool_messages[2][0]["content"]

    # ── the tensors: ids, masks, advantages, token count ──
    for key, value in plain["output"].items():
        other = harbor["output"][key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), key
        else:
            assert value == other, key
    assert set(harbor["output"]) - set(plain["output"]) == {FAILED_KEY}
    assert not harbor["output"][FAILED_KEY].any()
    tool_mask = plain["output"]["tool_mask"]
    assert (tool_mask == 0).any() and tool_mask[0].all()  # tool tokens masked; row 0 had none

    # ── rewards: the gold answers of rows 1 and 2 ──
    assert harbor["rewards"] == plain["rewards"]
    assert plain["rewards"]["_outcome_reward_func"] == [0.0, 1.0, 1.0, 0.0]

    # ── TRL's counts: 9 calls over 4 rollouts (6 + 2 + 1), 2 failures ──
    for key in ("tools/call_frequency", "tools/failure_frequency", "reward", "num_tokens"):
        assert harbor["history"][0][key] == plain["history"][0][key], key
    assert plain["history"][0]["tools/call_frequency"] == 9 / 4
    assert plain["history"][0]["tools/failure_frequency"] == pytest.approx(2 / 9)

    # ── each rollout's own calls ran in the same order; only the integration overlapped rollouts ──
    def per_row(calls):
        return {row: [(tool, arg) for s, _, r, tool, arg in sorted(calls) if r == row] for row in range(4)}

    assert per_row(harbor["calls"]) == per_row(plain["calls"])
    assert not _overlapping_rows(plain["calls"])
    assert _overlapping_rows(harbor["calls"])
    # completion order differs from call order: the fast rollout 3 finished before the slow rollout 2
    finish = {row: end for _, end, row, tool, arg in harbor["calls"] if "ls /workdir" in arg}
    assert finish[3] < finish[2]

    assert engines.live_sandbox_count() == 0
    assert leak_probe.bwrap_pids() - bwrap_before == set()


def test_a_trl_outside_the_supported_range_is_refused() -> None:
    """The releases .ci/range trains on, from the lowest the range allows (this file is marked trl_api)."""
    assert SUPPORTED_TRL == SUPPORTED["trl-internals"] and SUPPORTED_TRL.startswith(">=1.7,")
    for version in TESTED["trl"]:
        check_trl_version(version)
    check_trl_version("1.16.3")
    check_trl_version("1.16.0.dev0")  # a build of TRL's main branch before 1.16: installed, so it counts
    for version in ("1.6.0", "0.29.1", "1.17.0", "1.17.0.dev0", "2.0.0", "not-a-version"):
        with pytest.raises(UnsupportedTRLVersionError) as info:
            check_trl_version(version)
        assert info.value.supported == SUPPORTED_TRL and info.value.found == version
        assert SUPPORTED_TRL in str(info.value)
    with patch("trl.__version__", "2.0.0"), pytest.raises(UnsupportedTRLVersionError):
        HarborGRPOTrainer(model="unused", args=None)
