"""A ``run``-style episode for the sharding tests: start, verify, stop, on the simulated backend."""

from __future__ import annotations

from typing import Any

from harbor_async.core.records import EpisodeRecord
from harbor_async.tasks.suite import load_task


def items(task_paths: list[str], attempts: int, latency: float = 0.0) -> list[tuple[str, dict[str, Any]]]:
    """(key, item) per episode; the reward is fixed per episode so that any run scores the same."""
    out = []
    for index, path in enumerate(task_paths):
        for attempt in range(attempts):
            reward = 1.0 if (index + attempt) % 3 else 0.0
            item = {"task_path": path, "attempt": attempt, "reward": reward, "latency": latency}
            out.append((EpisodeRecord(task="", task_path=path, attempt=attempt).key, item))
    return out


async def simulated_episode(engine: Any, item: dict[str, Any]) -> EpisodeRecord:
    task = load_task(item["task_path"])
    record = EpisodeRecord(task=task.name, task_path=item["task_path"], attempt=item["attempt"], agent="oracle")
    backend_kwargs = {"reward": item["reward"], "start_latency": item["latency"]}
    async with engine.sandbox(task, "simulated", backend_kwargs=backend_kwargs) as sandbox:
        record.sandbox = sandbox.id
        result = await sandbox.verify()
        record.reward, record.rewards = result.reward, result.rewards
    return record
