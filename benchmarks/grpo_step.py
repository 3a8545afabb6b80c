"""Environment time of GRPO steps: TRL's own Harbor env against the shim, in one run.

Replays what ``GRPOTrainer`` does to its environments in one training step:
B ``reset()`` calls one after another; T turns in which each rollout's tool
call runs one after another (as ``_tool_call_loop`` does); the reward function
over all B environments; then the next step's resets. Model time is left out:
only the time spent in environment calls counts.

TRL's env (``trl.experimental.harbor.HarborBashEnv``) hands ``environment_type``
to Harbor as a type name only; on the ``local`` and ``simulated`` backends it is
driven through :mod:`benchmarks.reference`, the smallest subclass that changes
nothing but how the Harbor environment is created (by import path).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from harbor_async.tasks.suite import load_suite

IMPLEMENTATIONS = ("trl", "shim", "shim-rounds", "shim-prefetch", "shim-prefetch-early")
#: ``shim-rounds``: the shim's envs with each turn's calls dispatched by HarborGRPOTrainer's own
#: round code (:class:`shim.tool_rounds.ToolCallsAhead`, all rollouts at once) instead of one after another.
#: ``shim-prefetch``: and the next step's sandboxes started once this step's rewards are in (where
#: HarborGRPOTrainer starts them), through its prefetch (:mod:`shim.prefetch`), released once the next
#: step's resets are in; ``shim-prefetch-early``: started when the rewards begin instead, beside the
#: verifiers. Every step prefetches, the last one too (released at the end), so later steps are the
#: steady state. The starts hide behind ``optimise_seconds`` (and, early, the verifiers).

#: Simulated cloud latencies (seconds) from the issue: start, exec, verify, stop.
CLOUD_LATENCIES = {"start_latency": 0.5, "exec_latency": 0.05, "verify_latency": 1.0, "stop_latency": 0.5}


@dataclass
class StepTimes:
    """Seconds of environment time in one step, by part."""

    reset: float
    tools: float
    rewards: float

    @property
    def total(self) -> float:
        """The step's environment time."""
        return self.reset + self.tools + self.rewards


@dataclass
class GrpoRun:
    """One implementation on one backend at one batch size."""

    implementation: str
    backend: str
    batch: int
    turns: int
    steps: list[StepTimes] = field(default_factory=list)
    teardown: float = 0.0
    mean_reward: float = 0.0
    #: On ``docker``'s fast start: every start's Compose calls, by kind (count, skipped, seconds).
    start_profile: dict = field(default_factory=dict)
    #: ``shim-prefetch``: per step, the resets that claimed a sandbox started ahead.
    prefetch_hits: list[int] = field(default_factory=list)
    #: Seconds paused after each step's rewards, standing in for an optimiser step on a GPU (host CPUs idle).
    optimise_seconds: float = 0.0

    @property
    def later_step_mean(self) -> float:
        """Mean environment time of the steps after the first (the steady state)."""
        later = self.steps[1:] or self.steps
        return sum(s.total for s in later) / len(later)

    def to_dict(self) -> dict:
        """Plain-JSON form, with totals."""
        data = asdict(self)
        data["step_totals"] = [round(s.total, 4) for s in self.steps]
        data["later_step_mean"] = round(self.later_step_mean, 4)
        return data


def _commands(turns: int, gold: str | None) -> list[str]:
    """The scripted tool calls of one rollout: look around, then submit."""
    answer = (gold or "unknown").replace("'", "")
    looks = ["ls -la /workdir", "head -n 5 /workdir/* 2>/dev/null | head -n 20", "pwd"]
    return [looks[t % len(looks)] for t in range(turns - 1)] + [f"printf '%s' '{answer}' > /workdir/answer.txt"]


def _make_envs(implementation: str, backend: str, batch: int, backend_kwargs: dict[str, Any]) -> tuple[list, Callable]:
    """``batch`` envs of one implementation and its reward function over them."""
    if implementation == "trl":
        from trl.experimental.harbor._spec import _outcome_reward_func

        from benchmarks.reference import ReferenceHarborBashEnv

        envs = [ReferenceHarborBashEnv(environment_type=backend, backend_kwargs=backend_kwargs) for _ in range(batch)]
        return envs, _outcome_reward_func
    if implementation.startswith("shim"):
        from shim import HarborBashEnv
        from shim.rewards import _outcome_reward_func

        envs = [
            HarborBashEnv(environment_type=backend, environment_kwargs=backend_kwargs, max_live_sandboxes=2 * batch + 8)
            for _ in range(batch)
        ]
        return envs, _outcome_reward_func
    raise ValueError(f"unknown implementation {implementation!r}; use one of {IMPLEMENTATIONS}")


def _close(implementation: str, envs: Sequence[Any]) -> None:
    if implementation == "trl":
        from benchmarks.reference import close_reference_env

        for env in envs:
            close_reference_env(env)
    else:
        for env in envs:
            env.close()


def run_grpo_steps(
    implementation: str,
    *,
    backend: str,
    batch: int,
    turns: int = 3,
    steps: int = 3,
    suite: str | None = None,
    backend_kwargs: dict[str, Any] | None = None,
    on_step: Callable[[int, StepTimes], None] | None = None,
    optimise_seconds: float = 0.0,
) -> GrpoRun:
    """Replay ``steps`` GRPO steps of ``batch`` rollouts and time the environment calls.

    ``optimise_seconds``: a pause after each step's rewards (not counted as
    environment time), standing in for the optimiser step that a prefetch hides starts behind.
    """
    tasks = load_suite(suite).tasks
    envs, reward_func = _make_envs(implementation, backend, batch, dict(backend_kwargs or {}))
    run = GrpoRun(implementation, backend, batch, turns, optimise_seconds=optimise_seconds)
    rewards: list[float] = []

    def picks_of(step: int) -> list[Any]:
        return [tasks[(step * batch + i) % len(tasks)] for i in range(batch)]

    prefetching = implementation.startswith("shim-prefetch")
    if prefetching:
        from shim import prefetch
    try:
        for step in range(steps):
            picks = picks_of(step)
            begin = time.perf_counter()
            for env, task in zip(envs, picks, strict=True):
                env.reset(task_dir=str(task.task_dir))
            if prefetching:
                run.prefetch_hits.append(prefetch.release().hits)
            after_reset = time.perf_counter()
            scripts = [_commands(turns, task.config.metadata.get("gold_answer")) for task in picks]
            for turn in range(turns):
                if implementation == "shim-rounds" or prefetching:
                    _round(envs, [script[turn] for script in scripts])
                    continue
                for env, script in zip(envs, scripts, strict=True):
                    env.bash(script[turn])
            after_tools = time.perf_counter()
            following = [str(task.task_dir) for task in picks_of(step + 1)]
            if implementation == "shim-prefetch-early":
                prefetch.prefetch(envs[0], following)
            rewards = reward_func(environments=envs)
            if implementation == "shim-prefetch":
                prefetch.prefetch(envs[0], following)
            end = time.perf_counter()
            times = StepTimes(after_reset - begin, after_tools - after_reset, end - after_tools)
            run.steps.append(times)
            if on_step is not None:
                on_step(step, times)
            time.sleep(optimise_seconds)
    finally:
        begin = time.perf_counter()
        if prefetching:
            prefetch.release()
        _close(implementation, envs)
        run.teardown = time.perf_counter() - begin
    run.mean_reward = sum(rewards) / len(rewards) if rewards else 0.0
    if backend in ("docker", "docker-fast"):  # the fast start records its calls; Harbor's start records none
        from harbor_async.backends.docker.fast_start import PROFILES, summarize_profiles

        run.start_profile = summarize_profiles(PROFILES)
        PROFILES.clear()
    return run


def _round(envs: Sequence[Any], commands: Sequence[str]) -> None:
    """One turn through HarborGRPOTrainer's dispatch: TRL's serial calls, each rollout's ``bash`` run ahead at once."""
    from shim.tool_rounds import ToolCallsAhead, worker_threads

    calls = [{"type": "function", "function": {"name": "bash", "arguments": {"command": c}}} for c in commands]
    completions = [[{"role": "assistant", "tool_calls": [call]}] for call in calls]
    with ToolCallsAhead(completions, [{"bash": env.bash} for env in envs], worker_threads(len(calls))) as ahead:
        for tools, call in zip(ahead.tool_dicts(), calls, strict=True):  # as TRL's loop asks, one after another
            tools["bash"](**call["function"]["arguments"])
