"""A real GRPOTrainer on the simulated backend: no stall at 128 rollouts, a clear refusal, None rewards, a stop.

The tiny model and scripted generations are the ones of test_shim_grpo.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import math
import time
import warnings
from pathlib import Path
from unittest.mock import patch

import pytest
from trl import GRPOTrainer

import shim
import shim.rewards
from benchmarks.tiny_model import build_tiny_qwen3
from harbor_async.backends.simulated import SimulatedEnvironment
from harbor_async.core.errors import InfrastructureBudgetError, SandboxLimitError
from harbor_async.suites import example_suite_path
from shim import engines
from tests.test_shim_grpo import TASKS, ScriptedGeneration, _grpo_args, _instructions

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # a real trainer; one worker builds its model

FAILING_TASK = "csv-max-price"


class OneTaskFails(SimulatedEnvironment):
    """The simulated backend, but every start of one task fails for good (a broken image, say)."""

    async def start(self, force_build: bool) -> None:
        if self.environment_name == FAILING_TASK:
            from harbor.environments.base import SandboxBuildFailedError

            raise SandboxBuildFailedError(f"simulated broken image of {FAILING_TASK}")
        await super().start(force_build)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    warnings.filterwarnings("ignore", category=UserWarning)
    indices = list(range(10))
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), corpus=list(_instructions(indices)))


def _trainer(tmp_path: Path, spec: shim.HarborSpec, tiny_model, batch: int, generations: int) -> GRPOTrainer:
    model_dir, tokenizer = tiny_model
    return GRPOTrainer(
        model=str(model_dir),
        processing_class=tokenizer,
        args=_grpo_args(tmp_path / "out", 1, batch, generations, completion=128),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )


def _record_rewards(monkeypatch: pytest.MonkeyPatch) -> list[list[float | None]]:
    batches: list[list[float | None]] = []
    real = shim.rewards.verify_environments

    def recording(environments):
        rewards = real(environments)
        batches.append(list(rewards))
        return rewards

    monkeypatch.setattr(shim.rewards, "verify_environments", recording)
    return batches


def test_a_batch_of_128_rollouts_with_default_options_never_waits(tmp_path, monkeypatch, tiny_model):
    _, tokenizer = tiny_model
    indices = list(range(8))
    spec = shim.HarborSpec(
        example_suite_path(), environment_type="simulated", indices=indices, environment_kwargs={"start_latency": 0.05}
    )
    batches = _record_rewards(monkeypatch)
    trainer = _trainer(tmp_path, spec, tiny_model, batch=128, generations=16)
    try:
        with patch.object(trainer.model, "generate", side_effect=ScriptedGeneration(tokenizer, _instructions(indices))):
            trainer.train()
    finally:
        spec.close()
    assert trainer.state.global_step == 1
    assert batches == [[1.0] * 128]
    assert SimulatedEnvironment.peak_live >= 128  # every rollout held its sandbox at once: no slot wait
    assert engines.live_sandbox_count() == 0


def test_a_limit_below_the_batch_is_refused_within_a_second(tmp_path, monkeypatch, tiny_model):
    _, tokenizer = tiny_model
    indices = [1, 3]
    spec = shim.HarborSpec(example_suite_path(), environment_type="simulated", indices=indices, max_live_sandboxes=3)
    first_reset: list[float] = []
    real_reset = shim.HarborEnv.reset

    def timed_reset(self, *args, **kwargs):
        first_reset.append(time.monotonic())
        return real_reset(self, *args, **kwargs)

    monkeypatch.setattr(shim.HarborEnv, "reset", timed_reset)
    trainer = _trainer(tmp_path, spec, tiny_model, batch=4, generations=2)
    try:
        with (
            patch.object(trainer.model, "generate", side_effect=ScriptedGeneration(tokenizer, _instructions(indices))),
            pytest.raises(SandboxLimitError, match="max_live_sandboxes=3") as info,
        ):
            trainer.train()
        refused = time.monotonic()
    finally:
        spec.close()
    assert refused - first_reset[0] < 1.0
    assert "4 rollouts" in str(info.value)


def test_a_rollout_whose_start_failed_reaches_the_trainer_as_none(tmp_path, monkeypatch, tiny_model):
    _, tokenizer = tiny_model
    indices = [1, 3]  # csv-column-sum starts; csv-max-price never does
    assert TASKS[3][0] == FAILING_TASK
    spec = shim.HarborSpec(example_suite_path(), environment_type=f"{__name__}:OneTaskFails", indices=indices)
    batches = _record_rewards(monkeypatch)
    trainer = _trainer(tmp_path, spec, tiny_model, batch=4, generations=2)
    try:
        with patch.object(trainer.model, "generate", side_effect=ScriptedGeneration(tokenizer, _instructions(indices))):
            trainer.train()
    finally:
        spec.close()
    assert trainer.state.global_step == 1  # the step completed
    assert batches == [[1.0, 1.0, None, None]]
    (entry,) = [e for e in trainer.state.log_history if "rewards/_outcome_reward_func/mean" in e]
    assert entry["harbor/failure_frequency"] == 0.5
    assert entry["rewards/_outcome_reward_func/mean"] == pytest.approx(1.0)  # the failed rollouts are left out
    assert not math.isnan(entry["loss"])


def test_a_batch_whose_every_start_fails_stops_the_trainer_naming_the_cause(tmp_path, tiny_model):
    _, tokenizer = tiny_model
    indices = [1, 3]
    spec = shim.HarborSpec(
        example_suite_path(), environment_type="simulated", indices=indices, preflight=False,
        environment_kwargs={"start_permanent_failure_rate": 1.0},
    )  # fmt: skip
    trainer = _trainer(tmp_path, spec, tiny_model, batch=4, generations=2)
    try:
        with (
            patch.object(trainer.model, "generate", side_effect=ScriptedGeneration(tokenizer, _instructions(indices))),
            pytest.raises(InfrastructureBudgetError, match="simulated permanent start failure"),
        ):
            trainer.train()
    finally:
        spec.close()
    assert trainer.state.global_step == 0
