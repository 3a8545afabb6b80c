"""A failed sandbox start leaves the loss (and its group's statistics); the env metrics reach the logs.

A real HarborGRPOTrainer step on the simulated backend, one group of 4
rollouts, with the first sandbox start of the step made to fail (fault
injection: tests/trainer_backend.py). The reward stands in for the trust
issue's: ``None`` for a rollout whose env reports an infrastructure failure.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import re
import warnings
from unittest.mock import patch

import pytest
import torch
from trl import GRPOTrainer

import shim
from benchmarks.tiny_model import build_tiny_qwen3, encode_exact
from harbor_async.suites import example_suite_path
from shim import engines
from shim.rewards import verify_environments
from shim.trainer import FAILED_KEY, METRIC_KEYS, HarborGRPOTrainer, select_rows
from tests.test_trainer import grpo_args
from tests.trainer_backend import OneFailedStart

pytestmark = [pytest.mark.slow, pytest.mark.trl_api, pytest.mark.one_worker]  # a real trainer; .ci/range trains
# on both ends of TRL's range (the group: one worker trains the module's failed step)

MARKER = re.compile(r"\[r(\d)\]")


def reward_by_row(completions, environments, **kwargs):
    """``None`` for an infrastructure failure (as #10's reward), else a reward that differs by rollout.

    The verifiers run (all at once) so that their latencies reach the engine's statistics.
    """
    verify_environments(environments)
    rewards = []
    for completion, env in zip(completions, environments, strict=True):
        if env.infrastructure_failure:
            rewards.append(None)
            continue
        (row,) = {int(k) for m in completion if isinstance(m.get("content"), str) for k in MARKER.findall(m["content"])}
        rewards.append(row / 3)
    return rewards


def _turns(row: int) -> list[str]:
    call = json.dumps({"name": "bash", "arguments": {"command": f"echo {row}"}})
    return [f"Look. [r{row}]\n<tool_call>\n{call}\n</tool_call><|im_end|>", f"Done. [r{row}]<|im_end|>"]


class Scripted:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.turns = [[encode_exact(tokenizer, t) for t in _turns(row)] for row in range(4)]

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        pad = self.tokenizer.pad_token_id
        rows = []
        for i, row in enumerate(input_ids.tolist()):
            seen = MARKER.findall(self.tokenizer.decode([t for t in row if t != pad]))
            rows.append(self.turns[int(seen[0]) if seen else i % len(self.turns)][len(seen)])
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=input_ids.device)
        return torch.cat([input_ids, completion], dim=-1)


@pytest.fixture(scope="module")
def failed_step(tmp_path_factory: pytest.TempPathFactory):
    """One training step with one failed start: the trainer, its generation batch, the failed row."""
    warnings.filterwarnings("ignore", category=UserWarning)
    corpus = [t for row in range(4) for t in _turns(row)]
    model_dir, tokenizer = build_tiny_qwen3(tmp_path_factory.mktemp("tiny"), corpus=corpus)
    spec = shim.HarborSpec(
        example_suite_path(),
        agent="bash",
        environment_type="tests.trainer_backend:OneFailedStart",
        indices=[1],
        start_attempts=1,
        environment_kwargs={"stop_latency": 8.0},  # the batch's stops still run when the step logs
    )
    trainer = HarborGRPOTrainer(
        model=str(model_dir),
        processing_class=tokenizer,
        args=grpo_args(tmp_path_factory.mktemp("out"), max_steps=1, batch=4, generations=4),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=reward_by_row,
    )
    outputs = []
    inner = trainer._generate_and_score_completions

    def recording(inputs):
        output = inner(inputs)
        outputs.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in output.items()})
        return output

    trainer._generate_and_score_completions = recording
    OneFailedStart.arm()
    try:
        with patch.object(trainer.model, "generate", side_effect=Scripted(tokenizer)):
            trainer.train()
        failed_rows = [row for row, env in enumerate(trainer.environments) if env.sandbox_error is not None]
    finally:
        spec.close()
    assert engines.live_sandbox_count() == 0
    (output,) = outputs
    return trainer, output, failed_rows


def test_failed_rollout_leaves_the_loss_and_its_group(failed_step) -> None:
    trainer, output, failed_rows = failed_step
    assert len(failed_rows) == 1, failed_rows
    (bad,) = failed_rows
    good = [row for row in range(4) if row != bad]

    # ── flagged, masks zeroed, token count without it ──
    assert output[FAILED_KEY].tolist() == [row == bad for row in range(4)]
    assert output["completion_mask"][bad].sum() == 0 and output["tool_mask"][bad].sum() == 0
    assert (output["completion_ids"][bad] != trainer._tokenizer.pad_token_id).any()  # it did generate tokens
    loss_mask = output["completion_mask"] * output["tool_mask"]
    assert all(loss_mask[row].sum() > 0 for row in good)
    assert output["num_items_in_batch"].item() == loss_mask[good].sum().item()

    # ── its group's statistics: reward NaN, advantage 0, the others normalised among themselves ──
    rewards = torch.tensor([row / 3 for row in good])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    assert output["advantages"][bad].item() == 0.0
    assert torch.allclose(output["advantages"][good], expected, atol=1e-5)

    # ── the loss does not see it: perturbing its row changes nothing (dapo: token-normalised) ──
    inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in output.items()}
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
        inputs["advantages"][bad] = 1e3
        inputs["completion_ids"][bad] = torch.randint_like(inputs["completion_ids"][bad], 3, 200)
        assert trainer._compute_loss(trainer.model, inputs).item() == pytest.approx(loss.item(), rel=1e-5)
        # a sequence-averaged loss drops the row, so its count of sequences does not see it either
        inputs["advantages"][good] = 1.0  # on-policy, the loss is then -1 per kept sequence
        trainer.loss_type = "grpo"
        try:
            with_row = trainer._compute_loss(trainer.model, inputs)
            without_row = GRPOTrainer._compute_loss(trainer, trainer.model, select_rows(inputs, ~inputs[FAILED_KEY]))
            masked_only = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)  # the row counted as a zero
        finally:
            trainer.loss_type = "dapo"
        assert with_row.item() == pytest.approx(without_row.item(), rel=1e-5)
        assert with_row.item() == pytest.approx(-1.0, rel=1e-4)
        assert masked_only.item() == pytest.approx(-0.75, rel=1e-4)


def test_env_metrics_and_failure_counts_in_the_logged_history(failed_step) -> None:
    trainer, _, _ = failed_step
    (entry,) = [e for e in trainer.state.log_history if "loss" in e]
    missing = [key for key in METRIC_KEYS if key not in entry]
    assert missing == []
    assert entry["harbor/infrastructure_failures"] == 1.0
    assert entry["harbor/infrastructure_failure_frequency"] == 0.25
    assert entry["env/failures/start"] == 1.0
    assert entry["env/failures/exec"] == 0.0
    assert entry["env/wait_s"] == pytest.approx(
        entry["env/wait_reset_s"] + entry["env/wait_tools_s"] + entry["env/wait_rewards_s"], rel=1e-3
    )
    assert entry["env/wait_s"] > 0.0
    assert entry["env/start_p99_s"] >= entry["env/start_p50_s"] >= 0.0
    # The batch's 3 started sandboxes are still stopping in the background (8 s each); the failed one never lived.
    assert entry["env/live_sandboxes"] == 3.0
    # The adaptive start window (on by default) opened past its first 8 as the starts succeeded; no 429s here.
    assert entry["env/start_window"] >= 8.0 and entry["env/start_throttles"] == 0.0
    # What the sandboxes stopped during the step used: the failed start's billed seconds (its environment was
    # created); the simulated backend measures no CPU, and the 3 still stopping are not counted yet.
    assert entry["env/sandbox_seconds"] > 0.0 and entry["env/cpu_seconds"] == 0.0
    assert entry["env/memory_peak_mb"] >= 0.0  # the highest of any sandbox of this process so far (an earlier test's)
