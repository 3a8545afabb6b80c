"""One episode, step by step: launch, start (+ harness setup), agent, verify, stop -> one record.

The one place where an episode's phases are timed, its failures classified,
its reward settled and its :class:`~harbor_async.records.EpisodeRecord` built.
Every caller drives the same :class:`Episode`:

- :func:`harbor_async.runner.run_episode` drives it to the end in one call,
  for ``run`` (Harbor's model-free agents), ``eval`` (a harness driven by a
  model server, :mod:`harbor_async.model_agent`) and the cluster workers;
- the shim (``shim.episode``) drives it one call at a time from TRL's thread:
  ``reset()`` starts it, tool calls go through :meth:`Episode.exec_text`, the
  reward is :meth:`Episode.verify`, the stop runs in the background.

Phases follow each other (start, agent, verify, stop): entering one closes the
one before, so every record has the same phase structure whoever drove it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel

from harbor_async.backends import enter_network_phase
from harbor_async.errors import (
    AgentSetupError,
    EpisodeDeadlineError,
    EpisodeInterruptedError,
    FailureClass,
    NetworkPhaseError,
    Phase,
    SandboxClosedError,
    SandboxError,
    SandboxTimeout,
    StartError,
    VerifierFailure,
)
from harbor_async.logs import get_logger
from harbor_async.policy import failure_class
from harbor_async.records import EpisodeRecord, PhaseSpan
from harbor_async.reward_files import VERIFIER_OUTPUT_LIMIT
from harbor_async.sandbox import SandboxState

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.engine import Engine
    from harbor_async.results import VerifyResult
    from harbor_async.sandbox import Sandbox

log = get_logger()

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

#: Where Harbor's verifier writes the test script's stdout and stderr, in the sandbox.
VERIFIER_OUTPUT_PATH = "/logs/verifier/test-stdout.txt"
#: Seconds granted to fetch the verifier's output from a sandbox after the verifier failed.
VERIFIER_OUTPUT_TIMEOUT = 10.0


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
    ) -> None:
        self.engine = engine
        #: Where the finished record goes (a job folder, a progress bar), from :meth:`stop`'s ``finally``.
        self.on_done = on_done
        self.task = task
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
        if engine.trials_dir is not None:  # Harbor's trial folder of this episode in the job (harbor_async.harbor_jobs)
            from harbor_async.harbor_jobs import trial_name

            self.record.trial = trial_name(task.name)
        self.sandbox: Sandbox | None = None
        self.error: BaseException | None = None
        self.verify_error: SandboxError | None = None
        self.exec_errors: list[SandboxError] = []
        self.tool_seconds = 0.0
        #: The agent's own budget (eval's ``--agent-timeout``), which replaces the task's (each step's).
        self.agent_timeout = agent_timeout
        self.agent_budget: float | None = self.agent_budget_for(None)
        self.step: StepConfig | None = None  # the step in progress of a multi-step task (harbor_async.steps)
        self._begin: float | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._open: tuple[Phase, float] | None = None
        self._stopped: anyio.Event | None = None
        self._finished = False

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
        self.fail(failure_class(exc), exc, phase)

    def fail(self, failure: FailureClass, exc: BaseException | str, phase: Phase | str | None = None) -> None:
        """Record a failure of class ``failure`` (the first one recorded is kept: the right blame).

        Use :meth:`fail_with`: the class is the table's to decide
        (:data:`harbor_async.policy.ERROR_POLICY`). Kept for the callers that still name one.
        """
        value = phase.value if isinstance(phase, Phase) else phase
        self.record.set_error(failure, exc, value)

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
        """Called once the sandbox's start is known to have worked (``None``) or failed."""

    # ── agent ─────────────────────────────────────────────────────────────

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the episode's loop from any other thread and wait (a sync tool's call)."""
        return anyio.from_thread.run(fn, *args, token=self._token)

    async def call_async(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` from async code on the episode's loop (an async tool, ``_setup``)."""
        return await fn(*args)

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
        """
        if self.error is not None:
            return describe_unavailable(self.error)
        assert self.sandbox is not None
        if timeout is None:
            timeout = self.sandbox.timeouts.exec
        agent_limited = False
        if self.agent_budget is not None:
            left = self.agent_budget - self.tool_seconds
            if left <= 0:
                return (
                    f"Error: this task's time limit for the agent ({_seconds(self.agent_budget)}) was reached; "
                    "no more commands run in this episode."
                )
            agent_limited = timeout is None or left < timeout
            timeout = left if agent_limited else timeout
        began = anyio.current_time()
        try:
            result = await self.sandbox.exec(command, timeout=timeout)
        except EpisodeDeadlineError:
            return "Error: the episode's time limit was reached; the command was stopped."
        except SandboxTimeout:
            if agent_limited:
                return (
                    f"Error: this task's time limit for the agent ({_seconds(self.agent_budget)}) was reached; "
                    "the command was stopped."
                )
            return f"Error: the command timed out after {_seconds(timeout)} and was stopped."
        except SandboxClosedError as exc:
            self.exec_errors.append(exc)
            return describe_unavailable(exc)
        except SandboxError as exc:
            self.exec_errors.append(exc)
            return f"Error: the command could not be run ({exc})."
        finally:
            self.tool_seconds += anyio.current_time() - began
        # TRL's format: stdout then stderr, cut at 8000 characters (by the engine), or a placeholder.
        return result.output or f"(empty output, rc={result.exit_code})"

    # ── verify ────────────────────────────────────────────────────────────

    async def verify(self) -> float | None:
        """Run the verifier (unless the episode already failed to start); settle the reward.

        Never raises (except cancellation). Returns the reward: the verifier's,
        0.0 for the model's failures without one, ``None`` when the model was not
        judged (an infrastructure failure).
        """
        if self.error is None and self.sandbox is not None:
            self.enter(Phase.VERIFY)
            try:
                result = await self.judge()
            except SandboxError as exc:
                self.verify_error = exc
                found = exc.output if isinstance(exc, VerifierFailure) else None
                self.record.verifier_output = found or await self._verifier_output()
                self.fail_with(exc)
            else:
                # No output and the test's stdout file came back with the verifier folder: it was empty, and reading
                # it again from the sandbox would put a round trip between the verdict and the waiting trainer.
                fetched = result.output is not None or self._stdout_came_back()
                self.record.verifier_output = result.output if fetched else await self._verifier_output()
                failure = self.record.failure
                if failure is None or failure.scored:
                    self.record.reward, self.record.rewards = result.reward, dict(result.rewards)
        self.settle()
        return self.record.reward

    async def judge(self, step: StepConfig | None = None) -> VerifyResult:
        """Collect the artifacts, then run the verifier (of ``step``): in this sandbox, or in a fresh one.

        A separate verifier (``environment_mode = "separate"``) runs in a new
        sandbox of the task's environment, given the collected artifacts
        (:mod:`harbor_async.artifacts`); it is stopped once it has judged.
        """
        from harbor_async.artifacts import collect_artifacts, drop_if_empty, upload_artifacts
        from harbor_async.harbor_jobs import keep_trial_logs
        from harbor_async.task_support import separate_verifier
        from harbor_async.verifier_env import verifier_task

        assert self.sandbox is not None
        separate = separate_verifier(self.task, step)
        root = self.trial_folder
        if root is not None:
            folder: Path | None = root / "steps" / step.name / "artifacts" if step is not None else root / "artifacts"
        else:  # kept only for a separate verifier, in the sandbox's own (temporary) trial folder
            trial = self.sandbox.trial_dir
            folder = trial / "collected-artifacts" if separate and trial is not None else None
        if folder is not None:
            await self.sandbox.wait_started()
            await collect_artifacts(self.sandbox.environment, self.task, folder, step)
            if root is not None and not separate:  # nothing published: no folder in the job
                drop_if_empty(folder, root)
        logs = None if root is None else root / "steps" / step.name if step is not None else root
        if not separate:
            await enter_network_phase(self.sandbox.environment, self.task, "verifier", step)
            try:
                return await self.sandbox.verify(step)
            finally:
                if logs is not None and step is not None:  # each step's agent and verifier logs, as Harbor keeps them
                    keep_trial_logs(self.sandbox.trial_dir, logs)
        task, tests_in_image = verifier_task(self.task, step)  # the task's environment, or the verifier's own
        judge = self.engine.launch(task, self.backend, backend_kwargs=self.backend_kwargs)
        try:
            await judge.wait_started()
            if folder is not None:
                await upload_artifacts(judge.environment, task, folder, step)
            await enter_network_phase(judge.environment, task, "verifier", step)
            return await judge.verify(step, tests_in_image=tests_in_image)
        finally:
            if logs is not None:  # the verifier's output is the judge's, in its own trial folder
                keep_trial_logs(judge.trial_dir, logs, only=("verifier",))
                if step is not None:
                    keep_trial_logs(self.sandbox.trial_dir, logs, only=("agent",))
            await judge.stop()

    def settle(self) -> None:
        """Make the reward agree with the failure: none when not judged, 0 for the model's failure without one."""
        failure = self.record.failure
        if failure is not None and not failure.scored:  # not judged: no reward
            self.record.reward, self.record.rewards = None, {}
        elif failure is not None and self.record.reward is None:
            self.record.reward = 0.0  # the model's episode, with no reward: it scores 0

    def _stdout_came_back(self) -> bool:
        """Whether the verifier's download put the test's stdout file in this sandbox's trial folder."""
        from harbor.models.trial.paths import TrialPaths

        trial = None if self.sandbox is None else self.sandbox.trial_dir
        return trial is not None and os.path.lexists(TrialPaths(trial_dir=trial).test_stdout_path)

    async def _verifier_output(self) -> str | None:
        """The end of the test script's stdout read from the sandbox, or ``None`` when there is none.

        Not where the verifier had folders of its own: the sandbox's are the agent's.
        """
        assert self.sandbox is not None
        if getattr(self.sandbox.environment, "verifier_scope", None) is not None:
            return None
        try:
            with anyio.fail_after(VERIFIER_OUTPUT_TIMEOUT):
                found = await self.sandbox.exec(
                    f"tail -c {VERIFIER_OUTPUT_LIMIT} {VERIFIER_OUTPUT_PATH} 2>/dev/null",
                    timeout=VERIFIER_OUTPUT_TIMEOUT,
                    max_output=None,
                )
        except (SandboxError, TimeoutError, OSError):
            return None
        text = found.stdout if found.exit_code == 0 else None
        return text[-VERIFIER_OUTPUT_LIMIT:] if text else None

    # ── stop ──────────────────────────────────────────────────────────────

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
                        from harbor_async.harbor_jobs import keep_trial_logs

                        keep_trial_logs(self.sandbox.trial_dir, self.trial_folder)
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


def describe_unavailable(error: BaseException) -> str:
    """The tool-call message for an episode whose sandbox cannot run commands."""
    if isinstance(error, StartError) or (isinstance(error, SandboxTimeout) and error.phase is Phase.START):
        return (
            f"Error: the sandbox for this task could not be started, so no command can run in this episode ({error})."
        )
    if isinstance(error, SandboxClosedError):
        return f"Error: the sandbox of this episode is no longer available ({error})."
    return (
        "Error: the sandbox for this task could not be prepared, so no command can run "
        f"in this episode ({type(error).__name__}: {error})."
    )


def _seconds(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "its time limit"
    return f"{value:g} s"
