"""Episodes of a suite run through the engine: start, agent, verify, stop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import anyio

from harbor_async.errors import SandboxError
from harbor_async.logs import get_logger

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.engine import Engine

log = get_logger()

#: Agents that need no model: Harbor's oracle (runs solution/solve.sh) and none.
AGENTS = ("oracle", "none")


@dataclass
class EpisodeRecord:
    """One episode's outcome, as written to the ``--json`` file.

    ``error_kind`` is ``"infrastructure"`` when the sandbox itself failed (start,
    exec, verify or stop) and ``"agent"`` when only the agent did; the reward of
    a failed episode is ``None``.
    """

    task: str
    reward: float | None = None
    rewards: dict[str, float | int] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None
    error_phase: str | None = None
    sandbox: str | None = None
    attempts: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def infrastructure_failure(self) -> bool:
        """Whether the sandbox, not the agent, failed."""
        return self.error_kind == "infrastructure"

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)


async def run_episode(engine: Engine, task: Task, backend: str, agent: str = "oracle") -> EpisodeRecord:
    """Run one episode and record it; errors are recorded, never raised."""
    if agent not in AGENTS:
        raise ValueError(f"unknown agent {agent!r}; use one of {', '.join(AGENTS)}")
    record = EpisodeRecord(task=task.name)
    sandbox = engine.launch(task, backend)
    record.sandbox = sandbox.id
    try:
        await sandbox.wait_started()
        if agent != "none":
            try:
                await sandbox.run_agent(agent)
            except SandboxError as exc:  # the agent failed; the verifier still judges
                record.error, record.error_kind, record.error_phase = str(exc), "agent", exc.phase.value
        result = await sandbox.verify()
        record.reward, record.rewards = result.reward, result.rewards
    except SandboxError as exc:
        record.reward = None
        record.error, record.error_kind, record.error_phase = str(exc), "infrastructure", exc.phase.value
    except Exception as exc:  # a bug or an unexpected Harbor error: record it, keep the batch
        log.exception("episode crashed", task=task.name, sandbox=sandbox.id)
        record.reward = None
        record.error, record.error_kind = f"{type(exc).__name__}: {exc}", "infrastructure"
    finally:
        await sandbox.stop()
        record.attempts = sandbox.start_attempts
        record.seconds = {k: round(v, 4) for k, v in sandbox.times.seconds.items()}
    if sandbox.stop_error is not None and record.error_kind != "infrastructure":
        exc = sandbox.stop_error
        record.error, record.error_kind, record.error_phase = str(exc), "infrastructure", exc.phase.value
    return record


async def run_suite(
    engine: Engine,
    tasks: Sequence[Task],
    backend: str,
    *,
    agent: str = "oracle",
    concurrency: int = 8,
    on_done: Callable[[EpisodeRecord], None] | None = None,
) -> list[EpisodeRecord]:
    """Run one episode per task, ``concurrency`` at a time; records in task order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    limiter = anyio.CapacityLimiter(concurrency)
    records: list[EpisodeRecord | None] = [None] * len(tasks)

    async def one(index: int, task: Task) -> None:
        async with limiter:
            record = await run_episode(engine, task, backend, agent)
        records[index] = record
        if on_done is not None:
            on_done(record)

    async with anyio.create_task_group() as tg:
        for index, task in enumerate(tasks):
            tg.start_soon(one, index, task)
    return [r for r in records if r is not None]
