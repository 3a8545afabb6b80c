"""One Harbor environment's lifecycle: start, exec, upload/download, verify, stop.

A :class:`Sandbox` is created by the :class:`~harbor_async.engine.engine.Engine`,
which hands it a frozen :class:`SandboxContext` (timeouts, retry policy,
limiters, stats sink, release callback) and never reaches into it; the sandbox
never imports the engine. Every method runs on the engine's event loop; every
Harbor object is created, used and closed there.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio

from harbor_async.backends import BackendSpec
from harbor_async.core.bounded_output import HeadTail
from harbor_async.core.errors import (
    PHASE_ERRORS,
    BackendExecTimeout,
    BackendQuotaError,
    EpisodeDeadlineError,
    InvalidTaskError,
    Phase,
    SandboxCancelledError,
    SandboxClosedError,
    SandboxError,
    SandboxTimeout,
    TransferLimitError,
    VerifierFailure,
    VerifierPathError,
    error_chain,
    throttle_in,
)
from harbor_async.core.logs import get_logger
from harbor_async.core.naming import TRIAL_MARKER_NAME, TrialDirNames, new_sandbox_id
from harbor_async.core.offload import off_loop
from harbor_async.core.policy import RetryPolicy, Timeouts, is_invalid_task
from harbor_async.core.results import (
    ExecOutput,
    PhaseTimes,
    VerifyResult,
    scalar_reward,
    truncate_output,
)
from harbor_async.core.stats import StatsRecorder
from harbor_async.core.usage import ResourceUsage
from harbor_async.engine.budget import Budget
from harbor_async.engine.phase_scope import PhaseScope, now
from harbor_async.engine.start_window import StartOutcome
from harbor_async.verification.reward_files import verifier_output

#: Seconds the reading of a sandbox's resource use may add to its stop.
USAGE_TIMEOUT = 10.0

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task


@dataclass(frozen=True)
class SandboxContext:
    """What a sandbox needs from its engine, fixed for the engine's life.

    Attributes:
        run_label: carried by every sandbox of the run (see :mod:`harbor_async.core.naming`).
        timeouts: per-phase budgets and the episode deadline.
        retry: the start retry policy.
        max_output: characters of exec output kept (``None``: all).
        truncation_marker: appended to cut output.
        budget: live slots (a sandbox holds one from its create call until its
            stop is confirmed), create turns and exec slots.
        stats: the stats sink counters and latencies are recorded into.
        on_done: called once a sandbox is stopped and holds nothing (the engine's ledger).
        start_options: backend start options (e.g. ``docker_overlay``), see
            :meth:`BackendSpec.start_extras`.
        trial_names: the run's Harbor trial-folder names.
        strict_verify: end every agent process before the verifier runs
            (default; :mod:`harbor_async.verification.isolation`).
        agent_env: the run's variables over the agent phase's commands (``--ae``, filled).
        resource_telemetry: read what each sandbox used just before its stop
            (:mod:`harbor_async.core.usage`); its billed seconds are counted either way.
    """

    run_label: str
    timeouts: Timeouts
    retry: RetryPolicy
    max_output: int | None
    truncation_marker: str
    budget: Budget
    stats: StatsRecorder
    on_done: Callable[[Sandbox], None]
    start_options: Mapping[str, Any] = field(default_factory=dict)
    trial_names: TrialDirNames | None = None
    strict_verify: bool = True
    agent_env: Mapping[str, str] = field(default_factory=dict)
    resource_telemetry: bool = True

    _timeouts_seen: dict[Timeouts, Timeouts] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.trial_names is None:
            object.__setattr__(self, "trial_names", TrialDirNames(self.run_label))

    def timeouts_for(self, task: Task) -> Timeouts:
        """``timeouts.for_task(task)``, one shared (frozen) copy per value: not one per live sandbox for the GC."""
        timeouts = self.timeouts.for_task(task)
        return self._timeouts_seen.setdefault(timeouts, timeouts)


class SandboxState(StrEnum):
    """Where a sandbox is in its lifecycle."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class Sandbox:
    """The lifecycle of one Harbor environment for one task.

    Created by :meth:`Engine.launch`; use :meth:`wait_started`, :meth:`exec`,
    :meth:`verify` and :meth:`stop` from the engine's loop.
    """

    def __init__(
        self,
        context: SandboxContext,
        task: Task,
        backend: BackendSpec,
        *,
        backend_kwargs: dict[str, Any] | None = None,
        episode_timeout: float | None = None,
        start_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.context = context
        #: the backend's start options: the engine's, with this sandbox's own over them (a judge's: no host mounts)
        self.start_options = {**context.start_options, **(start_options or {})}
        self.timeouts = context.timeouts_for(task)
        self.task = task
        self.task_name: str = task.name
        self.backend = backend
        self.id = new_sandbox_id(context.run_label)
        self.state = SandboxState.PENDING
        self.start_attempts = 0
        self.start_window: int | None = None  # the adaptive window when the last start attempt began
        self.times = PhaseTimes()
        #: what the sandbox used, read just before its stop (None: not read, or its backend measures nothing)
        self.resources: ResourceUsage | None = None
        #: seconds its environments existed, from each create call to that environment's stop (failed attempts too)
        self.sandbox_seconds = 0.0
        self._up_since: float | None = None  # when the running environment's create call began
        self.start_error: SandboxError | None = None
        self.stop_error: SandboxError | None = None
        self._backend_kwargs = dict(backend_kwargs or {})
        self._episode_timeout = episode_timeout if episode_timeout is not None else self.timeouts.episode
        self._slot_scope: anyio.CancelScope | None = None  # while waiting for a live slot
        self._slot_wait = math.inf  # that wait's budget
        self._start_phase: tuple[anyio.CancelScope, float, float | None] | None = None  # scope, begin, budget
        self._deadline = math.inf
        self.renew_deadline()
        self._env: BaseEnvironment | None = None
        #: what the backend keeps after this sandbox's stop for later starts (the docker fast start's task image),
        #: read before each stop; the engine deletes it at its close when asked (Harbor's ``--delete``)
        self.kept_build: str | None = None
        self._trial_dir: Path | None = None
        # Whether the start is over (up or failed) and the stop done; an event (three objects for the
        # collector to walk, per live sandbox) exists only while someone waits for one (see _until).
        self._is_started = self._is_stopped = False
        self._change: anyio.Event | None = None
        self._stop_claimed = False
        self._holds_slot = False
        self._start_scope: anyio.CancelScope | None = None
        self._logger: Any = None  # see _log

    # ── public API ──────────────────────────────────────────────────────

    @property
    def environment(self) -> BaseEnvironment:
        """The live Harbor environment (raises if the sandbox is not running)."""
        if self._env is None or self.state is not SandboxState.RUNNING:
            raise SandboxClosedError(Phase.EXEC, self.task_name, self.id, f"sandbox is {self.state}")
        return self._env

    @property
    def trial_dir(self) -> Path | None:
        """Harbor's trial directory on the host (removed at stop)."""
        return self._trial_dir

    @property
    def done(self) -> bool:
        """Whether the sandbox is stopped (or failed to start and holds nothing)."""
        return self._is_stopped

    @property
    def deadline_left(self) -> float | None:
        """Seconds left before the episode deadline (``None``: no deadline)."""
        return None if math.isinf(self._deadline) else self._deadline - anyio.current_time()

    def renew_deadline(self) -> None:
        """Count the episode deadline from now, for a start in progress too (call on the loop).

        For a sandbox started ahead of its episode (the shim's prefetch): the
        episode's budget starts when it claims the sandbox, not at the launch.
        A wait for a live slot, a start attempt and the start's retries then
        run under the renewed deadline (each still bounded by its own budget).
        """
        episode = self._episode_timeout
        self._deadline = anyio.current_time() + episode if episode is not None else math.inf
        if self._slot_scope is not None:
            self._slot_wait = self._budget(Phase.START, self.timeouts.slot)
            self._slot_scope.deadline = anyio.current_time() + self._slot_wait
        if self._start_phase is not None:
            scope, begin, budget = self._start_phase
            scope.deadline = min(begin + (math.inf if budget is None else budget), self._deadline)

    async def wait_started(self) -> None:
        """Wait until the start finished; raise its error if it failed."""
        if not self._is_started:  # skip the checkpoint on the hot path
            await self._until("started")
        if self.start_error is not None:
            raise self.start_error
        if self.state is not SandboxState.RUNNING:
            raise SandboxClosedError(Phase.EXEC, self.task_name, self.id, f"sandbox is {self.state}")

    async def exec(
        self,
        command: str,
        *,
        timeout: float | None = None,
        max_output: int | None | Literal["default"] = "default",
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | int | None = None,
    ) -> ExecOutput:
        """Run ``command`` in the sandbox and return its output and exit code.

        A non-zero exit code is a result, not an error. Running past ``timeout``
        (default: the engine's exec budget) raises :class:`SandboxTimeout`; the
        command is never retried.
        """
        if not self._is_started or self.start_error is not None or self.state is not SandboxState.RUNNING:
            await self.wait_started()  # raises; up and running, the hot path makes no coroutine for it
        environment = self.environment
        limit = self.context.max_output if max_output == "default" else max_output
        budget = timeout if timeout is not None else self.timeouts.exec
        async with self.context.budget.exec_slot():
            async with self._phase(Phase.EXEC, budget=budget) as seconds:
                # The engine's scope is exact; the backend's own timeout is a backstop.
                timeout_sec = None if budget is None else math.ceil(budget) + 1
                result = await environment.exec(
                    command, cwd=cwd, env=env, timeout_sec=timeout_sec, user=user
                )
        stdout, stderr = result.stdout or "", result.stderr or ""
        output, truncated = truncate_output(stdout + stderr, limit, self.context.truncation_marker)
        return ExecOutput(output, stdout, stderr, result.return_code, truncated, seconds())

    async def upload(self, source: Path | str, target: str) -> None:
        """Copy a host file or folder into the sandbox."""
        await self.wait_started()
        source = Path(source)
        async with self.context.budget.exec_slot(), self._phase(Phase.EXEC, budget=self.timeouts.exec):
            if source.is_dir():
                await self.environment.upload_dir(source, target)
            else:
                await self.environment.upload_file(source, target)

    async def download(self, source: str, target: Path | str, *, directory: bool = False) -> None:
        """Copy a sandbox file (or folder, with ``directory=True``) to the host."""
        await self.wait_started()
        async with self.context.budget.exec_slot(), self._phase(Phase.EXEC, budget=self.timeouts.exec):
            if directory:
                await self.environment.download_dir(source, target)
            else:
                await self.environment.download_file(source, target)

    async def verify(self, step: StepConfig | None = None, *, tests_in_image: bool = False) -> VerifyResult:
        """Run the task's verifier (a step's: its tests and the shared ones) with Harbor's own; return the reward.

        Raises :class:`~harbor_async.core.errors.VerifierFailure` when the verifier ran
        but gave no valid reward (a missing, empty or malformed reward file) or
        ran past its budget: the model's episode, not the infrastructure's. The
        verifier's output is kept on the result and on that error.
        """
        from harbor.models.trial.paths import EnvironmentPaths
        from harbor.verifier.verifier import (
            AddTestsDirError,
            DownloadVerifierDirError,
            RewardFileEmptyError,
            RewardFileNotFoundError,
            VerifierOutputParseError,
        )

        from harbor_async.verification.isolation import (
            AgentProcessesSurvivedError,
            end_agent_processes,
            replaced_verifier_folders,
            save_verifier_output,
            verifier_scope,
        )
        from harbor_async.verification.reward_files import BoundedVerifier

        await self.wait_started()
        environment = self.environment
        try:
            async with (
                self.context.budget.exec_slot(),
                self._phase(Phase.VERIFY, budget=self.context.timeouts.for_step(self.task, step).verify) as seconds,
            ):
                if self.context.strict_verify:
                    try:
                        await end_agent_processes(environment)
                    except AgentProcessesSurvivedError as exc:  # what the agent left outran the kill: its episode
                        raise VerifierFailure(Phase.VERIFY, self.task_name, self.id, str(exc)) from exc
                env_paths = EnvironmentPaths.for_os(environment.os)
                verifier = BoundedVerifier(  # Harbor's verifier, reading the reward files with bounds
                    task=self.task, trial_paths=self._trial_paths(), environment=environment,
                    # Emptied right before the tests (nothing the agent left there is read as its reward), made
                    # if missing (test.sh redirects into it; the shell cannot create its parent).
                    override_env=self.task.config.verifier.env or None, reset_verifier_dir=True,
                    verifier_env=step.verifier.env or None if step else None, step_name=step and step.name,
                    skip_tests_upload=tests_in_image,  # a verifier image with the tests built in (Harbor's rule)
                )  # fmt: skip
                user = step.verifier.user if step and step.verifier.user is not None else self.task.config.verifier.user
                try:
                    with environment.with_default_user(user):  # [verifier] user, as Harbor runs it
                        async with verifier_scope(environment):  # its own folders where the backend can
                            try:
                                result = await verifier.verify()
                            except BaseException:  # a test that hung or failed: keep what it printed, bounded
                                if self._trial_dir is not None:
                                    await save_verifier_output(environment, env_paths, self._trial_paths())
                                raise
                except (RewardFileNotFoundError, RewardFileEmptyError, VerifierOutputParseError) as exc:
                    raise VerifierFailure(
                        Phase.VERIFY, self.task_name, self.id, f"{type(exc).__name__}: {exc}",
                        output=self._verifier_output(),
                    ) from exc  # fmt: skip
                except (VerifierPathError, AddTestsDirError) as exc:  # a verifier folder the agent replaced: its episode
                    found = str(exc) if isinstance(exc, VerifierPathError) else await replaced_verifier_folders(environment, env_paths)
                    if found is None:  # no evidence in the sandbox: the backend's copy failed
                        raise
                    raise VerifierFailure(Phase.VERIFY, self.task_name, self.id, found) from exc
                except DownloadVerifierDirError as exc:
                    if not isinstance(exc.__cause__, (TransferLimitError, FileNotFoundError)):
                        raise
                    raise VerifierFailure(  # what the sandbox left there, not the infrastructure
                        Phase.VERIFY, self.task_name, self.id, f"{type(exc.__cause__).__name__}: {exc.__cause__}",
                        output=self._verifier_output(),
                    ) from exc  # fmt: skip
        except SandboxTimeout as exc:
            if isinstance(exc, EpisodeDeadlineError):
                raise
            raise VerifierFailure(
                Phase.VERIFY, self.task_name, self.id, f"the verifier {exc.detail}", output=self._verifier_output()
            ) from exc
        rewards = dict(result.rewards or {})
        return VerifyResult(scalar_reward(rewards), rewards, seconds(), self._verifier_output())

    def _verifier_output(self) -> str | None:
        """The verifier's stdout and stderr as Harbor saved them in the trial folder (the tail of each)."""
        return None if self._trial_dir is None else verifier_output(self._trial_paths().verifier_dir)

    async def stop(self) -> None:
        """Stop the sandbox and remove its trial directory; idempotent.

        Runs shielded with its own budget: cancelling the caller (or an episode
        deadline that has passed) never skips the teardown.
        """
        with anyio.CancelScope(shield=True):
            if self._stop_claimed:
                await self._until("stopped")
                return
            self._stop_claimed = True
            try:
                if not self._is_started:
                    # Stopped before it was up: cancel the start; it cleans up after itself.
                    if self._start_scope is not None:
                        self._start_scope.cancel()
                    await self._until("started")
                if self._env is not None:
                    self.state = SandboxState.STOPPING
                    try:
                        async with self._phase(Phase.STOP, budget=self.timeouts.stop):
                            self.kept_build = getattr(self._env, "kept_build", None) or self.kept_build
                            if self.context.resource_telemetry:
                                self.resources = await self._read_usage(self._env)
                            await self._env.stop(delete=True)
                    except SandboxError as exc:
                        self.stop_error = exc
                        self.context.stats.stop_failures += 1
                        self._log.error("stop failed; the sandbox may be left behind", error=str(exc))
                    self._env = None
                    if self._up_since is not None:
                        self.sandbox_seconds += anyio.current_time() - self._up_since
                        self._up_since = None
                self.context.stats.add_usage(self.sandbox_seconds, self.resources)  # failed attempts' seconds too
                if self.state is not SandboxState.FAILED:
                    self.state = SandboxState.STOPPED
            finally:
                await self._remove_trial_dir()
                self._release()
                self._set("stopped")

    # ── the start: a live slot, a create turn, retries ────────────────────

    async def run_start(self) -> None:
        """The whole start, for the engine's task group: wait for a live slot, then start.

        A start that gets no slot within the slot budget (slots free only when
        sandboxes stop) fails with a :class:`SandboxTimeout` naming the limit;
        a failed start stops the sandbox, which gives the slot back.
        """
        stats = self.context.stats
        with anyio.CancelScope() as scope:
            self._start_scope = scope
            if self._stop_claimed:  # stopped before the start began: it never does
                scope.cancel()
            wait = self._slot_wait = self._budget(Phase.START, self.timeouts.slot)
            try:
                with anyio.fail_after(wait if math.isfinite(wait) else None) as self._slot_scope:
                    await self.context.budget.acquire_live(self)
            except TimeoutError:
                self._abandon_start(
                    SandboxTimeout(
                        Phase.START, self.task_name, self.id,
                        f"no live-sandbox slot within {max(self._slot_wait, 0):.3g} s "
                        f"(limit: {self.context.budget.live_limit} live sandboxes)",
                    )  # fmt: skip
                )
            except BaseException as exc:
                self._abandon_start(exc)
                raise
            else:
                self._holds_slot = True
                stats.add_live(+1)
                await self._start()
            finally:
                self._slot_scope = None
        self._start_scope = None  # the start is over: a live sandbox keeps no scope (and its sets) for the collector
        if self.state is SandboxState.RUNNING:
            stats.started += 1
        elif isinstance(self.start_error, SandboxCancelledError):
            stats.cancelled += 1  # superseded or stopped first: not a failure
            await self.stop()
        else:
            stats.failed += 1
            if self.start_error is not None:
                self._log.warning("start failed", error=str(self.start_error))
            await self.stop()  # gives the slot back; the start already cleaned up

    def _release(self) -> None:
        """Give back the live slot and leave the engine's ledger."""
        if self._holds_slot:
            self._holds_slot = False
            self.context.budget.release_live(self)
            self.context.stats.add_live(-1)
            self.context.stats.stopped += 1
        self.context.on_done(self)

    async def _start(self) -> None:
        """Create and start the environment, retrying transient failures."""
        self.state = SandboxState.STARTING
        try:
            async for attempt in self.context.retry.retrying(lambda: self._deadline):
                with attempt:
                    self.start_attempts = attempt.retry_state.attempt_number
                    if self.start_attempts > 1:
                        self.context.stats.retried += 1
                    await self._start_once()
        except BaseException as exc:
            self.state = SandboxState.FAILED
            self.start_error = self._as_error(Phase.START, exc)
            if not isinstance(exc, Exception):  # cancellation: let it through
                raise
        else:
            self.state = SandboxState.RUNNING
        finally:
            self._set("started")

    def _abandon_start(self, exc: BaseException) -> None:
        """Mark a start that never began (cancelled while waiting for a slot)."""
        self.state = SandboxState.FAILED
        self.start_error = self._as_error(Phase.START, exc)
        self._set("started")

    def _set(self, what: str) -> None:
        """Mark ``_is_started`` or ``_is_stopped`` (``what``) and wake whoever waits (see _until)."""
        setattr(self, f"_is_{what}", True)
        event, self._change = self._change, None
        if event is not None:
            event.set()

    async def _until(self, what: str) -> None:
        """Wait for ``_is_started`` or ``_is_stopped`` (a checkpoint if set already, as a set ``Event``'s wait)."""
        if getattr(self, f"_is_{what}"):
            await anyio.lowlevel.checkpoint()
        while not getattr(self, f"_is_{what}"):  # woken by either: the other goes back to waiting
            if self._change is None:
                self._change = anyio.Event()
            await self._change.wait()

    async def _start_once(self) -> None:
        """One start attempt, holding a place in the start window from its create turn to its answer."""
        budget = self.context.budget
        ticket = await budget.begin_start()
        outcome, began = StartOutcome.FAILED, anyio.current_time()
        try:
            await budget.create_turn()
            began = anyio.current_time()
            if ticket is not None:
                self.start_window = ticket.window
            await self._create_and_start()
            outcome = StartOutcome.OK
        except BaseException as exc:
            if (throttle := throttle_in(exc)) is not None:
                outcome = StartOutcome.QUOTA if isinstance(throttle, BackendQuotaError) else StartOutcome.THROTTLED
                self.context.stats.throttled += 1
            raise
        finally:
            budget.end_start(ticket, outcome, anyio.current_time() - began, not self.backend.on_this_machine)

    async def _create_and_start(self) -> None:
        created = anyio.current_time()
        async with self._phase(Phase.START, budget=self.timeouts.start, wrap=False):
            self._trial_dir = await self._make_trial_dir()
            paths = self._trial_paths()
            await self._file_work(paths.mkdir)
            try:
                self._env = self.backend.create_environment(
                    self.task,
                    paths,
                    session_id=self.id,
                    run_label=self.context.run_label,
                    backend_kwargs=self._backend_kwargs,
                    options=self.start_options,
                )
                await self._env.start(force_build=bool(self.start_options.get("force_build", False)))
                await self._env.run_healthcheck()
            except BaseException as exc:
                await self._discard_failed_start()
                self.sandbox_seconds += anyio.current_time() - created
                typed = self.backend.typed_error(exc)
                if typed is exc:
                    raise
                raise typed from exc
            self._up_since = created

    async def _discard_failed_start(self) -> None:
        """Tear down what a failed start attempt left, so a retry starts clean."""
        with anyio.CancelScope(shield=True):
            env, self._env = self._env, None
            if env is not None:
                self.kept_build = getattr(env, "kept_build", None) or self.kept_build  # built before the start failed
                with anyio.move_on_after(self.timeouts.stop or math.inf):
                    try:
                        await env.stop(delete=True)
                    except Exception as exc:  # the start error is the one that matters
                        self._log.warning("stop after failed start failed", error=repr(exc))
            await self._remove_trial_dir()

    async def _read_usage(self, env: BaseEnvironment) -> ResourceUsage | None:
        """``env``'s ``resource_usage()`` where its backend has one; a reading that fails or hangs costs the stop nothing."""
        reader = getattr(env, "resource_usage", None)
        if reader is None:
            return None
        began, usage, ok = anyio.current_time(), None, False
        with anyio.move_on_after(USAGE_TIMEOUT):
            try:
                usage, ok = await reader(), True
            except Exception as exc:  # noqa: BLE001  # telemetry never fails an episode
                self._log.warning("resource usage not read", error=repr(exc))
        self.context.stats.record("usage", anyio.current_time() - began, ok)  # its cost, in the engine's latencies
        return usage

    def resource_record(self) -> dict[str, Any] | None:
        """The record's ``resources`` (:meth:`~harbor_async.core.usage.ResourceUsage.as_record`); ``None``: no
        environment was ever created."""
        if self.resources is None and not self.sandbox_seconds:
            return None
        return (self.resources or ResourceUsage()).as_record(self.sandbox_seconds)

    # ── helpers ─────────────────────────────────────────────────────────

    @property
    def _log(self) -> Any:
        """The sandbox's logger, made on its first event: most sandboxes never log one."""
        log = self._logger
        if log is None:
            log = self._logger = get_logger(task=self.task_name, sandbox=self.id, backend=self.backend.name)
        return log

    def _trial_paths(self):
        from harbor.models.trial.paths import TrialPaths

        if self._trial_dir is None:
            raise SandboxClosedError(Phase.EXEC, self.task_name, self.id, "sandbox has no trial directory")
        return TrialPaths(trial_dir=self._trial_dir)

    async def _make_trial_dir(self) -> Path:
        """A new trial folder of this run's (its name taken on the loop; made in a worker thread: file work is not the loop's)."""
        names = cast(TrialDirNames, self.context.trial_names)  # set by __post_init__
        while True:
            folder = Path(tempfile.gettempdir()) / names.acquire()
            with anyio.CancelScope(shield=True):  # made and marked, or not made: never half
                made = await self._file_work(_make_marked_folder, folder, self.id)
            if made:
                return folder  # else left by someone else: keep its slot taken

    async def _file_work[T](self, fn: Callable[..., T], *args: Any) -> T:
        """The trial folder's file work: in a worker thread where the sandboxes share this machine (local, docker),
        whose disk they keep busy (a mkdir or an rmtree there takes milliseconds under load); inline for a
        simulated or remote backend, whose folder is a few small files (and whose tests run on trio's MockClock,
        which a thread's wait would make jump)."""
        return await off_loop(fn, *args) if self.backend.on_this_machine else fn(*args)

    async def _remove_trial_dir(self) -> None:
        """Remove the trial folder (in a worker thread) and free its name; call shielded."""
        folder, self._trial_dir = self._trial_dir, None
        if folder is not None and await self._file_work(_remove_folder, folder):
            cast(TrialDirNames, self.context.trial_names).release(folder.name)

    def _budget(self, phase: Phase, budget: float | None) -> float:
        """The phase budget, cut to what is left of the episode (teardown excepted)."""
        limit = math.inf if budget is None else budget
        if phase is Phase.STOP or self._deadline == math.inf:  # no episode deadline: no clock to read
            return limit
        return min(limit, self._deadline - now())

    def _as_error(self, phase: Phase, exc: BaseException, budget: float | None = None) -> SandboxError:
        """Turn any exception from ``phase`` into the typed error, chained to it."""
        if isinstance(exc, SandboxError):
            return exc
        attempt = max(self.start_attempts, 1)
        error: SandboxError
        if isinstance(exc, BackendExecTimeout):  # the backend's own bound, before the engine's
            error = SandboxTimeout(phase, self.task_name, self.id, str(exc), start_attempt=attempt)
        elif isinstance(exc, TimeoutError):
            detail = f"no result within {budget:.3g} s" if budget is not None else str(exc)
            deadline = self._deadline - anyio.current_time() <= 0 and phase is not Phase.STOP
            kind = EpisodeDeadlineError if deadline else SandboxTimeout
            error = kind(phase, self.task_name, self.id, detail, start_attempt=attempt)
        elif isinstance(exc, anyio.get_cancelled_exc_class()):
            error = SandboxCancelledError(phase, self.task_name, self.id, "cancelled before it finished", start_attempt=attempt)
        else:
            detail = _describe(exc)
            invalid = InvalidTaskError if phase is Phase.START and is_invalid_task(exc) else None
            error = (invalid or PHASE_ERRORS[phase])(phase, self.task_name, self.id, detail, start_attempt=attempt)
        error.__cause__ = exc
        return error

    def _phase(self, phase: Phase, *, budget: float | None, wrap: bool = True) -> PhaseScope:
        """Time, log and bound one phase (``async with``); with ``wrap``, turn errors into typed ones.

        Yields a callable returning the seconds the phase took so far.
        """
        return PhaseScope(self, phase, budget, wrap)

    bounded_phase = _phase  # public: a Harbor agent's setup and run, driven from harbor_async.agents.harbor

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} task={self.task_name!r} backend={self.backend.name!r} {self.state}>"


#: Bytes of a wrapped error's root cause kept in the detail, head and tail (a failed CLI call's output can be long).
CAUSE_CHARS = 600


def _describe(exc: BaseException) -> str:
    """``Type: message``, and the root cause it was raised from where that says more: a library's wrapper
    (Harbor's ``AddTestsDirError``) names the step that failed, only its cause says why."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    root = list(error_chain(exc))[-1]
    if root is not exc and str(root) and str(root) not in detail:
        cut = HeadTail(CAUSE_CHARS)
        cut.keep(str(root).encode())
        detail += f" (from {type(root).__name__}: {cut.text()})"
    return detail


def _make_marked_folder(folder: Path, owner: str) -> bool:
    """Make ``folder`` with its trial marker naming ``owner``; ``False`` if it exists already."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        return False
    (folder / TRIAL_MARKER_NAME).write_text(owner)
    return True


def _remove_folder(folder: Path) -> bool:
    """Remove ``folder`` and everything in it, quietly; whether it is gone."""
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()
