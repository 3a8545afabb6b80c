"""``eval``'s agent phase: a tool harness driven by a model server, as in training.

A :class:`HarnessAgent` is one episode's :class:`~harbor_async.episodes.runner.EpisodeAgent`:
it builds a fresh harness, binds it to the episode and prepares it in the start
phase (as the shim's ``reset()`` does), then runs the
:class:`~harbor_async.agents.tool_loop.ToolLoop` over the harness's tools and records the
transcript, usage and finish reason. Blame: a model server that kept failing is
``model_server`` (rerun by a resume); a command the sandbox could not run is
``infrastructure``; running out of the agent's time is the agent's.

``-a`` may name one of Harbor's agents instead (``terminus-2``, ``module:Class``):
:func:`resolve_eval_agent` tells which, and :func:`eval_episode_agent` makes
each episode's agent: a :class:`HarnessAgent`, or a
:class:`~harbor_async.agents.harbor_episode.HarborAgentRunner` pointed at the
server (``hosted_vllm/<served name>`` at its URL).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from harbor_async.agents.harbor import (
    HarborAgentSpec,
    agent_class,
    agent_names,
    is_harbor_agent,
)
from harbor_async.backends import resolve_backend
from harbor_async.core.errors import (
    AgentConfigError,
    EpisodeDeadlineError,
    EvalConfigError,
    HarnessError,
    Phase,
    SandboxTimeout,
)
from harbor_async.core.moved import renamed_attribute
from harbor_async.harnesses import HARNESSES, Harness, harness_factory
from harbor_async.harnesses.toolset import build_toolset

if TYPE_CHECKING:
    from harbor_async.agents.task_checks import Driver
    from harbor_async.agents.tool_loop import Sampling, ToolLoop
    from harbor_async.episodes.episode import Episode
    from harbor_async.jobs.settings import JobSettings


@dataclass
class HarnessAgent:
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

    agent: ToolLoop
    harness: Callable[[], Harness]
    name: str
    attempt: int = 0
    timeout: float | None = None
    _bound: Harness | None = None

    async def setup(self, episode: Episode) -> None:
        """Build the harness, bind it to the episode and prepare the sandbox (base folders, ``_setup``)."""
        self._bound = self.harness()
        self._bound._bind(episode)
        await self._bound._prepare()

    async def act(self, episode: Episode) -> None:
        """Run the loop until the model stops, a limit or the deadline; record what happened."""
        harness, record = self._bound, episode.record
        assert harness is not None and episode.sandbox is not None
        harness._bind(episode)  # again for each step of a multi-step task
        budget = episode.agent_budget  # the one budget: our own timeout, else the task's or the engine's
        left = episode.sandbox.deadline_left
        by_deadline = left is not None and (budget is None or left < budget)
        sampling: Sampling = self.agent.sampling
        if sampling.seed is not None:
            sampling = sampling.model_copy(update={"seed": sampling.seed + self.attempt})
        try:
            prompt = harness._prompt(episode.task) if episode.step is None else episode.instruction + harness.PROMPT_SUFFIX
            result = await self.agent.run(harness, prompt, timeout=left if by_deadline else budget, sampling=sampling)
        finally:
            harness._bind(None)
        if result.finish_reason == "agent_timeout" and by_deadline:
            result.finish_reason = "episode_deadline"
        usage: dict[str, int | float] = {**result.usage, "tool_calls": result.tool_calls, "tool_failures": result.tool_failures}
        if episode.step is not None and record.transcript:  # a later step of a multi-step task: one conversation each
            record.transcript = [*record.transcript, *result.messages]
            usage = {k: usage.get(k, 0) + record.usage.get(k, 0) for k in {*usage, *record.usage}}
        else:
            record.transcript = result.messages
        record.usage = usage
        record.finish_reason = result.finish_reason
        record.seconds.update(model=round(result.model_seconds, 4), tools=round(result.tool_seconds, 4))
        where = (episode.task.name, record.sandbox or "-")
        if result.error is not None:
            episode.fail_with(result.error, "model")
            episode.error = result.error  # no verdict: the model was not judged
        elif episode.exec_errors:  # the model saw "could not be run": not a fair episode to score
            episode.fail_with(episode.exec_errors[0])
            episode.error = episode.exec_errors[0]
        elif result.finish_reason == "agent_timeout":
            episode.fail_with(SandboxTimeout(Phase.AGENT, *where, f"the agent ran past its {budget:g} s budget"))
        elif result.finish_reason == "episode_deadline":
            deadline = episode.sandbox.timeouts.episode
            episode.fail_with(EpisodeDeadlineError(Phase.AGENT, *where, f"the episode reached its {deadline:g} s deadline"))


def model_episode_agent(settings: JobSettings, agent: ToolLoop, harness: Callable[[], Harness], attempt: int) -> HarnessAgent:
    """The agent phase of one evaluation episode (a driver's or a cluster worker's)."""
    return HarnessAgent(agent, harness, settings.agent, attempt=attempt, timeout=agent.limits.timeout)


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

    Raises :class:`EvalConfigError` (or the backend's :class:`~harbor_async.core.errors.BackendError`).
    """
    resolve_backend(backend).environment_class()
    try:
        factory = harness_factory(agent, backend)
        build_toolset(factory())  # no sandbox: only the schemas
    except (HarnessError, TypeError, ValueError) as exc:
        raise EvalConfigError(f"harness {agent!r}: {exc}") from exc
    return factory


def resolve_eval_agent(settings: JobSettings) -> HarborAgentSpec | None:
    """``eval``'s ``-a``: a Harbor agent (its spec; the class loads) or ``None`` for a harness (its factory checked).

    Raises :class:`EvalConfigError`: an unknown name, a class that does not load, ``--ak`` with a harness.
    """
    if not is_harbor_agent(settings.agent):
        if ":" not in settings.agent and settings.agent not in HARNESSES:
            raise EvalConfigError(
                f"unknown agent {settings.agent!r}; choose a tool harness ({', '.join(sorted(HARNESSES))}), one of "
                f"Harbor's agents ({', '.join(agent_names())}), or module:Class"
            )
        if settings.agent_kwargs:
            raise EvalConfigError(f"--ak sets a Harbor agent's options; -a {settings.agent} is a tool harness")
        if settings.capture:
            raise EvalConfigError(f"--capture records a Harbor agent's model calls; -a {settings.agent} is a tool harness (its record keeps the transcript)")
        resolve_harness(settings.agent, settings.environment_type)
        return None
    try:
        agent_class(settings.agent)
    except AgentConfigError as exc:
        raise EvalConfigError(str(exc)) from None
    return HarborAgentSpec(settings.agent, None, dict(settings.agent_kwargs))


def harbor_agent_at(spec: HarborAgentSpec, settings: JobSettings, model: str, base_url: str) -> HarborAgentSpec:
    """``spec`` pointed at ``model`` on ``base_url`` as every episode of the eval runs it (locally or on a worker)."""
    return spec.with_server(model, base_url, api_key_name=settings.api_key_name, temperature=settings.sampling.temperature)


def eval_driver(spec: HarborAgentSpec | None) -> Driver:
    """``eval``'s driver: a tool harness (no MCP servers, no skills), or a Harbor agent (checked against each task)."""
    from harbor_async.agents.task_checks import EVAL

    return EVAL if spec is None else replace(EVAL, model_harness=False, agent=spec.agent_class)


def check_harbor_options(spec: HarborAgentSpec, settings: JobSettings, model: str) -> None:
    """Build the agent once as an episode will (nothing started): bad ``--ak`` is an :class:`EvalConfigError` now."""
    pointed = spec.with_server(model, "http://127.0.0.1:8000/v1", api_key_name=settings.api_key_name)
    try:
        pointed.check()
        if settings.capture:
            pointed.check_capture()
    except AgentConfigError as exc:
        raise EvalConfigError(str(exc)) from None


def eval_episode_agent(settings: JobSettings, agent: Any, harness: Callable[[], Harness] | None, attempt: int) -> Any:
    """One evaluation episode's agent: ``agent`` is the model's :class:`~harbor_async.agents.tool_loop.ToolLoop`
    (with ``harness``), or a :class:`HarborAgentSpec` already pointed at the server (see :meth:`HarborAgentSpec.with_server`)."""
    if isinstance(agent, HarborAgentSpec):
        from harbor_async.agents.harbor_episode import HarborAgentRunner

        return HarborAgentRunner(agent, settings.agent, timeout=settings.limits.timeout, capture=settings.capture)
    assert harness is not None
    return model_episode_agent(settings, agent, harness, attempt)

if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any name as defined

    def __getattr__(name: str) -> Any:
        """The old class names of the move (one release, with a DeprecationWarning)."""
        return renamed_attribute(__name__, name)
