"""One rollout of one env: the core :class:`~harbor_async.episode.Episode`, driven one call at a time from TRL.

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

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import sniffio

from harbor_async import episode as core
from harbor_async.errors import (
    EngineClosedError,
    EpisodeClosedError,
    FailureClass,
    LaunchError,
    Phase,
    SandboxError,
)
from harbor_async.logs import get_logger
from harbor_async.policy import is_infrastructure
from shim import engines, prefetch

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.engine import Engine
    from shim.guard import RolloutGuard

log = get_logger("harbor_async.shim")

T = TypeVar("T")

#: The episode whose harness setup is running in the current task: lets
#: ``HarborEnv._env`` inside ``_setup()`` mean that episode's sandbox even if the
#: trainer has already called ``reset()`` again (context variables are per task).
PREPARING: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("shim_preparing", default=None)

__all__ = ["PREPARING", "Episode", "await_loop"]


class Episode(core.Episode):
    """The state of one ``reset()``: the core episode plus TRL's ways of driving it.

    Attributes (besides the core episode's):
        reward: the reward, once verified (then cached); ``None`` when the
            infrastructure failed (the rollout is left out of training).
        reward_error: why there is no verdict (failed start, setup or verifier), if so.
        failure: the class of the episode's failure, if any.
    """

    def __init__(
        self,
        task: Task,
        engine: Engine,
        backend: BackendSpec,
        backend_kwargs: dict[str, Any],
        guard: RolloutGuard | None = None,
        *,
        agent: str = "",
        on_done: Callable[[core.EpisodeRecord], None] | None = None,
    ) -> None:
        super().__init__(engine, task, backend, backend_kwargs=backend_kwargs, agent=agent, on_done=on_done)
        self.reward: float | None = None
        self.guard = guard
        self._counted = False  # counted by the guard as awaiting its batch reward
        self._verified = False
        self.owner: Any = None  # a weak reference to the env, for PREPARING lookups
        self._retired = False
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

    @property
    def failure(self) -> FailureClass | None:
        """The class of the episode's failure, if any."""
        return self.record.failure

    @property
    def reward_error(self) -> BaseException | None:
        """Why the rollout has no verdict of the verifier's, if so."""
        return self.error or self.verify_error

    # ── how a harness reaches the loop from TRL's threads ────────────────

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the shim's loop thread from any other thread and wait."""
        return engines.call(fn, *args)

    async def call_async(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` on the shim's loop from any event loop (TRL's async tools) or on it."""
        if engines.in_loop_thread():
            return await fn(*args)
        return await await_loop(engines.submit(fn, *args))

    # ── loop side ────────────────────────────────────────────────────────

    def _ready_event(self) -> anyio.Event:
        # Created on first use on the loop: an anyio Event needs the running loop.
        if self._ready is None:
            self._ready = anyio.Event()
        return self._ready

    async def run(self, previous: Episode | None, prepare: Callable[[Episode], Awaitable[None]]) -> None:
        """Retire the previous episode, launch the sandbox (or claim one started ahead), wait for it, run the setup.

        Submitted by ``reset()``; never raises: a failure is kept in :attr:`error`.
        """
        ready = self._ready_event()
        try:
            if previous is not None:
                previous.retire()
            if self._retired:  # closed before the loop got here
                self.error = EpisodeClosedError(Phase.START, self.task.name, "-", "the episode was closed")
                self.fail_with(self.error)
                return
            try:
                # No await before the claim: prefetch.release() relies on every reset handed to the loop
                # before it having claimed by then.
                self.launch(prefetch.claim(self.engine, self.task, self.backend, self.backend_kwargs))
            except Exception as exc:  # noqa: BLE001 - bad backend, closed engine: the start never began
                self.error = exc
                self.fail_with(_launch_error(exc), Phase.START)
                log.warning("sandbox launch failed", task=self.task.name, error=str(exc))
                return

            async def setup() -> None:
                token = PREPARING.set(self)
                try:
                    await prepare(self)
                finally:
                    PREPARING.reset(token)

            with anyio.CancelScope() as self._scope:
                if not await self.start(setup):
                    self._stop_soon()  # an unusable sandbox gives its slot back now, not at the reward
            if self._scope.cancelled_caught and self.error is None:
                self.error = EpisodeClosedError(
                    Phase.START, self.task.name, self.record.sandbox or "-", "the episode ended before its sandbox was ready"
                )
                self.fail_with(self.error)
        finally:
            ready.set()

    def _started(self, error: SandboxError | None) -> None:
        if self.guard is not None and (error is None or is_infrastructure(error)):
            self.guard.record_start(error)

    async def wait_ready(self) -> None:
        """Wait until :meth:`run` has finished (the sandbox is prepared, or failed)."""
        await self._ready_event().wait()

    def retire(self) -> None:
        """End the episode: cancel a start or setup in progress, stop the sandbox in the background."""
        self._retired = True
        self.uncount_rollout()
        if not self._verified and self.record.failure is None:  # no verdict: said now, before the stop writes the record
            self.interrupted()
        if self._scope is not None:
            self._scope.cancel()
        self._stop_soon()

    def _stop_soon(self) -> None:
        # The core's stop, also with no sandbox (a launch that failed): it finishes the record and hands it to
        # its sink. A background stop must not retire (and uncount) an episode awaiting its reward.
        try:
            self.engine.start_soon(core.Episode.stop, self, name=f"stop episode {self.record.sandbox or self.task.name}")
        except EngineClosedError:
            self.finish()  # the engine's own close stops (or stopped) every sandbox it holds
            self.hand_over()

    async def stop(self) -> core.EpisodeRecord:
        """Retire the episode and wait until its sandbox is stopped (shielded, bounded by the stop budget)."""
        if not self._retired:
            self.retire()
        return await super().stop()

    async def exec_text(self, command: str, timeout: float | None) -> str:
        """A tool command, once the sandbox is prepared (see :meth:`core.Episode.exec_text`).

        Inside the harness setup (``_setup`` awaiting ``_aexec``) the command runs
        at once: waiting for the setup to finish would wait for itself.
        """
        if PREPARING.get() is not self:
            await self.wait_ready()
        return await super().exec_text(command, timeout)

    async def verify(self) -> float | None:
        """The verifier's reward, computed once; the sandbox is stopped in the background right after.

        Never raises. A verifier that gave no valid reward, or an agent that ran
        out of time, scores 0.0 (the model's episode); a start, setup or
        infrastructure failure gives ``None`` (no verdict: TRL leaves the rollout
        out of its group statistics).
        """
        if self._verified:
            return self.reward
        if self._verify_lock is None:
            self._verify_lock = anyio.Lock()
        async with self._verify_lock:  # concurrent readers share one verification
            if self._verified:
                return self.reward
            await self.wait_ready()
            reward = await super().verify()
            if self.reward_error is not None:
                log.warning(
                    "no verdict for a rollout", task=self.task.name, failure=self.record.error_class, reward=reward,
                    error=self.record.error,
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


async def await_loop(future: Any) -> Any:
    """Await a loop-thread future from another event loop without blocking it."""
    if sniffio.current_async_library() == "asyncio":
        # Cancelling the awaiting task cancels the future, hence the work on the loop thread.
        return await asyncio.wrap_future(future)
    return await anyio.to_thread.run_sync(future.result)


def _launch_error(exc: BaseException) -> LaunchError:
    """The typed error of a sandbox whose start could not be scheduled (a bad backend, a closed engine), from ``exc``."""
    error = LaunchError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    error.__cause__ = exc
    return error
