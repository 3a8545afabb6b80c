"""Episodes of a suite run through the engine: start, agent, verify, stop -> one record each.

Each episode ends in one :class:`~harbor_async.records.EpisodeRecord`, never in
an exception: a failure is classified (:func:`~harbor_async.errors.failure_class`) and kept in the record
with its phase, type and message, the verifier's output and the span of every
phase. The record is handed to ``on_done`` the moment the episode's sandbox is
stopped, so a caller can append it to its job folder before the next one ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import anyio

from harbor_async.backends import BackendSpec, resolve_backend
from harbor_async.errors import FailureClass, Phase, SandboxError, VerifierFailure, failure_class
from harbor_async.logs import get_logger
from harbor_async.records import EpisodeRecord, PhaseSpan
from harbor_async.sandbox import VERIFIER_OUTPUT_LIMIT

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.engine import Engine
    from harbor_async.sandbox import Sandbox

log = get_logger()

#: Agents that need no model: Harbor's oracle (runs solution/solve.sh), and none
#: (Harbor's ``nop``: the verifier judges the untouched sandbox).
MODEL_FREE_AGENTS = ("oracle", "none", "nop")

#: Where Harbor's verifier writes the test script's stdout and stderr, in the sandbox.
VERIFIER_OUTPUT_PATH = "/logs/verifier/test-stdout.txt"
#: Seconds granted to fetch the verifier's output from a sandbox after the verifier failed.
VERIFIER_OUTPUT_TIMEOUT = 10.0


@dataclass(frozen=True)
class PlannedEpisode:
    """One episode to run: a task and the index of its repetition (``-k``)."""

    task: Task
    attempt: int = 0


async def run_episode(
    engine: Engine,
    task: Task,
    backend: str | BackendSpec,
    agent: str = "oracle",
    *,
    attempt: int = 0,
    on_done: Callable[[EpisodeRecord], None] | None = None,
) -> EpisodeRecord:
    """Run one episode and record it; failures are recorded, never raised.

    Cancellation is recorded too (class ``cancelled``), handed to ``on_done``
    once the sandbox is stopped, then re-raised. ``agent`` is not checked here:
    the caller checks it once (the sandbox refuses an unknown one).
    """
    record = EpisodeRecord(
        task=task.name,
        task_path=str(task.paths.task_dir),
        attempt=attempt,
        agent=agent,
        started_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
    )
    begin = anyio.current_time()
    current = Phase.START

    @asynccontextmanager
    async def span(phase: Phase, at: float | None = None) -> AsyncIterator[None]:
        nonlocal current
        current = phase
        start = anyio.current_time() - begin if at is None else at
        try:
            yield
        finally:
            end = anyio.current_time() - begin
            record.phases.append(PhaseSpan(phase.value, round(start, 4), round(end, 4)))

    sandbox = engine.launch(task, backend)
    record.sandbox = sandbox.id
    try:
        async with span(Phase.START, at=0.0):  # the start began with the launch
            await sandbox.wait_started()
        if agent not in ("none", "nop"):
            try:
                async with span(Phase.AGENT):
                    await sandbox.run_agent(agent)
            except SandboxError as exc:  # the agent failed; the verifier still judges what it left
                record.set_error(failure_class(exc), exc)
        # The verifier's output is read before the stop removes the trial folder and the sandbox.
        try:
            async with span(Phase.VERIFY):
                result = await sandbox.verify()
        except SandboxError as exc:
            found = exc.output if isinstance(exc, VerifierFailure) else None
            record.verifier_output = found or await _verifier_output(sandbox)
            raise
        record.reward, record.rewards = result.reward, dict(result.rewards)
        record.verifier_output = result.output or await _verifier_output(sandbox)
    except anyio.get_cancelled_exc_class():
        record.set_error(FailureClass.CANCELLED, "the episode was interrupted before it finished", phase=current.value)
        raise
    except SandboxError as exc:
        record.set_error(failure_class(exc), exc)
    except Exception as exc:  # a bug or an unexpected Harbor error: record it, keep the batch
        log.exception("episode crashed", task=task.name, sandbox=sandbox.id)
        record.set_error(FailureClass.INFRASTRUCTURE, exc, phase=current.value)
    finally:
        with anyio.CancelScope(shield=True):
            async with span(Phase.STOP):
                await sandbox.stop()
            _finish(record, sandbox)
            if on_done is not None:
                on_done(record)
    return record


def _finish(record: EpisodeRecord, sandbox: Sandbox) -> None:
    """Fill in what the stopped sandbox knows, settle the reward, log one line."""
    record.start_attempts = sandbox.start_attempts
    record.seconds = {k: round(v, 4) for k, v in sandbox.times.seconds.items()}
    if sandbox.stop_error is not None:  # a leaked sandbox is the infrastructure's, unless blamed earlier
        record.set_error(FailureClass.INFRASTRUCTURE, sandbox.stop_error)
    failure = record.failure
    if failure is not None and failure.scored and record.reward is None:
        record.reward = 0.0  # the model's episode, with no reward: it scores 0
    log.info(
        "episode",
        task=record.task,
        attempt=record.attempt,
        sandbox=record.sandbox,
        reward=record.reward,
        error_class=record.error_class,
        error_phase=record.error_phase,
        seconds=round(sum(s.seconds for s in record.phases), 4),
    )


async def _verifier_output(sandbox: Sandbox) -> str | None:
    """The end of the test script's stdout read from the sandbox, or ``None`` when there is none.

    The sandbox reads what Harbor's verifier downloaded into the trial folder;
    when the verifier failed before that (a timed-out test script), it is read
    from the sandbox itself.
    """
    try:
        with anyio.fail_after(VERIFIER_OUTPUT_TIMEOUT):
            found = await sandbox.exec(
                f"tail -c {VERIFIER_OUTPUT_LIMIT} {VERIFIER_OUTPUT_PATH} 2>/dev/null",
                timeout=VERIFIER_OUTPUT_TIMEOUT,
                max_output=None,
            )
    except (SandboxError, TimeoutError, OSError):
        return None
    text = found.stdout if found.exit_code == 0 else None
    if not text:
        return None
    return text[-VERIFIER_OUTPUT_LIMIT:]


async def run_suite(
    engine: Engine,
    episodes: Sequence[PlannedEpisode | Task],
    backend: str | BackendSpec,
    *,
    agent: str = "oracle",
    concurrency: int = 8,
    on_done: Callable[[EpisodeRecord], None] | None = None,
) -> list[EpisodeRecord]:
    """Run ``episodes`` (tasks, or tasks with attempt indices), ``concurrency`` at a time.

    This is the batch's one concurrency limit: an episode launches its sandbox
    only when it holds a slot, so its episode deadline starts then (give the
    engine no lower live-sandbox limit). The backend is resolved once here.
    Returns the records in ``episodes`` order; ``on_done`` gets each as it ends.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    spec = backend if isinstance(backend, BackendSpec) else resolve_backend(backend)
    items = [e if isinstance(e, PlannedEpisode) else PlannedEpisode(e) for e in episodes]
    limiter = anyio.CapacityLimiter(concurrency)
    records: list[EpisodeRecord | None] = [None] * len(items)

    async def one(index: int, episode: PlannedEpisode) -> None:
        async with limiter:
            records[index] = await run_episode(
                engine, episode.task, spec, agent, attempt=episode.attempt, on_done=on_done
            )

    async with anyio.create_task_group() as tg:
        for index, episode in enumerate(items):
            tg.start_soon(one, index, episode)
    return [r for r in records if r is not None]
