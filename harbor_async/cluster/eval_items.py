"""``eval``'s episodes as picklable work items for :mod:`harbor_async.cluster.sharding`.

The driver keeps the model server and the job folder; each worker gets an
:class:`EvalItem` (the evaluation's settings, the model, the server's address,
the task folder, the attempt) and runs the episode with the same code a local
``eval`` uses (:meth:`harbor_async.evaluation._Run.run_episode`): the same
harness, tools, prompt and records. The server must be reachable from every
node (not ``127.0.0.1`` across machines); task folders must be at the same path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor_async.records import EpisodeRecord

#: Per worker process: one evaluation state and one model client per (settings, server).
_contexts: dict[str, Any] = {}


@dataclass(frozen=True)
class EvalItem:
    """One evaluation episode, by value."""

    settings: str  # EvalSettings as JSON
    model: str
    checkpoint: str
    base_url: str
    task_dir: str
    root: str
    attempt: int


def eval_items(settings: dict[str, Any], models: list[Any], base_url: str, tasks: list[Any], root: Path, pending: set[str]) -> list[tuple[str, EvalItem]]:
    """``(key, item)`` for each pending episode of ``models`` on ``tasks``."""
    from harbor_async.evaluation import _task_path
    from harbor_async.records import episode_key

    encoded = json.dumps(settings, sort_keys=True)
    items = []
    for spec in models:
        for task in tasks:
            for attempt in range(settings["attempts"]):
                key = episode_key(_task_path(task, root), attempt, spec.name)
                if key in pending:
                    item = EvalItem(encoded, spec.name, spec.checkpoint, base_url, str(task.task_dir), str(root), attempt)
                    items.append((key, item))
    return items


async def eval_item(engine: Any, item: EvalItem) -> EpisodeRecord:
    """The worker's side: run one episode as a local ``eval`` does (the shim's engine runs the sandbox)."""
    from harbor_async.checkpoints import ModelSpec
    from harbor_async.evaluation import EvalSettings, _Run
    from harbor_async.tasks import load_task

    context_key = f"{item.settings}|{item.base_url}"
    context = _contexts.get(context_key)
    if context is None:
        import openai

        from harbor_async.agent import Agent

        run = _Run(EvalSettings.from_dict(json.loads(item.settings)), job=None, on_record=None)
        client = openai.AsyncOpenAI(
            base_url=item.base_url, api_key=run.api_key(), max_retries=0, timeout=run.settings.request_timeout
        )
        agents: dict[str, Agent] = {}
        context = _contexts[context_key] = (run, client, agents)
    run, client, agents = context
    agent = agents.get(item.model)
    if agent is None:
        from harbor_async.agent import Agent

        agent = agents[item.model] = Agent(
            client, item.model, sampling=run.sampling, limits=run.limits,
            request_limiter=run.request_limiter, tool_limiter=run.tool_limiter,
        )  # fmt: skip
    spec = ModelSpec(item.model, item.checkpoint)
    async with run.sandbox_limiter:
        return await run.run_episode(agent, spec, load_task(item.task_dir), Path(item.root), item.attempt)
