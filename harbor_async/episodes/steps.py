"""Multi-step tasks (``[[steps]]``), run as Harbor's ``MultiStepTrial`` runs them, in one sandbox.

For each step, in order: the grading files a previous step's verifier left in
the sandbox are removed and the agent's log folder emptied; the step's
``workdir/`` is uploaded into the working directory and its ``setup.sh`` run
there; the step's healthcheck runs; the agent acts on the step's instruction
within the step's budget; the step's verifier runs (the step's ``tests/`` over
the task's shared ``tests/``, the step's ``[verifier.env]``). A step whose
setup, healthcheck or verifier fails without a reward ends the task, as does
a reward under the step's ``min_reward``. The task's reward is Harbor's:
``multi_step_reward_strategy = "final"`` takes the last step's rewards, the
default ``"mean"`` the per-key mean over the steps that have a reward (a key a
step lacks counts 0), where, unlike Harbor, a step whose tests ran and left no
reward counts as a 0: the sandbox's state must not drop a failed step.

Each step is one entry of the record's ``steps``; failures of the
infrastructure (a sandbox that could not run a command) end the episode as
they end a single-step one.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

from harbor_async.backends import enter_network_phase
from harbor_async.core.errors import (
    FinalStepRewardError,
    Phase,
    SandboxError,
    VerifierFailure,
)
from harbor_async.core.results import scalar_reward
from harbor_async.episodes.judging import judge

if TYPE_CHECKING:
    from harbor.models.task.config import StepConfig

    from harbor_async.episodes.episode import Episode


async def run_steps(episode: Episode, actor: Any) -> None:
    """Run every step of the episode's task (its sandbox is up, ``actor``'s setup done); settle the reward.

    ``actor`` is the episode's :class:`~harbor_async.episodes.runner.EpisodeAgent`; it acts once per step.

    Never raises for a step's failure (it is in the step's entry, and ends the
    task); cancellation propagates.
    """
    from harbor.models.trial.paths import EnvironmentPaths

    sandbox, task = episode.sandbox, episode.task
    assert sandbox is not None
    paths = EnvironmentPaths.for_os(task.config.environment.os)
    judged: list[dict[str, float | int]] = []
    for step in task.config.steps or []:
        entry: dict[str, Any] = {"name": step.name, "reward": None, "rewards": {}, "error": None}
        episode.record.steps.append(entry)
        episode.step = step
        episode.enter(Phase.AGENT)
        try:
            await _prepare(episode, step, paths)
        except _StepFailed as failed:
            entry["error"] = str(failed)
            break
        except SandboxError as exc:
            episode.fail_with(exc)
            entry["error"] = str(exc)
            return
        await actor.act(episode)
        failure = episode.record.failure
        if episode.error is not None or (failure is not None and not failure.scored):
            entry["error"] = episode.record.error
            return  # the model server or the sandbox failed: no verdict on this episode
        episode.enter(Phase.VERIFY)
        try:
            result = await judge(episode, step)
        except VerifierFailure as exc:
            entry["error"] = str(exc)
            episode.record.verifier_output = exc.output or episode.record.verifier_output
            if not judged:  # no step has a reward: the episode's verifier failed
                episode.fail_with(exc)
            else:  # its tests ran and left no reward (what the agent left can do that): the step scores 0
                judged.append({})  # (Harbor leaves it out of the mean, which lets an agent drop a step it failed)
            break
        except SandboxError as exc:
            episode.fail_with(exc)
            entry["error"] = str(exc)
            return
        if result is None:  # no verifier (--disable-verification): the next step's agent runs all the same
            continue
        entry["reward"], entry["rewards"] = result.reward, dict(result.rewards)
        episode.record.verifier_output = result.output
        judged.append(dict(result.rewards))
        if (below := _below_min_reward(result.rewards, step.min_reward)) is not None:
            entry["error"] = below
            break
    episode.step = None
    _settle(episode, judged)


class _StepFailed(Exception):
    """A step's setup or healthcheck failed: the task ends there (not the infrastructure's failure)."""


async def _prepare(episode: Episode, step: StepConfig, paths: Any) -> None:
    """What Harbor does before a step's agent: clean up after the last verifier, upload, set up, check health."""
    from harbor.environments.base import HealthcheckError

    sandbox, task = episode.sandbox, episode.task
    assert sandbox is not None
    folders = " ".join(shlex.quote(str(p)) for p in (paths.verifier_dir, paths.tests_dir, paths.agent_dir))
    await sandbox.exec(
        f"for d in {folders}; do mkdir -p $d && find $d -mindepth 1 -delete; done; chmod 777 {folders}", user="root"
    )
    sandbox.environment.default_user = step.agent.user if step.agent.user is not None else task.config.agent.user
    found = await sandbox.exec("pwd")
    workdir = (found.stdout or "/").strip() or "/"
    step_workdir = task.paths.step_workdir_dir(step.name)
    if step_workdir.is_dir():
        task.paths.validate_input_tree(step_workdir)
        await sandbox.upload(step_workdir, workdir)
    if task.paths.step_setup_path(step.name).exists():
        ran = await sandbox.exec(f"bash {shlex.quote(workdir.rstrip('/') + '/setup.sh')}")
        if ran.exit_code != 0:
            raise _StepFailed(f"step {step.name!r}: setup.sh exited with code {ran.exit_code}: {ran.output[-500:]}")
    if step.healthcheck is not None:
        try:
            await sandbox.environment.run_healthcheck(step.healthcheck)
        except HealthcheckError as exc:
            raise _StepFailed(f"step {step.name!r}: healthcheck failed: {exc}") from exc
    await enter_network_phase(sandbox.environment, task, "agent", step)
    episode.tool_seconds = 0.0  # each step has its own agent budget
    episode.agent_budget = episode.agent_budget_for(step)


def _below_min_reward(rewards: dict[str, float | int], min_reward: float | dict[str, float] | None) -> str | None:
    """Why the step's rewards end the task (Harbor's rule: a missing key is minus infinity), else ``None``."""
    if min_reward is None:
        return None
    thresholds = {"reward": min_reward} if isinstance(min_reward, (int, float)) else min_reward
    for key, threshold in thresholds.items():
        actual = rewards.get(key, float("-inf"))
        if actual < threshold:
            return f"{key}={actual} below min_reward {threshold}: the remaining steps are skipped"
    return None


def _settle(episode: Episode, judged: list[dict[str, float | int]]) -> None:
    """The task's reward from its steps' (Harbor's ``multi_step_reward_strategy``)."""

    record = episode.record
    if not judged or not record.judged:
        return
    strategy = getattr(episode.task.config.multi_step_reward_strategy, "value", None) or "mean"
    if strategy == "final":
        last = record.steps[-1]
        rewards = dict(last["rewards"]) if last["reward"] is not None else {}
    else:
        keys = {key for rewards in judged for key in rewards}
        rewards = {key: sum(r.get(key, 0) for r in judged) / len(judged) for key in keys}
    if not rewards:  # "final", and the last step that ran has no reward
        sandbox = record.sandbox or "-"
        detail = f"step {record.steps[-1]['name']!r}, the final one, has no reward"
        episode.fail_with(FinalStepRewardError(Phase.VERIFY, record.task, sandbox, detail))
        return
    record.rewards, record.reward = rewards, scalar_reward(rewards)
