"""HarborGRPOTrainer(prefetch=True) on real bubblewrap sandboxes: the next step's sandboxes are started ahead.

Three training steps of 4 rollouts (2 tasks x 2 generations) over the bundled
suite, with scripted generations (each rollout runs one command, then ends),
and the same with the dataset shuffled and 2 micro-steps a generation (8
rollouts; the third step is the second epoch's). Against the same runs without
prefetch: the same rows in the same order, the same completions and rewards.
Every reset after the first step claims a sandbox started during the step
before; a wrong guess is stopped unused; with a live-sandbox limit of one batch
the starts ahead wait for slots, never exceed it and still hit; an evaluation the trainer
cannot foresee stops what was started ahead instead of waiting behind it, and
no start is made ahead of a scheduled evaluation or after the last generation;
a run that dies stops what it started ahead; nothing is left running.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import time
import warnings
from pathlib import Path
from unittest.mock import patch

import pytest
from transformers import TrainerCallback

import shim
from benchmarks.tiny_model import build_tiny_qwen3
from harbor_async.suites import example_suite_path
from shim import engines, prefetch
from shim.trainer import PREFETCH_METRIC_KEYS, HarborGRPOTrainer
from tests.test_shim_grpo import _grpo_args
from tests.test_trainer_failures import Scripted, _turns

pytestmark = [pytest.mark.slow, pytest.mark.trl_api, pytest.mark.one_worker]  # a real trainer; .ci/range trains on both ends of TRL's range
# (the group: one worker trains the module's eight runs, not each worker that gets one of its tests)

STEPS = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    warnings.filterwarnings("ignore", category=UserWarning)
    corpus = [t for row in range(4) for t in _turns(row)]
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny"), corpus=corpus)


class Crash(RuntimeError):
    """Raised on purpose by :class:`CrashAfterFirstStep`."""


class CrashAfterFirstStep(TrainerCallback):
    """A run that dies after its first step, once that step has started the next one's sandboxes."""

    def on_step_end(self, args, state, control, **kwargs):
        raise Crash("stopped on purpose")


class EvaluateAfterEveryStep(TrainerCallback):
    """An evaluation the trainer cannot foresee (as a user's callback may ask for one)."""

    def on_step_end(self, args, state, control, **kwargs):
        control.should_evaluate = True
        return control


def _train(
    out: Path,
    tiny_model,
    *,
    use_prefetch: bool,
    wrong_guess: bool = False,
    limit: int | None = None,
    evaluate: str | None = None,
    crash: bool = False,
    **config,
) -> dict:
    model_dir, tokenizer = tiny_model
    options = {"max_live_sandboxes": limit} if limit else {}
    spec = shim.HarborSpec(example_suite_path(), agent="bash", environment_type="local", **options)
    evaluation = {}
    if evaluate == "scheduled":
        evaluation = {"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 4}
    elif evaluate == "unforeseen":
        evaluation = {"per_device_eval_batch_size": 4}
    trainer = HarborGRPOTrainer(
        model=str(model_dir),
        processing_class=tokenizer,
        args=_grpo_args(out, max_steps=STEPS, batch=4, generations=2, completion=256, **evaluation, **config),
        train_dataset=spec.train_dataset,
        eval_dataset=spec.train_dataset.select([8, 9]) if evaluate else None,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
        callbacks=[EvaluateAfterEveryStep()] if evaluate == "unforeseen" else [CrashAfterFirstStep()] if crash else None,
        prefetch=use_prefetch,
    )
    rows, rewards, parked_at_reset, started_ahead, live_at_start_ahead = [], [], [], [], []
    crashed = None
    inner = trainer._generate_and_score_completions
    inner_generate = trainer._generate
    start_ahead = prefetch.prefetch

    def recording(inputs):
        if wrong_guess:  # a sampler that cannot be read ahead correctly: always guess the first task
            lookahead = trainer._harbor_lookahead
            lookahead.next_keys = lambda keys: [spec.train_dataset["task_dir"][0]] * len(keys)
        output = inner(inputs)
        if trainer.model.training:  # evaluation batches are checked through their own logs
            rows.append([row["task_dir"] for row in inputs])
            rewards.append(trainer._harbor_rewards.flatten().tolist())
        return output

    def generate(prompts):
        if trainer.model.training:  # before the release: what the resets left unclaimed
            parked_at_reset.append(prefetch.parked_count())
        return inner_generate(prompts)

    def counting(env, task_dirs):
        task_dirs = list(task_dirs)
        started_ahead.append((trainer.state.global_step, len(task_dirs)))
        live_at_start_ahead.append(engines.live_sandbox_count())
        return start_ahead(env, task_dirs)

    trainer._generate_and_score_completions = recording
    trainer._generate = generate
    try:
        with (
            patch.object(trainer.model, "generate", side_effect=Scripted(tokenizer)),
            patch.object(prefetch, "prefetch", counting),
        ):
            try:
                trainer.train()
            except Crash:
                crashed = {"parked": prefetch.parked_count(), "live": _live_settled()}
        completions = list(trainer._logs["completion"])
        engine = engines.engine_for(trainer.environments[0]._options)  # this run's (engines are shared per option set)
        peak_live = engines.call(lambda: engine.stats().peak_live)
    finally:
        spec.close()
    history = [e for e in trainer.state.log_history if "loss" in e]
    evaluations = [e for e in trainer.state.log_history if "eval_env/wait_s" in e]
    return {
        "rows": rows,
        "rewards": rewards,
        "completions": completions,
        "history": history,
        "evaluations": evaluations,
        "parked_at_reset": parked_at_reset,
        "started_ahead": started_ahead,
        "live_at_start_ahead": live_at_start_ahead,
        "peak_live": peak_live,
        "crashed": crashed,
        "live_after": engines.live_sandbox_count(),
        "parked_after": prefetch.parked_count(),
    }


def _live_settled(timeout: float = 30.0) -> int:
    """The live count once it stops falling (the stops of a release run in the background)."""
    deadline = time.monotonic() + timeout
    last = engines.live_sandbox_count()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = engines.live_sandbox_count()
        if now == last:
            return now
        last = now
    return last


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> dict:
    # Shuffled, 2 micro-steps a generation (8 rollouts of 4 tasks), 2 generations an epoch: step 3 is epoch 2's.
    shuffled = {"shuffle_dataset": True, "gradient_accumulation_steps": 2}
    variants = {
        "plain": {"use_prefetch": False},
        "prefetch": {"use_prefetch": True},
        "wrong": {"use_prefetch": True, "wrong_guess": True},
        "limited": {"use_prefetch": True, "limit": 4},
        "unforeseen-eval": {"use_prefetch": True, "limit": 4, "evaluate": "unforeseen"},
        "scheduled-eval": {"use_prefetch": True, "evaluate": "scheduled"},
        "shuffled-plain": {"use_prefetch": False, **shuffled},
        "shuffled": {"use_prefetch": True, **shuffled},
        "crash": {"use_prefetch": True, "crash": True},
    }
    return {name: _train(tmp_path_factory.mktemp(name), tiny_model, **kw) for name, kw in variants.items()}


def test_prefetch_changes_nothing_a_step_computes(runs) -> None:
    for base, others in (("plain", ("prefetch", "wrong", "limited", "unforeseen-eval", "scheduled-eval")),
                         ("shuffled-plain", ("shuffled",))):  # fmt: skip
        reference = runs[base]
        assert len(reference["rows"]) == STEPS and len({tuple(r) for r in reference["rows"]}) == STEPS
        for name in others:
            assert runs[name]["rows"] == reference["rows"], name
            assert runs[name]["rewards"] == reference["rewards"], name
            assert runs[name]["completions"] == reference["completions"], name
    for run in runs.values():
        assert all(r == r for step in run["rewards"] for r in step)  # no NaN: every sandbox gave a verdict
    shuffled = runs["shuffled-plain"]["rows"]
    assert len(shuffled[0]) == 8 and shuffled != [sorted(rows) for rows in shuffled]  # the order is shuffled


def test_every_reset_after_the_first_step_claims_a_sandbox_started_ahead(runs) -> None:
    history = runs["prefetch"]["history"]
    assert len(history) == STEPS
    assert all(key in entry for entry in history for key in PREFETCH_METRIC_KEYS)
    assert [e["env/prefetch_hits"] for e in history] == [0.0, 4.0, 4.0]
    assert [e["env/prefetch_unused"] for e in history] == [0.0, 0.0, 0.0]
    assert runs["prefetch"]["parked_at_reset"] == [0, 0, 0]  # every start ahead was claimed
    assert runs["prefetch"]["started_ahead"] == [(0, 4), (1, 4)]  # none after the last generation
    assert all("env/prefetch_hits" not in entry for entry in runs["plain"]["history"])


def test_shuffled_accumulated_steps_across_an_epoch_end_still_hit(runs) -> None:
    run = runs["shuffled"]
    assert [e["env/prefetch_hits"] for e in run["history"]] == [0.0, 8.0, 8.0]
    assert [e["env/prefetch_unused"] for e in run["history"]] == [0.0, 0.0, 0.0]
    assert run["started_ahead"] == [(0, 8), (1, 8)]


def test_a_wrong_guess_is_stopped_unused(runs) -> None:
    history = runs["wrong"]["history"]
    first = runs["plain"]["rows"][0][0]
    # The guess (4 x the first task) is right only for the rows of a step that use that task.
    hits = [sum(row == first for row in rows) for rows in runs["plain"]["rows"][1:]]
    assert [e["env/prefetch_hits"] for e in history] == [0.0, *map(float, hits)]
    assert [e["env/prefetch_unused"] for e in history] == [0.0, *(4.0 - h for h in hits)]
    assert hits != [4, 4]  # the test does exercise a wrong guess


def test_with_one_batch_of_slots_the_starts_ahead_queue_and_still_hit(runs) -> None:
    run = runs["limited"]
    assert [e["env/prefetch_hits"] for e in run["history"]] == [0.0, 4.0, 4.0]
    # The batch's own sandboxes take every slot; the starts ahead (made while this step's stops may
    # still run: live then, run["live_at_start_ahead"]) take slots only as those stops finish.
    assert run["peak_live"] == 4


def test_a_run_that_dies_stops_what_it_started_ahead(runs) -> None:
    run = runs["crash"]
    assert run["started_ahead"] == [(0, 4)]  # the first step started the second's sandboxes, then the run died
    # Released at once, and stopped: the dead step's own sandboxes were stopped after its rewards.
    assert run["crashed"] == {"parked": 0, "live": 0}


def test_an_unforeseen_evaluation_stops_the_starts_ahead_instead_of_waiting_behind_them(runs) -> None:
    run = runs["unforeseen-eval"]
    evaluations = run["evaluations"]
    assert len(evaluations) == STEPS  # one after each step, none stuck behind the parked sandboxes
    # The first two follow a step that started the next one's sandboxes (other tasks than 8-9).
    assert [e["eval_env/prefetch_unused"] for e in evaluations] == [4.0, 4.0, 0.0]
    assert [e["env/prefetch_hits"] for e in run["history"]] == [0.0, 0.0, 0.0]


def test_no_start_ahead_before_a_scheduled_evaluation(runs) -> None:
    run = runs["scheduled-eval"]
    # after step 2, and at the end where the installed transformers evaluates there too (5.2 does not)
    assert [e["step"] for e in run["evaluations"]] in ([2], [2, STEPS])
    assert run["started_ahead"] == [(0, 4)]  # step 2's: steps 3 and "4" come after an evaluation or not at all
    assert [e["env/prefetch_hits"] for e in run["history"]] == [0.0, 4.0, 0.0]
    assert all(e["eval_env/prefetch_unused"] == 0.0 for e in run["evaluations"])


def test_nothing_is_left_running(runs) -> None:
    for name, run in runs.items():
        assert (run["live_after"], run["parked_after"]) == (0, 0), name
