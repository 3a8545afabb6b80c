"""``run``'s episodes as picklable work items for :mod:`harbor_async.cluster.sharding`.

The driver sends each worker a :class:`RunItem` (a task folder path, the
attempt, the backend and the agent: a model-free one's name, or a Harbor
agent's name, model and options, built anew for each episode as a local
``run`` builds it), and the worker runs it with
:func:`harbor_async.episodes.runner.run_episode`, exactly as a local ``run`` does; so
a sharded run writes the records a local run writes. Task folders must be at
the same path on every node.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harbor_async.core.records import EpisodeRecord, episode_key
from harbor_async.tasks.suite import suite_task_path

if TYPE_CHECKING:
    from harbor_async.engine.engine import Engine
    from harbor_async.episodes.runner import PlannedEpisode


@dataclass(frozen=True)
class RunItem:
    """One ``run`` episode, by value: what a worker needs to run it."""

    task_dir: str
    attempt: int = 0
    backend: str = "local"
    agent: str = "oracle"
    task_path: str = ""  # the task's path in its suite (the record's and the key's); "" means task_dir
    model: str | None = None  # a Harbor agent's model (-m): the record's and the key's
    agent_kwargs: str = "{}"  # a Harbor agent's options (--ak), as JSON: an item is compared and pickled by value
    capture: bool = False  # --capture: the agent's model calls through the worker engine's capture proxy

    @property
    def key(self) -> str:
        """The episode's key in the job folder (the key ``run`` uses)."""
        return episode_key(self.task_path or self.task_dir, self.attempt, self.model)


def run_items(
    episodes: Iterable[PlannedEpisode], backend: str, agent: str, root: str | None = None, *,
    model: str | None = None, agent_kwargs: Mapping[str, Any] | None = None, capture: bool = False,
) -> list[tuple[str, RunItem]]:
    """``(key, item)`` for each planned episode of ``run`` (pass only the pending ones on a resume)."""
    options = json.dumps(dict(agent_kwargs or {}), sort_keys=True)
    items = [
        RunItem(
            str(ep.task.paths.task_dir), ep.attempt, backend, agent,
            suite_task_path(ep.task, root) if root is not None else "", model, options, capture,
        )  # fmt: skip
        for ep in episodes
    ]
    return [(item.key, item) for item in items]


async def run_item(engine: Engine, item: RunItem) -> EpisodeRecord:
    """The worker's side: load the task and run the episode on the node's ``engine`` as ``run`` does."""
    from harbor_async.episodes.runner import MODEL_FREE_AGENTS, run_episode
    from harbor_async.tasks.suite import load_task

    agent: Any = item.agent
    if agent not in MODEL_FREE_AGENTS:  # a Harbor agent, built for this episode (the driver checked its options)
        from harbor_async.agents.harbor import HarborAgentSpec
        from harbor_async.agents.harbor_episode import HarborAgentRunner

        agent = HarborAgentRunner(HarborAgentSpec(item.agent, item.model, json.loads(item.agent_kwargs)), capture=item.capture)
    return await run_episode(
        engine, load_task(item.task_dir), item.backend, agent, attempt=item.attempt,
        task_path=item.task_path or None, model=item.model,
    )  # fmt: skip
