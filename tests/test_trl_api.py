"""TRL's own GRPOTrainer discovers the shim's tools: run by .ci/trl-range on the oldest and newest TRL.

TRL changed how it lists an env's tools: up to 1.14 it takes the public bound
methods of an *instance* (``inspect.getmembers(env, inspect.ismethod)``), from
1.15 the public functions of the *class*. The shim's envs must expose exactly
their harness tools under both rules, so this asks the installed trainer
itself (a tiny Qwen3 built at test time, on the simulated backend; nothing
is trained or generated).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import warnings
from pathlib import Path

import pytest

import shim
from harbor_async.suites import example_suite_path

pytestmark = [pytest.mark.slow, pytest.mark.trl_api, pytest.mark.one_worker]  # one worker builds its model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    from benchmarks.tiny_model import build_tiny_qwen3

    warnings.filterwarnings("ignore", category=UserWarning)
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), corpus=["list the files", "sum a column"])


def _trainer(tiny_model, out: Path, spec: shim.HarborSpec):
    from trl import GRPOConfig, GRPOTrainer

    model_dir, tokenizer = tiny_model
    args = GRPOConfig(
        output_dir=str(out),
        use_vllm=False,
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=16,
        report_to=[],
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return GRPOTrainer(
        model=str(model_dir),
        processing_class=tokenizer,
        args=args,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs or None,
    )


def test_the_installed_trainer_sees_only_the_harness_tool(tiny_model, tmp_path: Path):
    warnings.filterwarnings("ignore", category=UserWarning)
    spec = shim.HarborSpec(example_suite_path(), environment_type="simulated", num_tasks=2)
    try:
        trainer = _trainer(tiny_model, tmp_path / "out", spec)
        assert [tool.__name__ for tool in trainer.tools] == ["bash"]
        # The envs the trainer made are the shim's, untouched by the probe (nothing started).
        env = next(iter(getattr(trainer, "_environment_pool", {None: [None]}).values()))[0] or trainer.environments[0]
        assert type(env) is shim.HarborBashEnv and env.reward == 0.0
        env.close()  # still callable by user code, though no tool
    finally:
        spec.close()


def test_env_owned_reward_runs_where_trl_reads_get_reward_and_is_refused_before(tiny_model, tmp_path: Path):
    import importlib.metadata

    from packaging.version import Version

    from harbor_async.cli.machine_checks import SUPPORTED, UnsupportedVersionError

    warnings.filterwarnings("ignore", category=UserWarning)
    if Version(importlib.metadata.version("trl")) < Version("1.8"):
        with pytest.raises(UnsupportedVersionError) as caught:
            shim.HarborSpec(example_suite_path(), environment_type="simulated", env_reward=True)
        assert caught.value.supported == SUPPORTED["trl-env-reward"] == ">=1.8,<2"
        assert "HarborSpec(env_reward=True) needs trl>=1.8,<2" in str(caught.value)
        return
    spec = shim.HarborSpec(example_suite_path(), environment_type="simulated", num_tasks=2, env_reward=True)
    try:
        trainer = _trainer(tiny_model, tmp_path / "out", spec)
        assert [tool.__name__ for tool in trainer.tools] == ["bash"]  # get_reward is no tool...
        assert trainer.reward_func_names == ["HarborBashEnv"]  # ...but the one reward source, named after the class
    finally:
        spec.close()


@pytest.mark.parametrize("agent", ["bash", "terminal", "python"])
def test_eval_offers_the_model_the_tools_the_trainer_offers(tiny_model, tmp_path: Path, agent: str):
    """The installed GRPOTrainer's tools for a harness, rendered as its chat template renders them, are eval's."""
    from transformers.utils import get_json_schema

    from harbor_async.evaluation import evaluate_sync
    from tests.scripted_server import ScriptedServer
    from tests.test_shim import trl_tool_names

    warnings.filterwarnings("ignore", category=UserWarning)
    spec = shim.HarborSpec(example_suite_path(), agent=agent, environment_type="simulated", num_tasks=2)
    try:
        trainer = _trainer(tiny_model, tmp_path / "out", spec)
        trained = [get_json_schema(tool) for tool in trainer.tools]
        assert [tool.__name__ for tool in trainer.tools] == trl_tool_names(spec._env_cls)  # the tests' helper agrees
    finally:
        spec.close()
    with ScriptedServer() as server:
        evaluate_sync(
            ["solver"], None, base_url=server.base_url, agent=agent, environment_type="simulated", n_tasks=1,
            jobs_dir=tmp_path, job_name="eval",
        )  # fmt: skip
        assert server.tools["solver"] == trained
