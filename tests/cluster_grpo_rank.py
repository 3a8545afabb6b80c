"""One rank of the two-rank GRPO test: ``torchrun --nproc_per_node 2 -m tests.cluster_grpo_rank ADDRESS MODEL OUT``.

A CPU GRPOTrainer (gloo) with the shim's HarborSpec on the counting simulated
backend and the Ray budget: each rank's batch (2 sandboxes) is leased all or
nothing from a cluster cap of 4, which both ranks' batches fit together (they
must: ranks meet in collectives mid-step). Writes ``OUT/rank-<rank>.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import sys
import warnings
from pathlib import Path
from unittest.mock import patch

import torch.distributed as dist
from transformers import AutoTokenizer
from trl import GRPOTrainer

import shim
from harbor_async.suites import example_suite_path
from tests.test_shim_grpo import TASKS, ScriptedGeneration, _grpo_args, _instructions

CLUSTER_CAP = 4  # the two ranks' batches together: ranks of one world cannot take turns (see WorldExceedsCapError)
RANK_BATCH = 2  # per_device_train_batch_size: the rollouts one rank has in flight


def main(address: str, model_dir: str, out: Path) -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    indices = list(TASKS)
    spec = shim.HarborSpec(
        example_suite_path(),
        environment_type="tests.cluster_backend:CountingEnvironment",
        indices=indices,
        budget="ray",
        ray_address=address,
        cluster_max_live=CLUSTER_CAP,
        max_live_sandboxes=RANK_BATCH,
        environment_kwargs={"start_latency": 0.2, "stop_latency": 0.05},
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = _grpo_args(out / "trainer", 2, RANK_BATCH, 2, completion=256, ddp_backend="gloo")
    trainer = GRPOTrainer(
        model=model_dir,
        processing_class=tokenizer,
        args=args,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )
    generate = ScriptedGeneration(tokenizer, _instructions(indices))
    try:
        with patch.object(trainer.model, "generate", side_effect=generate):
            trainer.train()
    finally:
        spec.close()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    result = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "global_step": trainer.state.global_step,
        "tool_calls": len(generate.commands),
        "rewards": rewards,
        "failure_frequency": [e.get("harbor/failure_frequency") for e in trainer.state.log_history if "reward" in e],
    }
    # What the cluster's budget actor granted: with a process-local budget it would have granted nothing.
    import ray

    from harbor_async.cluster.connect import DEFAULT_ACTOR_NAME, DEFAULT_NAMESPACE

    if not ray.is_initialized():
        ray.init(address=address, namespace=DEFAULT_NAMESPACE, logging_level="ERROR")
    result["budget"] = ray.get(ray.get_actor(DEFAULT_ACTOR_NAME, namespace=DEFAULT_NAMESPACE).stats.remote())
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
