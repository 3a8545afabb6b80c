"""One episode, step by step: launch, start (+ harness setup), agent, verify, stop -> one record.

The one place where an episode's phases are timed, its failures classified,
its reward settled and its :class:`~harbor_async.core.records.EpisodeRecord` built.
Every caller drives the same :class:`Episode`:

- :func:`harbor_async.episodes.runner.run_episode` drives it to the end in one call,
  for ``run`` (Harbor's model-free agents), ``eval`` (a harness driven by a
  model server, :mod:`harbor_async.agents.harness_agent`) and the cluster workers;
- the shim (``shim.episode``) drives the same episode one call at a time from
  TRL's threads: ``reset()`` hands :meth:`Episode.begin` to the engine's loop
  without waiting, tool calls go through :meth:`Episode.call` and
  :meth:`Episode.exec_text` (which wait for the start), the reward is
  :meth:`Episode.verify` (once, cached), and :meth:`Episode.retire` ends an
  episode that is left before its verdict.

Phases follow each other (start, agent, verify, stop): entering one closes the
one before, so every record has the same phase structure whoever drove it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel

from harbor_async.backends import enter_network_phase
from harbor_async.core.errors import (
    AgentSetupError,
    EngineClosedError,
    EpisodeClosedError,
    EpisodeDeadlineError,
    EpisodeInterruptedError,
    LaunchError,
    NetworkPhaseError,
    Phase,
    SandboxClosedError,
    SandboxError,
    SandboxTimeout,
    VerifierFailure,
)
from harbor_async.core.logs import get_logger
from harbor_async.core.offload import off_loop
from harbor_async.core.policy import failure_class
from harbor_async.core.records import EpisodeRecord, PhaseSpan
from harbor_async.engine.loop import await_future
from harbor_async.engine.sandbox import SandboxState
from harbor_async.episodes import tool_messages as messages
from harbor_async.episodes.judging import judge, stdout_came_back, verifier_output
from harbor_async.verification import disk_bounds

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.engine.engine import Engine
    from harbor_async.engine.sandbox import Sandbox

log = get_logger()

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

#: The episode whose harness setup runs in the current task: its commands run at once, where any other caller's
#: wait for the setup to finish (which would then wait for itself). Context variables are per task.
SETTING_UP: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("episode_setting_up", default=None)


def now_iso() -> str:
    """The current UTC time as records write it (milliseconds)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class Episode:
    """One episode of one task on one engine: its sandbox, its phases and its record.

    Args:
        engine: the engine that starts and stops the sandbox.
        task: the Harbor task.
        backend: the resolved backend.
        task_path: the task's path as the job identifies it (relative to the suite root).
        attempt: the index of the repetition (``-k``).
        agent: the agent or harness name recorded.
        model, checkpoint: the model that acted, if any.
        backend_kwargs: per-episode backend options (on top of the engine's).

    Attributes:
        record: the episode's record, filled in as it goes.
        sandbox: the engine's sandbox, once launched.
        error: why no command can run in this episode (a failed start or harness
            setup, or the episode was closed first); ``None`` while usable.
        exec_errors: commands the sandbox could not run (not failing commands).
        tool_seconds: seconds the agent's commands took, summed.
        agent_budget: the agent's time budget (the task's ``[agent] timeout_sec``
            or the engine's, multiplied); commands past it are refused.
    """

    def __init__(
        self,
        engine: Engine,
        task: Task,
        backend: BackendSpec,
        *,
        task_path: str | None = None,
        attempt: int = 0,
        agent: str = "",
        model: str | None = None,
        checkpoint: str | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        on_done: Callable[[EpisodeRecord], None] | None = None,
        agent_timeout: float | None = None,
        on_started: Callable[[SandboxError | None], None] | None = None,
    ) -> None:
        self.engine = engine
        engine.episodes.add(self)  # a closing engine ends those still running (Engine.aclose)
        #: Where the finished record goes (a job folder, a progress bar), from :meth:`stop`'s ``finally``.
        self.on_done = on_done
        #: Told once whether the sandbox started (``None``) or why not (the shim's failure guard counts starts).
        self.on_started = on_started
        self.task = engine.task_overrides.apply(task)  # the run's --override-*, --artifact, --ve: as its sandbox gets it
        self.backend = backend
        self.backend_kwargs = backend_kwargs or {}
        self.record = EpisodeRecord(
            task=task.name,
            task_path=task_path if task_path is not None else str(task.paths.task_dir),
            attempt=attempt,
            agent=agent,
            model=model,
            checkpoint=checkpoint,
        )
        if engine.trials_dir is not None:  # Harbor's trial folder of this episode in the job (harbor_async.jobs.harbor_layout)
            from harbor_async.jobs.harbor_layout import trial_name

            self.record.trial = trial_name(Path(task.paths.task_dir).name)  # the folder's name, as Harbor's
        self.sandbox: Sandbox | None = None
        self.error: BaseException | None = None
        self.verify_error: SandboxError | None = None
        self.exec_errors: list[SandboxError] = []
        self.tool_seconds = 0.0
        self.judge_seconds = 0.0  # the billed seconds of its separate verifiers' sandboxes
        #: The agent's own budget (eval's ``--agent-timeout``), which replaces the task's (each step's).
        self.agent_timeout = agent_timeout
        self.agent_budget: float | None = self.agent_budget_for(None)
        self.step: StepConfig | None = None  # the step in progress of a multi-step task (harbor_async.episodes.steps)
        #: what the episode copied to the host, against its and its job's disk bounds (harbor_async.verification.disk_bounds)
        self.disk = disk_bounds.for_engine(engine)
        self._begin: float | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._open: tuple[Phase, float] | None = None
        self._stopped: anyio.Event | None = None
        self._finished = False
        self._ready: anyio.Event | None = None  # set when begin() is over (created on the loop: anyio needs it)
        self._start_scope: anyio.CancelScope | None = None
        self._retired = False
        self._verified = False
        self._verify_lock: anyio.Lock | None = None

    # ── state readable from any thread ────────────────────────────────────

    @property
    def verified(self) -> bool:
        """Whether :meth:`verify` has settled the reward (or its absence)."""
        return self._verified

    @property
    def reward(self) -> float | None:
        """The settled reward (see :meth:`verify`); ``None`` before, and when the episode was not judged."""
        return self.record.reward if self._verified else None

    @property
    def reward_error(self) -> BaseException | None:
        """Why the episode has no verdict of the verifier's (a failed start or setup, a verifier failure), if so."""
        return self.error or self.verify_error

    @property
    def finished(self) -> bool:
        """Whether nothing of the episode is left to stop."""
        return self.sandbox.done if self.sandbox is not None else self._retired

    # ── phases ────────────────────────────────────────────────────────────

    @property
    def trial_folder(self) -> Path | None:
        """This episode's Harbor trial folder in the job folder, if the engine keeps them."""
        root, name = self.engine.trials_dir, self.record.trial
        return root / name if root is not None and name else None

    @property
    def phase(self) -> Phase | None:
        """The phase in progress, if any."""
        return None if self._open is None else self._open[0]

    def _elapsed(self) -> float:
        return 0.0 if self._begin is None else anyio.current_time() - self._begin

    def enter(self, phase: Phase) -> None:
        """Close the phase in progress and start ``phase`` now (no-op if it is already in progress)."""
        if self._open is not None and self._open[0] is phase:
            return
        self._close_phase()
        self._open = (phase, self._elapsed())

    def _close_phase(self) -> None:
        if self._open is not None:
            phase, start = self._open
            self.record.phases.append(PhaseSpan(phase.value, round(start, 4), round(self._elapsed(), 4)))
            self._open = None

    def agent_budget_for(self, step: StepConfig | None) -> float | None:
        """The one agent-time budget of the episode (of ``step``, for a multi-step task).

        The agent's own timeout when it has one, else the task's (the step's)
        ``[agent] timeout_sec`` with Harbor's multipliers, else the engine's
        ``Timeouts.agent``. Every agent (the oracle, a harness's tool time, a
        model loop, a Harbor agent) is bounded by it.
        """
        if self.agent_timeout is not None:
            return self.agent_timeout
        return self.engine.timeouts.for_step(self.task, step).agent

    def fail_with(self, exc: BaseException, phase: Phase | str | None = None) -> None:
        """Record ``exc`` as the episode's failure, blamed as the error policy's table says (the first kept).

        ``phase``: the phase recorded, when not the error's own (a sandbox error carries its phase).
        """
        self.record.set_error(failure_class(exc), exc, phase.value if isinstance(phase, Phase) else phase)

    def interrupted(self) -> None:
        """Record that the episode was interrupted before it finished.

        Overrides a failure recorded so far that would be scored (an agent that
        failed before the verifier could judge what it left): with no verdict,
        the episode is not the model's, and a resume runs it again.
        """
        record = self.record
        if record.failure is not None and record.failure.scored:
            record.error_class = record.error_phase = record.error_type = record.error = None
            record.reward, record.rewards = None, {}
        self.fail_with(EpisodeInterruptedError(), self.phase)

    # ── start ─────────────────────────────────────────────────────────────

    def launch(self, sandbox: Sandbox | None = None) -> Sandbox:
        """Schedule the sandbox's start (or adopt one started ahead); the start phase begins.

        Raises what :meth:`Engine.launch` raises (a bad backend, a closed engine).
        """
        self._begin = anyio.current_time()
        self._token = anyio.lowlevel.current_token()  # for sync tools calling from any thread
        self.record.started_at = now_iso()
        self._open = (Phase.START, 0.0)  # the episode begins with its start
        if sandbox is None:
            sandbox = self.engine.launch(self.task, self.backend, backend_kwargs=self.backend_kwargs)
        self.sandbox = sandbox
        self.record.sandbox = sandbox.id
        return sandbox

    async def begin(
        self, setup: Callable[[], Awaitable[None]] | None = None, *, claim: Callable[[], Sandbox | None] | None = None
    ) -> bool:
        """Launch the sandbox (``claim()``'s, one started ahead, if given), wait for it, run the harness ``setup``.

        The one start of every driver. Never raises (except the caller's own
        cancellation): a launch that cannot be scheduled, a failed start or
        setup, and a :meth:`retire` that came first are recorded and kept in
        :attr:`error`. Returns whether the agent may act; :meth:`wait_ready`
        returns once this is over.
        """
        ready = self._ready_event()
        try:
            if self._retired:  # retired before its start was scheduled
                self.error = EpisodeClosedError(Phase.START, self.task.name, "-", "the episode was closed")
                self.fail_with(self.error)
                return False
            try:  # no await before the claim: a prefetcher's release relies on claims made in order
                self.launch(claim() if claim is not None else None)
            except Exception as exc:  # noqa: BLE001 - a bad backend, a closed engine: the start never began
                self.error = exc
                self.fail_with(_caused(LaunchError(_described(exc)), exc), Phase.START)
                log.warning("sandbox launch failed", task=self.task.name, error=str(exc))
                return False

            async def set_up() -> None:
                assert setup is not None
                token = SETTING_UP.set(self)
                try:
                    await setup()
                finally:
                    SETTING_UP.reset(token)

            usable = False
            with anyio.CancelScope() as self._start_scope:
                usable = await self.start(set_up if setup is not None else None)
            if self._start_scope.cancelled_caught and self.error is None:  # retire() cancelled it
                self.error = EpisodeClosedError(
                    Phase.START, self.task.name, self.record.sandbox or "-", "the episode ended before its sandbox was ready"
                )
                self.fail_with(self.error)
            return usable and self.error is None
        finally:
            ready.set()

    def _ready_event(self) -> anyio.Event:
        self._ready = self._ready or anyio.Event()
        return self._ready

    async def wait_ready(self) -> None:
        """Wait until :meth:`begin` is over (at once for an episode started by :meth:`launch` and :meth:`start`)."""
        if self._ready is None and (self.sandbox is not None or self.error is not None):
            return
        await self._ready_event().wait()

    async def start(self, setup: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Wait for the sandbox, then run the harness ``setup`` within the start budget.

        Never raises (except cancellation): a failure is kept in :attr:`error`
        and recorded. Returns whether the episode is ready for the agent; the
        agent phase begins when it is.
        """
        assert self.sandbox is not None, "launch() first"
        try:
            await self.sandbox.wait_started()
        except SandboxError as exc:
            self._started(exc)
            self.error = exc
            self.fail_with(exc)
            return False
        self._started(None)
        budget = anyio.CancelScope()
        try:
            if setup is not None:
                with anyio.fail_after(self.engine.timeouts.start) as budget:  # TRL counts its setup as the start
                    await setup()
        except SandboxError as exc:
            self.error = exc
            self.fail_with(exc)
        except TimeoutError as exc:
            self.error = exc
            if budget.cancelled_caught:
                self.fail_with(_caused(AgentSetupError("the harness setup ran past the start budget"), exc), Phase.START)
            else:  # the setup's own timeout (a command it bounded itself)
                self.fail_with(_caused(AgentSetupError(_described(exc)), exc), Phase.START)
        except Exception as exc:  # the harness's own code failed: the agent's failure, not the sandbox's
            self.error = exc
            self.fail_with(_caused(AgentSetupError(_described(exc)), exc), Phase.START)
            log.warning("harness setup failed", task=self.task.name, error=repr(exc))
        if self.error is None:
            environment = self.sandbox.environment
            environment.default_user = self.task.config.agent.user  # [agent] user, as Harbor runs it
            try:
                await enter_network_phase(environment, self.task, "agent")
            except Exception as exc:  # noqa: BLE001 - the backend could not apply it: no agent runs unconfined
                self.error = exc
                self.fail_with(_caused(NetworkPhaseError(_described(exc)), exc), Phase.START)
                return False
            self.enter(Phase.AGENT)
            return True
        return False

    @property
    def instruction(self) -> str:
        """What the agent is told: the task's instruction, or the step's in a multi-step task."""
        step = self.step
        return self.task.instruction if step is None else self.task.step_instruction(step.name)

    def _started(self, error: SandboxError | None) -> None:
        if self.on_started is not None:
            self.on_started(error)

    # ── agent ─────────────────────────────────────────────────────────────

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the episode's loop from any other thread and wait (a sync tool's call)."""
        host = self.engine.host
        if host is not None:  # the engine's own loop thread (the shim's): reachable before the start is scheduled
            return host.call(fn, *args)
        return anyio.from_thread.run(fn, *args, token=self._token)  # type: ignore[arg-type]  # anyio awaits any awaitable; typed for coroutines

    async def call_async(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` on the episode's loop from async code on any loop (an async tool, ``_setup``)."""
        host = self.engine.host
        if host is None or host.in_loop_thread():
            return await fn(*args)

        return await await_future(host.submit(fn, *args))

    @property
    def environment(self) -> BaseEnvironment | None:
        """The live Harbor environment (``None`` before the start or after the stop)."""
        sandbox = self.sandbox
        return sandbox.environment if sandbox is not None and sandbox.state is SandboxState.RUNNING else None

    async def exec_text(self, command: str, timeout: float | None) -> str:
        """Run a tool command; return TRL's output text, or an error message for the model.

        Never raises for the sandbox's failures: a timeout, a sandbox that could
        not start or is gone come back as ``"Error: ..."`` text (and a command the
        sandbox could not run is kept in :attr:`exec_errors`). The agent's time
        budget covers the commands' time, as TRL cannot end a rollout itself.
        A command waits for :meth:`begin` to finish, except one of the harness
        setup itself.
        """
        if SETTING_UP.get() is not self:
            await self.wait_ready()
        if self.error is not None:
            return messages.describe_unavailable(self.error)
        assert self.sandbox is not None
        if timeout is None:
            timeout = self.sandbox.timeouts.exec
        agent_limited = False
        if self.agent_budget is not None:
            left = self.agent_budget - self.tool_seconds
            if left <= 0:
                return messages.agent_time_up(self.agent_budget, stopped=False)
            agent_limited = timeout is None or left < timeout
            timeout = left if agent_limited else timeout
        began = anyio.current_time()
        try:
            result = await self.sandbox.exec(command, timeout=timeout)
        except EpisodeDeadlineError:
            return messages.DEADLINE
        except SandboxTimeout:
            return messages.agent_time_up(self.agent_budget, stopped=True) if agent_limited else messages.timed_out(timeout)
        except SandboxError as exc:
            self.exec_errors.append(exc)
            return messages.describe_unavailable(exc) if isinstance(exc, SandboxClosedError) else messages.not_run(exc)
        finally:
            self.tool_seconds += anyio.current_time() - began
        # TRL's format: stdout then stderr, cut at 8000 characters (by the engine), or a placeholder.
        return result.output or f"(empty output, rc={result.exit_code})"

    # ── verify ────────────────────────────────────────────────────────────

    async def verify(self) -> float | None:
        """Run the verifier once (unless the episode failed to start) and settle the reward; later calls read it.

        Never raises (except cancellation). Returns the reward: the verifier's,
        0.0 for the model's failures without one, ``None`` when the model was not
        judged (an infrastructure failure). Waits for :meth:`begin`; concurrent
        callers share one verification.
        """
        if self._verified:
            return self.record.reward
        if self._verify_lock is None:
            self._verify_lock = anyio.Lock()
        async with self._verify_lock:
            if not self._verified:
                await self.wait_ready()
                with self.disk.current():  # its downloads charge its disk bounds (the shim's verify too)
                    await self._verify_now()
                self._verified = True
        return self.record.reward

    async def _verify_now(self) -> None:
        if self.error is None and self.sandbox is not None:
            self.enter(Phase.VERIFY)
            try:
                result = await judge(self)
            except SandboxError as exc:
                self.verify_error = exc
                found = exc.output if isinstance(exc, VerifierFailure) else None
                self.record.verifier_output = found or await verifier_output(self)
                self.fail_with(exc)
            else:
                if result is None:  # no verifier (--disable-verification): no reward, not judged
                    self.settle()
                    return
                # No output and the test's stdout file came back with the verifier folder: it was empty, and reading
                # it again from the sandbox would put a round trip between the verdict and the waiting trainer.
                fetched = result.output is not None or stdout_came_back(self)
                self.record.verifier_output = result.output if fetched else await verifier_output(self)
                failure = self.record.failure
                if failure is None or failure.scored:
                    self.record.reward, self.record.rewards = result.reward, dict(result.rewards)
        self.settle()

    def settle(self) -> None:
        """Make the reward agree with the failure: none when not judged, 0 for the model's failure without one."""
        disk_bounds.settle_bounds(self)  # a disk bound passed: the model's scored failure (or the job's stop)
        failure = self.record.failure
        if failure is not None and not failure.scored:  # not judged: no reward
            self.record.reward, self.record.rewards = None, {}
        elif failure is not None and self.record.reward is None:
            self.record.reward = 0.0  # the model's episode, with no reward: it scores 0

    # ── stop ──────────────────────────────────────────────────────────────

    def retire(self) -> None:
        """End the episode from outside, now: cancel a start or setup in progress, stop the sandbox in the background.

        An episode without a verdict yet is recorded as interrupted (not judged).
        Idempotent; on the episode's loop.
        """
        self._leave()
        self.stop_soon()

    async def end(self) -> EpisodeRecord:
        """:meth:`retire`, waiting for the stop: a closing engine ends the episodes it still holds with it."""
        self._leave()
        return await self.stop()

    def _leave(self) -> None:
        self._retired = True
        if not self._verified and self.record.failure is None:  # no verdict: said now, before the stop writes the record
            self.interrupted()
        if self._start_scope is not None:
            self._start_scope.cancel()

    def stop_soon(self) -> None:
        """Schedule :meth:`stop` on the engine without waiting (a finished or unusable episode frees its slot now)."""
        try:
            self.engine.start_soon(self.stop, name=f"stop episode {self.record.sandbox or self.task.name}")
        except EngineClosedError:
            self.finish()  # the engine's own close stops (or stopped) every sandbox it holds
            self.hand_over()

    async def stop(self) -> EpisodeRecord:
        """Stop the sandbox (shielded, with its own budget) and finish the record; idempotent."""
        with anyio.CancelScope(shield=True):
            if self._stopped is not None:  # another caller is stopping it: wait for that stop
                await self._stopped.wait()
                return self.record
            self._stopped = anyio.Event()
            try:
                if self.sandbox is not None:
                    self.enter(Phase.STOP)
                    if self.trial_folder is not None:  # before the stop removes the sandbox's own trial folder
                        from harbor_async.jobs.harbor_layout import keep_trial_logs

                        # moves, copies and a walk of the logs: off the loop thread
                        await off_loop(keep_trial_logs, self.sandbox.trial_dir, self.trial_folder)
                    await self.sandbox.stop()
                self._close_phase()
                self.finish()
            finally:
                self._stopped.set()
                self.hand_over()
        return self.record

    def hand_over(self) -> None:
        """Give the finished record to :attr:`on_done`, once, whatever ended the episode: it always has its record."""
        sink, self.on_done = self.on_done, None
        if sink is not None:
            sink(self.record)

    def finish(self) -> None:
        """Fill in what the sandbox knows and log the episode's line (once)."""
        if self._finished:
            return
        self._finished = True
        record, sandbox = self.record, self.sandbox
        if sandbox is not None:
            record.start_attempts = sandbox.start_attempts
            record.start_window = sandbox.start_window
            record.resources = sandbox.resource_record()
            if self.judge_seconds and record.resources is not None:  # a separate verifier's sandbox is billed too
                record.resources["judge_sandbox_seconds"] = round(self.judge_seconds, 4)
                record.resources["sandbox_seconds"] = round(record.resources["sandbox_seconds"] + self.judge_seconds, 4)
            record.seconds.update({k: round(v, 4) for k, v in sandbox.times.seconds.items()})
            if sandbox.stop_error is not None:  # a leaked sandbox is the infrastructure's, unless blamed earlier
                self.fail_with(sandbox.stop_error)  # a stop's error (phase stop): infrastructure; a verdict given stays
        record.seconds["total"] = round(self._elapsed(), 4)
        record.finished_at = now_iso()
        if record.failure is not None and record.failure.scored and record.reward is None:
            record.reward = 0.0  # the model's episode, with no reward: it scores 0
        log.info(
            "episode",
            task=record.task,
            attempt=record.attempt,
            sandbox=record.sandbox,
            reward=record.reward,
            error_class=record.error_class,
            error_phase=record.error_phase,
            seconds=record.seconds["total"],
        )


def _caused(error: E, cause: BaseException) -> E:
    """``error``, raised from ``cause`` (its ``__cause__``), without raising it."""
    error.__cause__ = cause
    return error


def _described(exc: BaseException) -> str:
    """An error's type and message, for the typed error that wraps it."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
