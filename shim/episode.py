"""One rollout of one env, driven on the loop thread: start, harness setup, commands, reward, stop.

``reset()`` creates an :class:`Episode` on the trainer thread and hands
:meth:`Episode.run` to the loop thread without waiting: the sandbox starts and
the harness prepares it in the background while the trainer generates. Tool
calls and the reward wait on the loop for that preparation, never on the
trainer thread's own clock. Failures become values here (an error message for
a tool call; a reward of ``None`` when the infrastructure failed, so that the
trainer leaves the rollout out instead of scoring the model 0), so that one bad
sandbox never crashes a batch. A :class:`~shim.guard.RolloutGuard` counts them
and stops the run when too many fail.

Every method below except the constructor runs on the loop thread.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from harbor_async.errors import (
    EngineClosedError,
    EpisodeDeadlineError,
    FailureClass,
    Phase,
    SandboxClosedError,
    SandboxError,
    SandboxTimeout,
    StartError,
    failure_class,
)
from harbor_async.logs import get_logger
from shim import prefetch

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.engine import Engine
    from harbor_async.sandbox import Sandbox
    from shim.guard import RolloutGuard

log = get_logger("harbor_async.shim")

#: The episode whose harness setup is running in the current task: lets
#: ``HarborEnv._env`` inside ``_setup()`` mean that episode's sandbox even if the
#: trainer has already called ``reset()`` again (context variables are per task).
PREPARING: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("shim_preparing", default=None)

#: Commands TRL's env runs after every start, before the harness setup.
BASE_SETUP_COMMAND = "mkdir -p /workdir /home/user/input"


class Episode:
    """The state of one ``reset()``: the task, its sandbox, the setup outcome and the reward.

    Attributes:
        task: the Harbor task.
        sandbox: the engine's sandbox (``None`` until :meth:`run` launched it).
        error: why no command can run in this episode (a start or setup
            failure, or the episode was closed first); ``None`` when ready.
        reward: the verifier's reward, once verified (then cached); ``None``
            when the infrastructure failed (the rollout is left out of training).
        reward_error: why there is no verdict (failed start, setup or verifier), if so.
        failure: the class of that failure (infrastructure, verifier, agent, cancelled).
        tool_seconds: seconds this rollout's commands took, summed.
    """

    def __init__(
        self,
        task: Task,
        engine: Engine,
        backend: BackendSpec,
        backend_kwargs: dict[str, Any],
        guard: RolloutGuard | None = None,
    ) -> None:
        self.task = task
        self.engine = engine
        self.backend = backend
        self.backend_kwargs = backend_kwargs
        self.sandbox: Sandbox | None = None
        self.error: BaseException | None = None
        self.reward: float | None = None
        self.reward_error: BaseException | None = None
        self.failure: FailureClass | None = None
        self.tool_seconds = 0.0
        #: The rollout's tool-time budget: the task's ``[agent] timeout_sec`` (or the option), multiplied.
        self.agent_budget: float | None = engine.timeouts.for_task(task).agent
        self.guard = guard
        self._counted = False  # counted by the guard as awaiting its batch reward
        self._verified = False
        #: Commands the sandbox could not run (not a failing command): evaluation blames the infrastructure.
        self.exec_errors: list[SandboxError] = []
        self.owner: Any = None  # a weak reference to the env, for PREPARING lookups
        self._retired = False
        self._launched = False
        self._ready: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._verify_lock: anyio.Lock | None = None

    # ── state readable from any thread ───────────────────────────────────

    def count_rollout(self) -> None:
        """Have the guard count this rollout as awaiting its batch reward (on the caller's thread).

        Raises :class:`~harbor_async.errors.SandboxLimitError` when the limit is below what is needed.
        """
        if self.guard is not None:
            self.guard.open_rollout()
            self._counted = True

    def uncount_rollout(self) -> None:
        """The rollout no longer awaits a reward (scored or abandoned); idempotent, any thread."""
        if self._counted and self.guard is not None:
            self._counted = False
            self.guard.close_rollout()

    @property
    def verified(self) -> bool:
        """Whether the reward (or its absence) is settled."""
        return self._verified

    @property
    def finished(self) -> bool:
        """Whether nothing of this episode is left to stop (read from any thread)."""
        if self.sandbox is not None:
            return self.sandbox.done
        return self._retired

    # ── loop side ────────────────────────────────────────────────────────

    def _ready_event(self) -> anyio.Event:
        # Created on first use on the loop: an anyio Event needs the running loop.
        if self._ready is None:
            self._ready = anyio.Event()
        return self._ready

    async def run(
        self,
        previous: Episode | None,
        prepare: Callable[[Episode], Awaitable[None]],
    ) -> None:
        """Retire the previous episode, launch the sandbox (or claim one started ahead), wait for it, run the setup.

        Submitted by ``reset()``; never raises: a failure is kept in :attr:`error`.
        """
        ready = self._ready_event()
        try:
            if previous is not None:
                previous.retire()
            if self._retired:  # closed before the loop got here
                self.error = SandboxClosedError(Phase.START, self.task.name, "-", "the episode was closed")
                return
            try:
                # No await before the claim: prefetch.release() relies on every reset handed to the loop
                # before it having claimed by then.
                self.sandbox = prefetch.claim(self.engine, self.task, self.backend, self.backend_kwargs)
                if self.sandbox is None:
                    self.sandbox = self.engine.launch(self.task, self.backend, backend_kwargs=self.backend_kwargs)
            except Exception as exc:  # noqa: BLE001 - bad backend, closed engine: the start never began
                self.error = exc
                log.warning("sandbox launch failed", task=self.task.name, error=str(exc))
                return
            self._launched = True
            with anyio.CancelScope() as self._scope:
                try:
                    try:
                        await self.sandbox.wait_started()
                    except SandboxError as exc:
                        if self.guard is not None and failure_class(exc) is FailureClass.INFRASTRUCTURE:
                            self.guard.record_start(exc)
                        raise
                    if self.guard is not None:
                        self.guard.record_start(None)
                    token = PREPARING.set(self)
                    try:
                        # TRL counts its setup steps as part of the start: same budget.
                        with anyio.fail_after(self.engine.timeouts.start):
                            await prepare(self)
                    finally:
                        PREPARING.reset(token)
                except Exception as exc:  # noqa: BLE001 - any setup failure only ends this episode
                    self.error = exc
                    # The harness's own code failing is the agent's failure; a sandbox error is not.
                    self.failure = failure_class(exc) if isinstance(exc, SandboxError) else FailureClass.AGENT
                    if not isinstance(exc, SandboxError):
                        log.warning("harness setup failed", task=self.task.name, error=repr(exc))
                    # An unusable sandbox gives its slot back now, not at the reward.
                    self._stop_soon()
            if self._scope.cancelled_caught and self.error is None:
                self.error = SandboxClosedError(
                    Phase.START, self.task.name, self.sandbox.id, "the episode ended before its sandbox was ready"
                )
        finally:
            ready.set()

    async def wait_ready(self) -> None:
        """Wait until :meth:`run` has finished (the sandbox is prepared, or failed)."""
        await self._ready_event().wait()

    def retire(self) -> None:
        """End the episode: cancel a start or setup in progress, stop the sandbox in the background."""
        self._retired = True
        self.uncount_rollout()
        if self._scope is not None:
            self._scope.cancel()
        self._stop_soon()

    def _stop_soon(self) -> None:
        if self.sandbox is None:
            return
        try:
            self.engine.stop_soon(self.sandbox)
        except EngineClosedError:
            pass  # the engine's own close stops (or stopped) every sandbox it holds

    async def stop(self) -> None:
        """Retire the episode and wait until its sandbox is stopped (shielded, bounded by the stop budget)."""
        self.retire()
        if self.sandbox is not None:
            await self.sandbox.stop()

    async def exec(self, command: str, timeout: float | None) -> str:
        """Run a tool command; return TRL's output string, or an error message for the model.

        Inside the harness setup (``_setup`` awaiting ``_aexec``) the command runs
        at once: waiting for the setup to finish would wait for itself.
        """
        if PREPARING.get() is not self:
            await self.wait_ready()
        if self.error is not None:
            return describe_unavailable(self.error)
        assert self.sandbox is not None
        if self.agent_budget is not None:  # TRL cannot end a rollout: later calls read the limit
            left = self.agent_budget - self.tool_seconds
            if left <= 0:
                return (
                    f"Error: this task's time limit for the agent ({_seconds(self.agent_budget)}) was reached; "
                    "no more commands run in this episode."
                )
            agent_limited = timeout is None or left < timeout
            timeout = left if agent_limited else timeout
        else:
            agent_limited = False
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

    async def verify(self) -> float | None:
        """The verifier's reward, computed once; the sandbox is stopped in the background right after.

        Never raises. A verifier that gave no valid reward, or an agent that ran
        out of time, scores 0.0 (the model's episode); a start, setup or
        infrastructure failure gives ``None`` (no verdict: TRL leaves the rollout
        out of its group statistics). The cause is kept in :attr:`reward_error`
        and its class in :attr:`failure`.
        """
        if self._verified:
            return self.reward
        if self._verify_lock is None:
            self._verify_lock = anyio.Lock()
        async with self._verify_lock:  # concurrent readers share one verification
            if self._verified:
                return self.reward
            await self.wait_ready()
            error = self.error
            reward: float | None = None
            if error is None:
                assert self.sandbox is not None
                try:
                    reward = (await self.sandbox.verify()).reward
                except SandboxError as exc:
                    error = exc
            if error is not None:
                self.reward_error = error
                self.failure = self.failure if error is self.error and self.failure else failure_class(error)
                reward = None if self.failure.rerun else 0.0
                log.warning(
                    "no verdict for a rollout", task=self.task.name, failure=self.failure.value, reward=reward,
                    error=str(error),
                )  # fmt: skip
            self.reward, self._verified = reward, True
            self.uncount_rollout()
            self._stop_soon()
            return reward


async def verify_episodes(episodes: Sequence[Episode]) -> list[float | None]:
    """Verify every episode concurrently (one loop call for a whole batch); rewards in order."""
    rewards: list[float | None] = [None] * len(episodes)

    async def one(index: int, episode: Episode) -> None:
        rewards[index] = await episode.verify()

    async with anyio.create_task_group() as tg:
        for index, episode in enumerate(episodes):
            tg.start_soon(one, index, episode)
    return rewards


async def stop_episodes(episodes: Sequence[Episode]) -> None:
    """Stop every episode's sandbox concurrently and wait for all of them."""
    async with anyio.create_task_group() as tg:
        for episode in episodes:
            tg.start_soon(episode.stop)


def retire_episodes(episodes: Sequence[Episode]) -> None:
    """Schedule every episode's stop without waiting (for finalizers)."""
    for episode in episodes:
        episode.retire()


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
