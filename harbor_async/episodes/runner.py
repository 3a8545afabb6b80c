"""Episodes of a suite through the engine: the one driver of :class:`~harbor_async.episodes.episode.Episode` to its end.

Each episode ends in one :class:`~harbor_async.core.records.EpisodeRecord`, never in
an exception: a failure is classified and kept in the record with its phase,
type and message, the verifier's output and the span of every phase. The record
is handed to ``on_done`` the moment the episode's sandbox is stopped, so a caller
can append it to its job folder before the next one ends.

What acts in the agent phase is an :class:`EpisodeAgent`: one of Harbor's
model-free agents (:class:`BuiltinAgent`, for ``run``), any other Harbor agent
(:class:`harbor_async.agents.harbor_episode.HarborAgentRunner`: ``terminus-2``,
``claude-code``, ``module:Class``, for ``run`` and ``eval``) or a harness driven
by a model server (:class:`harbor_async.agents.harness_agent.HarnessAgent`, for ``eval``).
``run``, ``eval`` and the cluster workers all come through :func:`run_episode`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from weakref import WeakKeyDictionary

import anyio

from harbor_async.backends import BackendSpec, resolve_backend
from harbor_async.core.errors import (
    FailureClass,
    ModelServerConfigError,
    ModelServerDownError,
    ModelServerRefusedError,
    Phase,
    SandboxError,
)
from harbor_async.core.logs import get_logger
from harbor_async.core.moved import renamed_attribute
from harbor_async.core.records import EpisodeRecord
from harbor_async.episodes.episode import Episode
from harbor_async.episodes.steps import run_steps
from harbor_async.tasks.overrides import agent_exec_env
from harbor_async.verification.disk_bounds import JobDiskLimitError, job_disk_error

if TYPE_CHECKING:
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task

    from harbor_async.engine.engine import Engine
    from harbor_async.engine.sandbox import Sandbox

log = get_logger()

#: Agents that need no model: Harbor's oracle (runs solution/solve.sh), and none
#: (Harbor's ``nop``: the verifier judges the untouched sandbox).
MODEL_FREE_AGENTS = ("oracle", "none", "nop")


class EpisodeAgent(Protocol):
    """What acts in an episode's agent phase.

    ``name`` is recorded as the record's ``agent``. :meth:`setup` runs in the
    start phase once the sandbox is up (a harness's preparation; it counts
    against the start budget); :meth:`act` is the agent phase. Both record
    their outcome on the episode (:meth:`Episode.fail`, the record's
    transcript and usage) and raise only for cancellation or a bug. An agent
    with a ``timeout`` attribute (not ``None``) gives the episode its agent-time
    budget, instead of the task's or each step's
    (:meth:`~harbor_async.episodes.episode.Episode.agent_budget_for`).
    """

    name: str

    async def setup(self, episode: Episode) -> None: ...

    async def act(self, episode: Episode) -> None: ...


@dataclass(frozen=True)
class BuiltinAgent:
    """One of Harbor's agents that need no model: ``oracle``, or ``none``/``nop``."""

    name: str = "oracle"

    async def setup(self, episode: Episode) -> None:
        """Nothing to prepare."""

    async def act(self, episode: Episode) -> None:
        """Run the agent; its failure is recorded and the verifier still judges what it left."""
        if self.name in ("none", "nop"):  # Harbor's nop: nothing runs
            return
        assert episode.sandbox is not None
        try:
            await run_oracle(episode.sandbox, episode.step, episode.agent_budget)
        except SandboxError as exc:
            episode.fail_with(exc)


#: Harbor's oracle of each sandbox: one per sandbox, as it counts the steps of a multi-step task it solved.
_ORACLES: WeakKeyDictionary[Sandbox, Any] = WeakKeyDictionary()


async def run_oracle(sandbox: Sandbox, step: StepConfig | None, budget: float | None) -> None:
    """Harbor's oracle (the task's, or the step's, ``solution/solve.sh``) as ``sandbox``'s agent phase, within ``budget``."""
    from harbor.agents.oracle import OracleAgent
    from harbor.models.agent.context import AgentContext
    from harbor.models.trial.paths import TrialPaths

    await sandbox.wait_started()
    oracle = _ORACLES.get(sandbox)
    if oracle is None:
        paths = TrialPaths(trial_dir=sandbox.trial_dir)
        oracle = _ORACLES[sandbox] = OracleAgent(
            logs_dir=paths.agent_dir, task_dir=sandbox.task.paths.task_dir, trial_paths=paths, agent_timeout_sec=budget
        )
    instruction = sandbox.task.step_instruction(step.name) if step is not None else sandbox.task.instruction
    with agent_exec_env(sandbox.environment, sandbox.context.agent_env):  # --ae: the agent's commands, not the verifier's
        async with sandbox.context.budget.exec_slot(), sandbox.bounded_phase(Phase.AGENT, budget=budget):
            await oracle.run(instruction, sandbox.environment, AgentContext())


@dataclass(frozen=True)
class PlannedEpisode:
    """One episode to run: a task and the index of its repetition (``-k``).

    ``model``/``checkpoint`` go into the record (and its key); ``agent``, when
    set, acts in this episode instead of the batch's (``eval``: one agent per
    model); ``task_path`` is the task's path in its suite (the record's and the key's).
    """

    task: Task
    attempt: int = 0
    model: str | None = None
    checkpoint: str | None = None
    agent: str | EpisodeAgent | None = None
    task_path: str | None = None


#: Where the episode that runs in this context also hands its record (besides ``on_done``):
#: a cluster worker sets it so that an episode it stops still returns its record.
record_sink: ContextVar[Callable[[EpisodeRecord], None] | None] = ContextVar("record_sink", default=None)


async def run_episode(
    engine: Engine,
    task: Task,
    backend: str | BackendSpec,
    agent: str | EpisodeAgent = "oracle",
    *,
    attempt: int = 0,
    task_path: str | None = None,
    model: str | None = None,
    checkpoint: str | None = None,
    on_done: Callable[[EpisodeRecord], None] | None = None,
    backend_kwargs: Mapping[str, Any] | None = None,
) -> EpisodeRecord:
    """Run one episode to its end and record it; failures are recorded, never raised.

    The record is handed to ``on_done`` (and to :data:`record_sink`) in a
    ``finally``, once the sandbox is stopped: a cancelled, crashed or
    interrupted episode has its record too (class ``cancelled`` for the first),
    and the cancellation is then re-raised. A string ``agent`` is one of
    :data:`MODEL_FREE_AGENTS` (not checked here: the caller checks it once).
    ``backend_kwargs``: this episode's backend options, over the engine's (the shim's engine is shared).
    """
    actor = BuiltinAgent(agent) if isinstance(agent, str) else agent
    spec = backend if isinstance(backend, BackendSpec) else resolve_backend(backend)
    sinks = [sink for sink in (on_done, record_sink.get()) if sink is not None]

    def done(record: EpisodeRecord) -> None:
        for sink in sinks:
            sink(record)

    episode = Episode(
        engine, task, spec, task_path=task_path, attempt=attempt, agent=actor.name, model=model, checkpoint=checkpoint,
        on_done=done, agent_timeout=getattr(actor, "timeout", None), backend_kwargs=dict(backend_kwargs or {}),
    )  # fmt: skip
    full = episode.disk.job_full()
    if full is not None:  # the job folder reached its bound: nothing more starts (not judged, resumable)
        episode.fail_with(full, Phase.START)
        return await episode.stop()
    try:
        with episode.disk.current():  # every download of the episode charges its disk bounds (harbor_async.verification.disk_bounds)
            ready = await episode.begin(lambda: actor.setup(episode))
            if task.has_steps:  # each step's instruction, agent and verifier in turn (harbor_async.episodes.steps)
                if ready:
                    await run_steps(episode, actor)
                episode.settle()
            else:
                if ready:
                    await actor.act(episode)
                await episode.verify()
    except anyio.get_cancelled_exc_class():
        episode.interrupted()
        raise
    except Exception as exc:  # a bug or an unexpected Harbor error: record it, keep the batch
        log.exception("episode crashed", task=task.name, sandbox=episode.record.sandbox)
        episode.fail_with(exc, episode.phase)
        episode.settle()  # a disk bound the episode passed is still its failure, not the crash's
    finally:
        record = await episode.stop()  # hands the record to the sinks (Episode.on_done)
    return record


class FailureBudget:
    """When a set of episodes stops because its model server fails: the same rule for ``run`` and ``eval``, local or over Ray.

    ``limit`` model-server failures in a row (``0``/``None``: never) stop the
    run with :class:`~harbor_async.core.errors.ModelServerDownError`; an episode whose
    server refused the request as misconfigured (a wrong key, model or URL:
    :class:`~harbor_async.core.errors.ModelServerConfigError`) stops it at once. An
    episode the server served (judged) starts the count again. The error names
    ``server`` and the job folder to resume.
    """

    def __init__(self, limit: int | None, server: str, job_dir: Path) -> None:
        self.limit, self.server, self.job_dir = limit, server, job_dir
        self.in_a_row = 0
        self.error: ModelServerDownError | JobDiskLimitError | None = None

    def observe(self, record: EpisodeRecord) -> bool:
        """Count ``record``; ``True`` once, when the run must stop now (the error is then :attr:`error`).

        A record whose episode reached the job folder's disk bound stops the
        run too (:class:`~harbor_async.verification.disk_bounds.JobDiskLimitError`, its episode
        and the ones not run yet resumable).
        """
        if self.error is not None:
            return False
        if record.error_type == JobDiskLimitError.__name__:  # by type name: records come back from Ray as JSON
            self.error = job_disk_error(self.job_dir, record.error)
            return True
        if record.failure is not FailureClass.MODEL_SERVER:
            if not record.rerun:
                self.in_a_row = 0
            return False
        self.in_a_row += 1
        if record.error_type == ModelServerConfigError.__name__:  # by type name: records come back from Ray as JSON
            self.error = ModelServerRefusedError(self.server, record.error or "", self.job_dir)
        elif self.limit and self.in_a_row >= self.limit:
            self.error = ModelServerDownError(self.server, self.in_a_row, record.error or "", self.job_dir)
        return self.error is not None


async def run_suite(
    engine: Engine,
    episodes: Sequence[PlannedEpisode | Task],
    backend: str | BackendSpec,
    *,
    agent: str | EpisodeAgent | Callable[[], EpisodeAgent] = "oracle",
    task_path: Callable[[Task], str] | None = None,
    concurrency: int = 8,
    on_done: Callable[[EpisodeRecord], None] | None = None,
    model: str | None = None,
    budget: FailureBudget | None = None,
    stop: Callable[[Callable[[], None]], None] | None = None,
    backend_kwargs: Mapping[str, Any] | None = None,
) -> list[EpisodeRecord]:
    """Run ``episodes`` (tasks, or planned episodes), ``concurrency`` at a time: the one orchestration of ``run`` and ``eval``.

    ``agent``: a model-free agent's name, an :class:`EpisodeAgent` that keeps no
    state between episodes, or a factory called once per episode (an agent that
    does, as a Harbor agent's :class:`~harbor_async.agents.harbor_episode.HarborAgentRunner`);
    a :class:`PlannedEpisode`'s own ``agent`` wins. ``model``: the records'
    ``model`` where the planned episode names none.

    Each record goes to ``on_done`` from its episode's ``finally`` (a cancelled
    episode's too), then to ``budget``: when the budget says stop, every episode
    still running is cancelled (and recorded) and the batch ends; the caller
    raises ``budget.error``. ``stop`` is given the batch's cancel function (an
    interrupt policy arms it: :class:`harbor_async.core.interrupts.Interrupts`). ``backend_kwargs``: each
    episode's backend options, over the engine's.

    This is the batch's one concurrency limit: an episode launches its sandbox
    only when it holds a slot, so its episode deadline starts then (give the
    engine no lower live-sandbox limit). The backend is resolved once here.
    Returns the records in ``episodes`` order.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    spec = backend if isinstance(backend, BackendSpec) else resolve_backend(backend)
    items = [e if isinstance(e, PlannedEpisode) else PlannedEpisode(e) for e in episodes]
    limiter = anyio.CapacityLimiter(concurrency)
    records: list[EpisodeRecord | None] = [None] * len(items)

    with anyio.CancelScope() as batch:

        def done(record: EpisodeRecord) -> None:
            if on_done is not None:
                on_done(record)
            if budget is not None and budget.observe(record):
                batch.cancel()

        async def one(index: int, episode: PlannedEpisode) -> None:
            async with limiter:
                actor = episode.agent if episode.agent is not None else agent() if callable(agent) else agent
                records[index] = await run_episode(
                    engine, episode.task, spec, actor, attempt=episode.attempt, on_done=done,
                    model=episode.model if episode.model is not None else model, checkpoint=episode.checkpoint,
                    task_path=episode.task_path if episode.task_path is not None else None if task_path is None else task_path(episode.task),
                    backend_kwargs=backend_kwargs,
                )  # fmt: skip

        if stop is not None:
            stop(batch.cancel)
        async with anyio.create_task_group() as tg:
            for index, episode in enumerate(items):
                tg.start_soon(one, index, episode)
    return [r for r in records if r is not None]

if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any name as defined

    def __getattr__(name: str) -> Any:
        """The old class names of the move (one release, with a DeprecationWarning)."""
        return renamed_attribute(__name__, name)
