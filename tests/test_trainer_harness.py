"""A harness written for TRL (tests/trl_style_harness.py, subclassing ``trl.experimental.harbor.HarborEnv``)
trains for 2 steps through ``shim.HarborSpec(agent="file.py:Class")``, unchanged, in real bubblewrap sandboxes.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import pickle
import re
import warnings
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import trl.experimental.harbor as trl_harbor

import shim
from benchmarks.tiny_model import build_tiny_qwen3, encode_exact
from harbor_async.suites import example_suite_path
from shim import engines
from shim.trainer import HarborGRPOTrainer
from tests.test_trainer import grpo_args

pytestmark = [pytest.mark.slow, pytest.mark.trl_api]  # a real trainer; .ci/range trains on both ends of TRL's range

HARNESS = str(Path(__file__).with_name("trl_style_harness.py")) + ":NotesHarness"
INDICES = [1, 3, 4, 9]  # tasks with a gold answer
MARKER = re.compile(r"\[r(\d)\]")


def _turns(row: int, gold: str) -> list[str]:
    answer = gold if row % 2 == 0 else "wrong"
    run = json.dumps({"name": "run", "arguments": {"command": "pwd; ls"}})
    submit = json.dumps({"name": "submit", "arguments": {"answer": answer}})
    return [
        f"Look. [r{row}]\n<tool_call>\n{run}\n</tool_call><|im_end|>",
        f"Submit. [r{row}]\n<tool_call>\n{submit}\n</tool_call><|im_end|>",
        f"Done. [r{row}]<|im_end|>",
    ]


class Scripted:
    """Row k of a step's first call (then found by marker) looks, submits (gold on even rows), stops."""

    def __init__(self, tokenizer, golds_by_instruction: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        self.golds = golds_by_instruction

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        pad = self.tokenizer.pad_token_id
        rows = []
        for i, row in enumerate(input_ids.tolist()):
            text = self.tokenizer.decode([t for t in row if t != pad])
            seen = MARKER.findall(text)
            (gold,) = [g for instruction, g in self.golds.items() if instruction in text]
            k = int(seen[0]) if seen else i
            rows.append(encode_exact(self.tokenizer, _turns(k, gold)[len(seen)]))
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=input_ids.device)
        return torch.cat([input_ids, completion], dim=-1)


def test_trl_harness_file_trains_two_steps_unchanged(tmp_path: Path, leak_probe) -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    bwrap_before = leak_probe.bwrap_pids()
    spec = shim.HarborSpec(example_suite_path(), agent=HARNESS, environment_type="local", indices=INDICES)
    golds = {}
    for row in spec.train_dataset:
        from harbor_async.tasks.suite import load_task

        golds[load_task(row["task_dir"]).instruction] = row["gold_answer"]
    corpus = [t for k in range(4) for g in golds.values() for t in _turns(k, g)]
    model_dir, tokenizer = build_tiny_qwen3(tmp_path / "tiny", corpus=corpus)

    # The factory pickles (AsyncGRPOTrainer sends it to a process) and builds the harness, rebased on the shim.
    env = pickle.loads(pickle.dumps(spec.environment_factory))()
    assert isinstance(env, trl_harbor.HarborEnv) and isinstance(env, shim.HarborEnv)
    assert type(env).__name__ == "NotesHarness"

    trainer = HarborGRPOTrainer(
        model=str(model_dir),
        processing_class=tokenizer,
        args=grpo_args(tmp_path / "out", max_steps=2),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )
    rewards: list[float] = []
    inner = trainer._calculate_rewards

    def recording(*args):
        per_func = inner(*args)
        rewards.extend(per_func[:, 0].tolist())
        return per_func

    trainer._calculate_rewards = recording
    conversations: list[list[dict]] = []
    inner_loop = trainer._tool_call_loop

    def recording_loop(*args):  # each step's conversations (TRL < 1.16 logs them as decoded text)
        result = inner_loop(*args)
        conversations[:] = result[1]
        return result

    trainer._tool_call_loop = recording_loop
    try:
        assert sorted(tool.__name__ for tool in trainer.tools) == ["run", "submit"]
        with patch.object(trainer.model, "generate", side_effect=Scripted(tokenizer, golds)):
            trainer.train()
        pool = trainer.environments  # the envs of the batch (TRL 1.16: drawn from a pool that holds the same ones)
        completions = conversations  # the last step's
    finally:
        spec.close()
        env.close()

    assert trainer.state.global_step == 2
    assert rewards == [1.0, 0.0, 1.0, 0.0] * 2  # gold answers on even rows, in each step
    assert all(e.calls == 4 for e in pool)  # the harness's own state: 2 calls a step, 2 steps
    assert len(completions) == 4
    for completion in completions:
        look, submit = [m["content"] for m in completion if m["role"] == "tool"]
        assert look.startswith("/workdir\n")  # ran in the task's sandbox
        assert submit == "harness-ready\n"  # the harness's async _setup ran, through self._env
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert len(entries) == 2 and all(e["tools/failure_frequency"] == 0.0 for e in entries)
    assert engines.live_sandbox_count() == 0
    assert leak_probe.bwrap_pids() - bwrap_before == set()


def test_other_classes_are_still_refused() -> None:
    with pytest.raises(TypeError, match="must resolve to a HarborEnv subclass"):
        shim.HarborSpec(example_suite_path(), agent=dict, environment_type="local")
