"""``eval``'s agent phase: a tool harness driven by a model server, as in training.

A :class:`ModelAgent` is one episode's :class:`~harbor_async.runner.EpisodeAgent`:
it builds a fresh harness, binds it to the episode and prepares it in the start
phase (as the shim's ``reset()`` does), then runs the
:class:`~harbor_async.agent.Agent` loop over the harness's tools and records the
transcript, usage and finish reason. Blame: a model server that kept failing is
``model_server`` (rerun by a resume); a command the sandbox could not run is
``infrastructure``; running out of the agent's time is the agent's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from harbor_async.backends import resolve_backend
from harbor_async.errors import EvalConfigError, FailureClass, HarnessError, Phase
from harbor_async.harnesses import Harness, harness_factory
from harbor_async.harnesses.toolset import build_toolset

if TYPE_CHECKING:
    from harbor_async.agent import Agent, Sampling
    from harbor_async.episode import Episode
    from harbor_async.settings import JobSettings


@dataclass
class ModelAgent:
    """One episode of a harness driven by ``agent`` (a model on a server).

    Args:
        agent: the tool-calling loop of one model (shared by the model's episodes).
        harness: builds a fresh harness instance.
        name: the harness's name, recorded as the record's ``agent``.
        attempt: the repetition index: a sampling seed is offset by it, so that
            the attempts of one task differ (else pass@k is pass@1).
        timeout: the agent's wall-clock budget; ``None``: the episode's agent
            budget (the task's ``[agent] timeout_sec`` or the engine's, multiplied).
    """

    agent: Agent
    harness: Callable[[], Harness]
    name: str
    attempt: int = 0
    timeout: float | None = None
    _bound: Harness | None = None

    async def setup(self, episode: Episode) -> None:
        """Build the harness, bind it to the episode and prepare the sandbox (base folders, ``_setup``)."""
        self._bound = self.harness()
        self._bound._bind(episode)
        if self.timeout is not None:  # the tools' time is bounded as the loop's is
            episode.agent_budget = self.timeout
        await self._bound._prepare()

    async def act(self, episode: Episode) -> None:
        """Run the loop until the model stops, a limit or the deadline; record what happened."""
        harness, record = self._bound, episode.record
        assert harness is not None and episode.sandbox is not None
        harness._bind(episode)  # again for each step of a multi-step task
        budget = episode.agent_budget  # the task's or the engine's, or our own timeout (set up in setup)
        left = episode.sandbox.deadline_left
        by_deadline = left is not None and (budget is None or left < budget)
        sampling: Sampling = self.agent.sampling
        if sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + self.attempt)
        try:
            prompt = harness._prompt(episode.task) if episode.step is None else episode.instruction + harness.PROMPT_SUFFIX
            result = await self.agent.run(harness, prompt, timeout=left if by_deadline else budget, sampling=sampling)
        finally:
            harness._bind(None)
        if result.finish_reason == "agent_timeout" and by_deadline:
            result.finish_reason = "episode_deadline"
        usage = {**result.usage, "tool_calls": result.tool_calls, "tool_failures": result.tool_failures}
        if episode.step is not None and record.transcript:  # a later step of a multi-step task: one conversation each
            record.transcript = [*record.transcript, *result.messages]
            usage = {k: usage.get(k, 0) + record.usage.get(k, 0) for k in {*usage, *record.usage}}
        else:
            record.transcript = result.messages
        record.usage = usage
        record.finish_reason = result.finish_reason
        record.seconds.update(model=round(result.model_seconds, 4), tools=round(result.tool_seconds, 4))
        if result.error is not None:
            episode.fail(FailureClass.MODEL_SERVER, result.error, "model")
            episode.error = result.error  # no verdict: the model was not judged
        elif episode.exec_errors:  # the model saw "could not be run": not a fair episode to score
            episode.fail(FailureClass.INFRASTRUCTURE, episode.exec_errors[0])
            episode.error = episode.exec_errors[0]
        elif result.finish_reason == "agent_timeout":
            episode.fail(FailureClass.AGENT, f"the agent ran past its {budget:g} s budget", Phase.AGENT)
        elif result.finish_reason == "episode_deadline":
            deadline = episode.sandbox.timeouts.episode
            episode.fail(FailureClass.AGENT, f"the episode reached its {deadline:g} s deadline", Phase.AGENT)


def model_episode_agent(settings: JobSettings, agent: Agent, harness: Callable[[], Harness], attempt: int) -> ModelAgent:
    """The agent phase of one evaluation episode (a driver's or a cluster worker's)."""
    return ModelAgent(agent, harness, settings.agent, attempt=attempt, timeout=agent.limits.timeout)


def api_key(name: str | None) -> str:
    """The key in the environment variable ``name`` (Harbor's ``--api-key-name``); never stored in the job."""
    if name is None:
        return "EMPTY"  # local servers ignore it; the client wants one
    value = os.environ.get(name)
    if not value:
        raise EvalConfigError(f"--api-key-name {name}: the environment variable {name} is not set")
    return value


def resolve_harness(agent: str, backend: str) -> Callable[[], Harness]:
    """The harness factory for ``-a`` on ``backend``, checked: it loads and its tools have schemas.

    Raises :class:`EvalConfigError` (or the backend's :class:`~harbor_async.errors.BackendError`).
    """
    resolve_backend(backend).environment_class()
    try:
        factory = harness_factory(agent, backend)
        build_toolset(factory())  # no sandbox: only the schemas
    except (HarnessError, TypeError, ValueError) as exc:
        raise EvalConfigError(f"harness {agent!r}: {exc}") from exc
    return factory
