"""A real TRL GRPOTrainer run on CPU with the shim's HarborSpec on the local (bubblewrap) backend.

The model is a tiny Qwen3 built at test time (benchmarks/tiny_model.py); its
``generate`` is patched, as in TRL's own tests, so that each rollout's first
turn is a real ``<tool_call>`` that TRL parses and sends to the env: a bash
command that runs in the task's sandbox and writes an answer (the task's gold
answer on even rows, a wrong one on odd rows). The verifier then scores 1.0
and 0.0 within each group, so the rewards and advantages are real.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import asyncio
import json
import pickle
import re
import warnings
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

import shim
import shim.rewards
from benchmarks.tiny_model import build_tiny_qwen3, encode_exact
from benchmarks.trainer_step import cpu_grpo_config
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_task
from shim import engines
from shim.spec import _SPEC_ENVS
from tests.conftest import needs_trl_get_reward  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.range, pytest.mark.one_worker]  # one worker builds its model


def _trainer_envs(trainer) -> list:
    """The trainer's environments: TRL 1.7 keeps one list, later releases a pool keyed by process group."""
    pool = getattr(trainer, "_environment_pool", None)
    return list(pool[None]) if pool is not None else list(trainer.environments)

# Tasks with a gold answer, and a file their Dockerfile COPYs into /workdir
# (so that `ls` output can only come from the task's sandbox).
TASKS = {
    1: ("csv-column-sum", "sales.csv"),
    3: ("csv-max-price", "products.csv"),
    4: ("env-inventory-lookup", "data"),
    9: ("word-frequency", "story.txt"),
}
FINAL_TEXT = "I wrote the answer to /workdir/answer.txt. Done.<|im_end|>"
RESPONSE_RE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def _command(gold: str, correct: bool) -> str:
    answer = gold if correct else "wrong answer"
    return f"pwd; ls; printf '%s' '{answer}' > /workdir/answer.txt"


def _tool_call(command: str) -> str:
    payload = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>\n{payload}\n</tool_call><|im_end|>"


class ScriptedGeneration:
    """Stands in for ``model.generate``: a tool call on the first turn, a plain answer after the tool result.

    Rows are recognised by the task instruction in their prompt; even rows (the
    first generation of each prompt) write the gold answer, odd rows a wrong one.
    """

    def __init__(self, tokenizer, instructions: dict[str, tuple[str, str]]) -> None:
        self.tokenizer = tokenizer
        self.instructions = instructions  # instruction text -> (task name, gold answer)
        self.final_ids = encode_exact(tokenizer, FINAL_TEXT)
        self.tool_response_id = tokenizer.convert_tokens_to_ids("</tool_response>")
        self.calls: list[list[str]] = []  # per generate call: "tool_call" / "final" per row
        self.inputs: list[str] = []  # decoded inputs, without padding
        self.commands: list[tuple[str, str]] = []  # (task name, command) per tool call emitted

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        pad = self.tokenizer.pad_token_id
        rows, kinds = [], []
        for i, row in enumerate(input_ids.tolist()):
            text = self.tokenizer.decode([t for t in row if t != pad])
            self.inputs.append(text)
            if self.tool_response_id in row:
                rows.append(self.final_ids)
                kinds.append("final")
                continue
            (name, gold), *more = [v for k, v in self.instructions.items() if k in text]
            assert not more, "two task instructions in one prompt"
            command = _command(gold, correct=i % 2 == 0)
            self.commands.append((name, command))
            rows.append(encode_exact(self.tokenizer, _tool_call(command)))
            kinds.append("tool_call")
        self.calls.append(kinds)
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=input_ids.device)
        return torch.cat([input_ids, completion], dim=-1)


def _instructions(indices: list[int]) -> dict[str, tuple[str, str]]:
    """Instruction text -> (task name, gold answer) for the bundled tasks at ``indices``."""
    spec = shim.HarborSpec(example_suite_path(), environment_type="local", indices=indices)
    found = {}
    for row in spec.train_dataset:
        task = load_task(row["task_dir"])
        found[task.instruction] = (task.name, row["gold_answer"])
    return found


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    """The tiny Qwen3 (folder, tokenizer), built once for this module."""
    warnings.filterwarnings("ignore", category=UserWarning)
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), corpus=list(_instructions(list(TASKS))))


def _grpo_args(
    out: Path, max_steps: int, batch: int = 4, generations: int = 2, completion: int = 512, **overrides
) -> GRPOConfig:
    """The benchmarks' CPU GRPO config with the dataset's order kept (``overrides``: other GRPOConfig fields)."""
    return cpu_grpo_config(out, max_steps, batch, generations, completion, **{"shuffle_dataset": False, **overrides})


def test_grpo_trainer_runs_on_shim_spec_with_real_sandboxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leak_probe, tiny_model
) -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    bwrap_before, dirs_before = leak_probe.bwrap_pids(), leak_probe.sandbox_dirs()
    indices = list(TASKS)
    spec = shim.HarborSpec(example_suite_path(), environment_type="local", indices=indices)
    dataset = spec.train_dataset
    assert dataset["task_index"] == indices
    instructions = _instructions(indices)
    model_dir, tokenizer = tiny_model

    # Record every batch the reward function verifies, and the loop calls it makes.
    loop_calls = []
    real_call = engines.call

    def counting_call(fn, *args, **kwargs):
        loop_calls.append(getattr(fn, "__name__", repr(fn)))
        return real_call(fn, *args, **kwargs)

    monkeypatch.setattr(engines, "call", counting_call)
    batches = []
    real_verify = shim.rewards.verify_environments

    def recording_verify(environments):
        before = len(loop_calls)
        rewards = real_verify(environments)
        batches.append(
            {
                "envs": list(environments),
                "tasks": [env._episode.task.name for env in environments],
                "episodes": [env._episode for env in environments],
                "rewards": rewards,
                "loop_calls": loop_calls[before:],
            }
        )
        return rewards

    monkeypatch.setattr(shim.rewards, "verify_environments", recording_verify)

    n_steps, batch, n_gen = 2, 4, 2
    args = _grpo_args(tmp_path / "out", n_steps)
    trainer = GRPOTrainer(
        model=str(model_dir),
        processing_class=tokenizer,
        args=args,
        train_dataset=dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )
    try:
        # TRL's tool discovery sees exactly the harness tool: not reset, reward, close.
        assert [tool.__name__ for tool in trainer.tools] == ["bash"]
        generate = ScriptedGeneration(tokenizer, instructions)
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        with patch.object(trainer.model, "generate", side_effect=generate):
            trainer.train()
        pool = _trainer_envs(trainer)
    finally:
        spec.close()

    # ── the trainer ran its steps, and learned something ──
    assert trainer.state.global_step == n_steps
    changed = sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert changed > 0

    # ── tool calls ran in the sandboxes: one batched call per turn, answers from inside ──
    assert generate.calls == [["tool_call"] * batch, ["final"] * batch] * n_steps
    step_tasks = [
        [TASKS[i][0] for i in indices[:2] for _ in range(n_gen)],
        [TASKS[i][0] for i in indices[2:] for _ in range(n_gen)],
    ]
    assert [name for name, _ in generate.commands] == step_tasks[0] + step_tasks[1]
    second_turns = [text for text in generate.inputs if "</tool_response>" in text]
    assert len(second_turns) == batch * n_steps
    files = {name: copied for name, copied in TASKS.values()}
    for text, (name, command) in zip(second_turns, generate.commands, strict=True):
        assert command in text  # the tool call TRL parsed is in the conversation
        (response,) = RESPONSE_RE.findall(text)
        lines = response.split("\n")
        # pwd's /workdir and the COPY'd file exist only inside the task's sandbox.
        assert lines[0] == "/workdir", response
        assert files[name] in lines[1:], response

    # ── rewards: 1.0 for the gold answer, 0.0 for the wrong one, one loop call per batch ──
    assert len(batches) == n_steps
    for step, record in enumerate(batches):
        assert record["tasks"] == step_tasks[step]
        assert record["rewards"] == [1.0, 0.0, 1.0, 0.0]
        assert record["loop_calls"] == ["verify_episodes"], record["loop_calls"]
    logs = [entry for entry in trainer.state.log_history if "rewards/_outcome_reward_func/mean" in entry]
    assert len(logs) == n_steps
    for entry in logs:
        assert entry["rewards/_outcome_reward_func/mean"] == pytest.approx(0.5)
        assert entry["rewards/_outcome_reward_func/std"] == pytest.approx(0.5774, abs=1e-3)
        assert entry["reward"] == pytest.approx(0.5)
        assert entry["harbor/failure_frequency"] == 0.0
        assert entry["tools/call_frequency"] == 1.0
        assert entry["tools/failure_frequency"] == 0.0

    # ── env instances: one probe at init grown to the batch size, then reused and reset on step 2 ──
    assert len(pool) == batch
    assert [id(env) for env in batches[0]["envs"]] == [id(env) for env in pool]
    assert [id(env) for env in batches[1]["envs"]] == [id(env) for env in pool]
    assert all(a is not b for a, b in zip(batches[0]["episodes"], batches[1]["episodes"], strict=True))
    assert set(_SPEC_ENVS[spec._token]) == set(pool)

    # ── after close(): nothing alive ──
    assert engines.live_sandbox_count() == 0
    assert all(not engine.live_sandboxes() for engine in engines.open_engines())
    assert leak_probe.sandbox_dirs() - dirs_before == set()
    assert leak_probe.bwrap_pids() - bwrap_before == set()


@needs_trl_get_reward
def test_grpo_trainer_with_env_owned_reward_counts_it_once(tmp_path: Path, tiny_model) -> None:
    """``env_reward=True``: TRL scores through the envs' ``get_reward``; no reward function runs."""
    warnings.filterwarnings("ignore", category=UserWarning)
    model_dir, tokenizer = tiny_model
    indices = [1, 3]
    spec = shim.HarborSpec(example_suite_path(), environment_type="local", indices=indices, env_reward=True)
    assert spec.reward_funcs == []
    trainer = GRPOTrainer(
        model=str(model_dir),
        processing_class=tokenizer,
        args=_grpo_args(tmp_path / "out", 1),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )
    try:
        assert trainer.reward_func_names == ["HarborBashEnv"]  # one source: the env-owned reward
        assert [tool.__name__ for tool in trainer.tools] == ["bash"]
        generate = ScriptedGeneration(tokenizer, _instructions(indices))
        with patch.object(trainer.model, "generate", side_effect=generate):
            trainer.train()
    finally:
        spec.close()
    (entry,) = [e for e in trainer.state.log_history if "rewards/HarborBashEnv/mean" in e]
    assert entry["rewards/HarborBashEnv/mean"] == pytest.approx(0.5)
    assert entry["reward"] == pytest.approx(0.5)  # 1.0 and 0.0 per group, each counted once
    assert not any(key.startswith("rewards/_outcome") for key in entry)
    assert engines.live_sandbox_count() == 0


@needs_trl_get_reward
def test_async_grpo_rollout_worker_scores_with_get_reward(tiny_model) -> None:
    """TRL's AsyncGRPOTrainer rollout loop, for real, with only the vLLM request scripted.

    The worker probes the env class, pools envs, calls ``reset`` and the tool in
    its thread pool and awaits the env's ``get_reward`` on its own event loop;
    the factory reaches it pickled, as in the spawned worker process.
    """
    import multiprocessing as mp
    import queue
    import threading

    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    warnings.filterwarnings("ignore", category=UserWarning)
    _, tokenizer = tiny_model
    indices = [1, 9]
    spec = shim.HarborSpec(example_suite_path(), environment_type="local", indices=indices, env_reward=True)
    instructions = _instructions(indices)
    buffer: queue.Queue = queue.Queue()
    worker = _AsyncRolloutLoop(
        model_name="tiny",
        dataset=spec.train_dataset,
        reward_funcs=list(spec.reward_funcs),
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        rollout_buffer=buffer,
        model_version_value=mp.Value("i", 0),
        heartbeat_value=mp.Value("d", 0.0),
        failed_event=threading.Event(),
        exception_info_queue=queue.Queue(),
        metrics_queue=queue.Queue(),
        environment_factory=pickle.loads(pickle.dumps(spec.environment_factory)),
        num_generations=2,
        max_inflight_tasks=4,
        max_tokens=512,
        max_tool_calling_iterations=3,
    )
    assert worker.reward_func_names == ["HarborBashEnv"]
    assert [tool.__name__ for tool in worker.tools] == ["bash"]

    seen: dict[str, int] = {}
    final_ids = encode_exact(tokenizer, FINAL_TEXT)

    async def scripted_turn(prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        text = tokenizer.decode(prompt_ids)
        if "<tool_response>" in text:
            ids = final_ids
        else:
            ((instruction, (_, gold)),) = [(k, v) for k, v in instructions.items() if k in text]
            count = seen[instruction] = seen.get(instruction, -1) + 1
            ids = encode_exact(tokenizer, _tool_call(_command(gold, correct=count % 2 == 0)))
        return ids, [-0.1] * len(ids)

    worker._generate_one_turn = scripted_turn

    async def drive() -> list:
        stop = asyncio.Event()
        loops = [asyncio.create_task(worker._generate_loop(stop)), asyncio.create_task(worker._score_loop(stop))]
        samples: list = []
        deadline = asyncio.get_running_loop().time() + 60
        while {s.group_id for s in samples} < {0, 1} or len([s for s in samples if s.group_id < 2]) < 4:
            assert asyncio.get_running_loop().time() < deadline, "no scored groups"
            for task in loops:
                if task.done():
                    task.result()  # surface a crash of TRL's loop
            try:
                samples.append(buffer.get_nowait())
            except queue.Empty:
                await asyncio.sleep(0.02)
        stop.set()
        await asyncio.gather(*loops)
        return samples

    try:
        samples = asyncio.run(drive())
    finally:
        worker._tool_pool.shutdown(wait=True)
        worker._loop.close()
        spec.close()
    for group in (0, 1):
        rows = [s for s in samples if s.group_id == group]
        assert len(rows) == 2
        assert sorted(s.metrics["rewards/HarborBashEnv"] for s in rows) == [0.0, 1.0]
        assert sorted(s.metrics["reward"] for s in rows) == [0.0, 1.0]
        for row in rows:
            assert row.metrics["tools/call_frequency"] == 1.0
            assert row.metrics["tools/failure_frequency"] == 0.0
            (tool_message,) = [m for m in row.completion if m["role"] == "tool"]
            assert tool_message["content"].startswith("/workdir\n")  # ran in the sandbox
    assert engines.live_sandbox_count() == 0
