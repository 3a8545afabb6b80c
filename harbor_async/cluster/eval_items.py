"""``eval``'s episodes as picklable work items for :mod:`harbor_async.cluster.sharding`.

The driver keeps the model server and the job folder; each worker gets an
:class:`EvalItem` (the evaluation's settings, the model, the server's address,
the task folder, the attempt) and runs the episode on its node's engine with
the one episode runner a local ``eval`` uses
(:func:`harbor_async.episodes.runner.run_episode` with a
:class:`~harbor_async.agents.harness_agent.HarnessAgent`): the same harness, tools,
prompt and records. The server must be reachable from every node (not
``127.0.0.1`` across machines); task folders must be at the same path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_async.core.records import EpisodeRecord, episode_key
from harbor_async.jobs.settings import JobSettings
from harbor_async.tasks.suite import suite_task_path

if TYPE_CHECKING:
    from harbor_async.engine.engine import Engine
    from harbor_async.models.checkpoints import ModelSpec


@dataclass(frozen=True)
class EvalItem:
    """One evaluation episode, by value."""

    settings: str  # JobSettings as JSON
    model: str
    checkpoint: str | None
    base_url: str
    task_dir: str
    root: str
    attempt: int


def eval_items(
    settings: JobSettings, models: list[ModelSpec], base_url: str, tasks: list[Any], root: Path, pending: set[str]
) -> list[tuple[str, EvalItem]]:
    """``(key, item)`` for each pending episode of ``models`` on ``tasks``."""
    encoded = json.dumps(settings.to_dict(), sort_keys=True)
    items = []
    for spec in models:
        for task in tasks:
            for attempt in range(settings.n_attempts):
                key = episode_key(suite_task_path(task, root), attempt, spec.name)
                if key in pending:
                    item = EvalItem(
                        encoded, spec.name, spec.checkpoint, base_url, str(task.paths.task_dir), str(root), attempt
                    )
                    items.append((key, item))
    return items


#: This worker's model loops, one per (settings, model, server): their request limiter
#: (``max_concurrent_requests``) and client are shared by the worker's episodes, as a local eval's are.
_AGENTS: dict[tuple[str, str, str], Any] = {}


def _agent(settings: JobSettings, encoded: str, model: str, base_url: str) -> Any:
    import anyio
    import openai

    from harbor_async.agents.harness_agent import api_key
    from harbor_async.agents.tool_loop import ToolLoop

    key = (encoded, model, base_url)
    if key not in _AGENTS:
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key(settings.api_key_name), max_retries=0, timeout=settings.request_timeout
        )
        _AGENTS[key] = ToolLoop(
            client, model, sampling=settings.sampling, limits=settings.limits,
            request_limiter=anyio.CapacityLimiter(settings.max_concurrent_requests),
            tool_limiter=anyio.CapacityLimiter(settings.n_concurrent),
        )  # fmt: skip
    return _AGENTS[key]


async def eval_item(engine: Engine, item: EvalItem) -> EpisodeRecord:
    """The worker's side: run one episode on the node's ``engine`` as a local ``eval`` does.

    The worker's episodes of one model share its model loop (client, request
    limiter): ``max_concurrent_requests`` bounds each node's requests in flight.
    """
    from harbor_async.agents.harbor import HarborAgentSpec, is_harbor_agent
    from harbor_async.agents.harness_agent import (
        eval_episode_agent,
        harbor_agent_at,
        model_episode_agent,
    )
    from harbor_async.episodes.runner import run_episode
    from harbor_async.harnesses import harness_factory
    from harbor_async.tasks.suite import load_task

    settings = JobSettings.from_dict(json.loads(item.settings))
    task = load_task(item.task_dir)
    if is_harbor_agent(settings.agent):  # pointed at the server as the driver's probe found it, built per episode
        spec = HarborAgentSpec(settings.agent, None, dict(settings.agent_kwargs))
        spec = harbor_agent_at(spec, settings, item.model, item.base_url)
        actor = eval_episode_agent(settings, spec, None, item.attempt)
    else:
        agent = _agent(settings, item.settings, item.model, item.base_url)
        # The driver checked the harness (it loads, its tools have schemas): here it is only built.
        harness = harness_factory(settings.agent, settings.environment_type)
        actor = model_episode_agent(settings, agent, harness, item.attempt)
    return await run_episode(
        engine, task, settings.environment_type, actor, attempt=item.attempt, task_path=suite_task_path(task, item.root),
        model=item.model, checkpoint=item.checkpoint,
    )  # fmt: skip
