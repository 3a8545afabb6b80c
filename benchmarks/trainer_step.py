"""GRPO steps of a real ``GRPOTrainer`` on CPU: the plain shim against ``HarborGRPOTrainer``, beside TRL's env.

Each run trains a tiny Qwen3 (built on the fly, benchmarks/tiny_model.py) with
``model.generate`` scripted: every rollout makes ``turns`` bash tool calls,
one per turn, then answers. The environments are the shim's on the simulated
backend, so only their latencies cost time. Two trainers, same data, same
script:

- ``grpo-trainer``: TRL's ``GRPOTrainer`` with the shim's ``HarborSpec`` (its
  tool loop calls one rollout after another);
- ``harbor-grpo-trainer``: :class:`shim.trainer.HarborGRPOTrainer` (each round's
  rollouts at once, through its own dispatch code);
- ``harbor-grpo-trainer-prefetch``: the same with ``prefetch=True`` (the next
  step's sandboxes started while this step verifies and optimises).

Both are timed the same way by :class:`_Timing`, wrapped around the trainer's
own methods: the step's wall time (a callback), and the trainer thread's
environment time = the resets (from the start of
``_generate_and_score_completions`` to ``_generate``) + the tool loop minus the
generations inside it + the reward functions. TRL's own env
(``benchmarks.reference``) is measured by the GRPO-step replay of
:mod:`benchmarks.grpo_step`, in the same run, since one of its steps at B = 64
takes minutes.

Two scenarios (``SCENARIOS``): ``cloud`` (B = 64, T = 3, the replay's cloud
latencies) and ``cpu-step`` (B = 16, T = 3, start 0.3 s, exec 0.5 s, verify 0.3 s).
Run: ``python -m benchmarks.trainer_step --scenario cloud``.

**The limit.** Each Harbor trainer is also run with zero-latency execs (start,
verify and stop latencies kept): that step is the model's work plus whatever
of the start and the verifier the trainer leaves on the critical path (with
prefetch the start hides behind the previous step's update; the verifier's
test script cannot hide: the loss needs the rewards, and the rollouts end
together). A rollout's T commands must follow each other, so no trainer beats
that step + T × exec latency: the summary reports each trainer's later-step
wall time over that limit (``.../over_limit``). What the limit does not
forgive is every other exec round trip on the path (each costs the exec
latency on the simulated backend): the harness's base setup before the first
command (run ahead with prefetch), and any exec of the verifier's besides the
tests' own (the folder reset and Harbor's ``chmod`` of the test script run in
that one).
With ``--repeats N`` every run (the zero-exec ones too) is made N times, in
turn, and the summary takes medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Each scenario: batch, generations per prompt, turns, steps, simulated latencies, TRL replay steps (0: none).
SCENARIOS: dict[str, dict[str, Any]] = {
    "cloud": {
        "batch": 64,
        "generations": 8,
        "turns": 3,
        "steps": 3,
        "latencies": {"start_latency": 0.5, "exec_latency": 0.05, "verify_latency": 1.0, "stop_latency": 0.5},
        "trl_steps": 2,
    },
    "cpu-step": {
        "batch": 16,
        "generations": 4,
        "turns": 3,
        "steps": 3,
        "latencies": {"start_latency": 0.3, "exec_latency": 0.5, "verify_latency": 0.3, "stop_latency": 0.0},
        "trl_steps": 0,
    },
    "smoke": {  # for the benchmark's own test: tiny and fast
        "batch": 4,
        "generations": 2,
        "turns": 2,
        "steps": 2,
        "latencies": {"start_latency": 0.05, "exec_latency": 0.2, "verify_latency": 0.05, "stop_latency": 0.0},
        "trl_steps": 2,
    },
}
TRAINERS = ("grpo-trainer", "harbor-grpo-trainer", "harbor-grpo-trainer-prefetch")
#: Suffix of a run with zero-latency execs (the limit's run; see the module doc).
ZERO_EXEC = "/zero-exec"


@dataclass
class TrainerStep:
    """One training step: wall time and the trainer thread's environment time by part (seconds)."""

    wall: float
    reset: float
    tools: float
    rewards: float
    generation: float

    @property
    def env(self) -> float:
        """The step's environment time."""
        return self.reset + self.tools + self.rewards


@dataclass
class TrainerRun:
    """One trainer over ``steps`` steps."""

    trainer: str
    batch: int
    turns: int
    steps: list[TrainerStep] = field(default_factory=list)
    logged_env_wait: list[float] = field(default_factory=list)  # HarborGRPOTrainer's own env/wait_s
    #: With prefetch: per step, the resets that claimed a sandbox started ahead.
    logged_prefetch_hits: list[float] = field(default_factory=list)

    def later(self, attr: str) -> float:
        """Mean of ``attr`` over the steps after the first (model warm-up and first starts excluded)."""
        later = self.steps[1:] or self.steps
        return statistics.fmean(getattr(s, attr) for s in later)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["step_env"] = [round(s.env, 4) for s in self.steps]
        data["later_wall_mean"] = round(self.later("wall"), 4)
        data["later_env_mean"] = round(self.later("env"), 4)
        return data


def _timed(base: type) -> type:
    """``base`` (a GRPOTrainer class) with the benchmark's timers around its own methods."""

    class Timed(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.bench_steps: list[dict[str, float]] = []
            self._bench: dict[str, float] = {}
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            self._bench = {"reset": 0.0, "tools": 0.0, "rewards": 0.0, "generation": 0.0, "begin": time.perf_counter()}
            output = super()._generate_and_score_completions(inputs)
            self.bench_steps.append(dict(self._bench))
            return output

        def _generate(self, prompts):
            self._bench["reset"] = time.perf_counter() - self._bench["begin"]
            return super()._generate(prompts)

        def _generate_single_turn(self, *args, **kwargs):
            begin = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self._bench["generation"] += time.perf_counter() - begin

        def _tool_call_loop(self, *args):
            begin, generation = time.perf_counter(), self._bench["generation"]
            try:
                return super()._tool_call_loop(*args)
            finally:
                inside = self._bench["generation"] - generation
                self._bench["tools"] += time.perf_counter() - begin - inside

        def _calculate_rewards(self, *args):
            begin = time.perf_counter()
            try:
                return super()._calculate_rewards(*args)
            finally:
                self._bench["rewards"] += time.perf_counter() - begin

    Timed.__name__ = f"Timed{base.__name__}"
    return Timed


class _Script:
    """``model.generate``: a bash call on each of the first ``turns`` turns, then a final answer."""

    def __init__(self, tokenizer: Any, turns: int) -> None:
        from benchmarks.tiny_model import encode_exact

        self.tokenizer = tokenizer
        self.turns = turns
        call = json.dumps({"name": "bash", "arguments": {"command": "ls /workdir"}})
        self.call_ids = encode_exact(tokenizer, f"<tool_call>\n{call}\n</tool_call><|im_end|>")
        self.final_ids = encode_exact(tokenizer, "Done.<|im_end|>")

    def __call__(self, input_ids: Any, **kwargs: Any) -> Any:
        import torch

        pad = self.tokenizer.pad_token_id
        rows = []
        for row in input_ids.tolist():
            done = self.tokenizer.decode([t for t in row if t != pad]).count("<tool_response>")
            rows.append(self.call_ids if done < self.turns else self.final_ids)
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=input_ids.device)
        return torch.cat([input_ids, completion], dim=-1)


def cpu_grpo_config(
    out: Path, max_steps: int, batch: int, generations: int, completion: int = 512, **overrides: Any
) -> Any:
    """The CPU ``GRPOConfig`` of every trainer benchmark and test: no vLLM or saving, a log line a step, seed 0.

    ``overrides``: any other ``GRPOConfig`` field (they win over these defaults).
    """
    from trl import GRPOConfig

    fields: dict[str, Any] = {
        "output_dir": str(out),
        "use_vllm": False,
        "max_steps": max_steps,
        "per_device_train_batch_size": batch,
        "num_generations": generations,
        "max_completion_length": completion,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "bf16": False,
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "seed": 0,
        "disable_tqdm": True,
    }
    return GRPOConfig(**{**fields, **overrides})


def run_trainer(trainer: str, scenario: dict[str, Any], model_dir: Path, tokenizer: Any, out: Path) -> TrainerRun:
    """Train ``scenario["steps"]`` steps with one trainer; time each step."""
    from unittest.mock import patch

    from transformers import TrainerCallback
    from trl import GRPOTrainer

    import shim
    from harbor_async.suites import example_suite_path
    from shim.trainer import HarborGRPOTrainer

    batch, turns = scenario["batch"], scenario["turns"]
    spec = shim.HarborSpec(
        example_suite_path(),
        environment_type="simulated",
        environment_kwargs=scenario["latencies"],
        max_live_sandboxes=2 * batch + 8,  # this batch's sandboxes and the last one's, while they stop
    )
    args = cpu_grpo_config(
        out / trainer, scenario["steps"], batch, scenario["generations"], completion=1024, learning_rate=1e-3
    )
    walls: list[float] = []

    class Wall(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            walls.append(-time.perf_counter())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            walls[-1] += time.perf_counter()

    harbor = trainer.startswith("harbor-grpo-trainer")
    cls = _timed(HarborGRPOTrainer if harbor else GRPOTrainer)
    extra = {"prefetch": True} if trainer.endswith("-prefetch") else {}
    instance = cls(
        model=str(model_dir),
        processing_class=tokenizer,
        args=args,
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
        callbacks=[Wall()],
        **extra,
    )
    try:
        with patch.object(instance.model, "generate", side_effect=_Script(tokenizer, turns)):
            instance.train()
    finally:
        spec.close()
    run = TrainerRun(trainer, batch, turns)
    for wall, parts in zip(walls, instance.bench_steps, strict=True):
        run.steps.append(TrainerStep(wall, parts["reset"], parts["tools"], parts["rewards"], parts["generation"]))
    run.logged_env_wait = [e["env/wait_s"] for e in instance.state.log_history if "env/wait_s" in e]
    run.logged_prefetch_hits = [e["env/prefetch_hits"] for e in instance.state.log_history if "env/prefetch_hits" in e]
    return run


def _child_env() -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")


def zero_exec(scenario: dict[str, Any]) -> dict[str, Any]:
    """``scenario`` with zero-latency execs, every other latency kept (the limit's run)."""
    return {**scenario, "latencies": {**scenario["latencies"], "exec_latency": 0.0}}


def run_one(name: str, trainer: str, log: Any = print) -> dict[str, Any]:
    """One trainer on one scenario, in this process (tiny model built here); its run as JSON.

    ``trainer`` may end in :data:`ZERO_EXEC`: that trainer with zero-latency execs.
    """
    _child_env()
    from benchmarks.tiny_model import build_tiny_qwen3

    scenario = SCENARIOS[name]
    if trainer.endswith(ZERO_EXEC):
        scenario, trainer = zero_exec(scenario), trainer.removesuffix(ZERO_EXEC)
    with tempfile.TemporaryDirectory(prefix="trainer-step-") as tmp:
        out = Path(tmp)
        model_dir, tokenizer = build_tiny_qwen3(out / "tiny", corpus=["ls /workdir", "Done."])
        log(f"{name}: {trainer}, B={scenario['batch']}, T={scenario['turns']}, {scenario['steps']} steps")
        run = run_trainer(trainer, scenario, model_dir, tokenizer, out)
    if scenario is not SCENARIOS[name]:
        run.trainer += ZERO_EXEC
    for i, step in enumerate(run.steps):
        log(f"  step {i + 1}: wall {step.wall:.2f} s, env {step.env:.2f} s (reset {step.reset:.2f}, "
            f"tools {step.tools:.2f}, rewards {step.rewards:.2f}), generation {step.generation:.2f} s")  # fmt: skip
    return run.to_dict()


def run_scenario(
    name: str, trainers: tuple[str, ...] = TRAINERS, log: Any = print, repeats: int = 1
) -> dict[str, Any]:
    """Every trainer on one scenario, each in a fresh process, then TRL's env (the replay) where asked.

    A fresh process per trainer: a second trainer in the same process computes
    its model steps markedly slower (measured: 9 s instead of 4 s a step), which
    would bias the comparison by the order of the runs. Each Harbor trainer is
    also run with zero-latency execs (``limit_runs``, for the limit). With
    ``repeats`` > 1 the whole sequence is made that many times, one after
    another, so that a slow spell of a shared machine hits every trainer alike.
    """
    scenario = SCENARIOS[name]
    result: dict[str, Any] = {"scenario": name, **scenario, "repeats": repeats, "runs": [], "limit_runs": []}
    result["trl_env"] = None
    limits = [t + ZERO_EXEC for t in trainers if t.startswith("harbor-grpo-trainer")]
    for _ in range(repeats):
        for trainer in (*trainers, *limits):
            with tempfile.TemporaryDirectory(prefix="trainer-step-run-") as tmp:
                target = Path(tmp) / "run.json"
                command = [sys.executable, "-m", "benchmarks.trainer_step", "--scenario", name, "--single", trainer]
                subprocess.run([*command, "--run-json", str(target)], check=True)
                result["limit_runs" if trainer in limits else "runs"].append(json.loads(target.read_text()))
    if scenario["trl_steps"]:
        _child_env()
        from benchmarks.grpo_step import run_grpo_steps

        log(f"{name}: TRL's env (GRPO-step replay), B={scenario['batch']}, {scenario['trl_steps']} steps")
        trl = run_grpo_steps(
            "trl",
            backend="simulated",
            batch=scenario["batch"],
            turns=scenario["turns"],
            steps=scenario["trl_steps"],
            backend_kwargs=scenario["latencies"],
            on_step=lambda i, t: log(f"  TRL step {i + 1}: {t.total:.2f} s"),
        )
        result["trl_env"] = trl.to_dict()
    result["summary"] = summarize(result)
    return result


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One run per trainer: its later-step means are the medians over the trainer's repeats."""
    by_trainer: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_trainer.setdefault(run["trainer"], []).append(run)
    merged = {}
    for trainer, repeats in by_trainer.items():
        merged[trainer] = {
            **repeats[0],
            "later_wall_mean": round(statistics.median(r["later_wall_mean"] for r in repeats), 4),
            "later_env_mean": round(statistics.median(r["later_env_mean"] for r in repeats), 4),
            "later_wall_repeats": [r["later_wall_mean"] for r in repeats],
        }
    return merged


def limits(result: dict[str, Any]) -> dict[str, Any]:
    """Each Harbor trainer's limit (its zero-exec step + T × exec latency) and its step over that limit."""
    runs = _median_runs(result["runs"])
    ideal = _median_runs(result.get("limit_runs") or [])
    exec_latency = float(result["latencies"]["exec_latency"])
    found: dict[str, Any] = {}
    for trainer, run in runs.items():
        zero = ideal.get(trainer + ZERO_EXEC)
        if zero is None:
            continue
        limit = zero["later_wall_mean"] + result["turns"] * exec_latency
        found[f"{trainer}/zero_exec_wall_s"] = zero["later_wall_mean"]
        found[f"{trainer}/limit_s"] = round(limit, 4)
        found[f"{trainer}/over_limit"] = round(run["later_wall_mean"] / limit, 3)
        # The same in the trainer thread's env waits: the seconds lost to the env, free of the model's noise
        # (on a shared machine a step's compute varies more than the whole margin).
        ideal_env = zero["later_env_mean"] + result["turns"] * exec_latency
        found[f"{trainer}/env_over_limit_s"] = round(run["later_env_mean"] - ideal_env, 4)
    return found


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Later-step means (medians over repeats), each Harbor trainer over its limit, and the ratios the issue asks for."""
    runs = _median_runs(result["runs"])
    summary: dict[str, Any] = {}
    plain, harbor = runs.get("grpo-trainer"), runs.get("harbor-grpo-trainer")
    for key, run in runs.items():
        summary[f"{key}/later_wall_s"] = run["later_wall_mean"]
        summary[f"{key}/later_env_s"] = run["later_env_mean"]
        if len(run["later_wall_repeats"]) > 1:
            summary[f"{key}/later_wall_repeats_s"] = run["later_wall_repeats"]
    summary.update(limits(result))
    if plain and harbor:
        summary["wall_ratio_plain_over_harbor"] = round(plain["later_wall_mean"] / harbor["later_wall_mean"], 2)
        summary["env_ratio_plain_over_harbor"] = round(plain["later_env_mean"] / harbor["later_env_mean"], 2)
    prefetched = runs.get("harbor-grpo-trainer-prefetch")
    if harbor and prefetched:
        summary["wall_ratio_harbor_over_prefetch"] = round(harbor["later_wall_mean"] / prefetched["later_wall_mean"], 2)
        summary["env_ratio_harbor_over_prefetch"] = round(harbor["later_env_mean"] / prefetched["later_env_mean"], 2)
    if result.get("trl_env") and harbor:
        summary["trl_env/later_s"] = result["trl_env"]["later_step_mean"]
        summary["env_ratio_trl_over_harbor"] = round(result["trl_env"]["later_step_mean"] / harbor["later_env_mean"], 1)
    if result.get("trl_env") and prefetched:
        summary["env_ratio_trl_over_prefetch"] = round(
            result["trl_env"]["later_step_mean"] / prefetched["later_env_mean"], 1
        )
    if plain and prefetched:
        summary["wall_ratio_plain_over_prefetch"] = round(plain["later_wall_mean"] / prefetched["later_wall_mean"], 2)
    return summary


def limit_lines(summary: dict[str, Any]) -> list[str]:
    """One printed line per Harbor trainer: its step, its limit and the ratio."""
    lines = []
    for trainer in TRAINERS:
        if f"{trainer}/limit_s" in summary:
            lines.append(
                f"{trainer}: step {summary[f'{trainer}/later_wall_s']:.2f} s, limit {summary[f'{trainer}/limit_s']:.2f} s "
                f"(zero-exec step {summary[f'{trainer}/zero_exec_wall_s']:.2f} s + T x exec), "
                f"step / limit {summary[f'{trainer}/over_limit']:.2f}; env waits over the limit's "
                f"{summary[f'{trainer}/env_over_limit_s']:.2f} s"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="cloud")
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each trainer (medians in the summary)")
    parser.add_argument(  # a child: one trainer
        "--single", choices=[*TRAINERS, *(t + ZERO_EXEC for t in TRAINERS)], help=argparse.SUPPRESS
    )
    parser.add_argument("--run-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from benchmarks.provenance import begin

    begin()
    if args.single:
        args.run_json.write_text(json.dumps(run_one(args.scenario, args.single)))
        return
    trainers = tuple(t.strip() for t in args.trainers.split(",") if t.strip())
    result = run_scenario(args.scenario, trainers, repeats=max(1, args.repeats))
    from benchmarks.report import write_json

    path = write_json(args.out / f"trainer-step-{args.scenario}.json", "trainer-step", result)
    print(json.dumps(result["summary"], indent=2))
    for line in limit_lines(result["summary"]):
        print(line)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
