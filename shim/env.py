"""``HarborEnv`` and ``HarborBashEnv``: TRL's environment API, run on the shared engine.

Drop-in for ``trl.experimental.harbor.HarborEnv``: same constructor argument,
``reset``, ``reward``, ``_exec``, ``_setup`` and ``PROMPT_SUFFIX``, same prompt
and tool-output text. What changes is where the work happens:

- ``reset()`` returns the instruction at once. It reads the task from disk and
  hands the previous sandbox's stop and the new sandbox's start (plus TRL's
  setup steps and the harness ``_setup()``) to the loop thread, without
  waiting. The first tool call waits for them. A batch of resets made one after
  another therefore starts all its sandboxes at once.
- Tool calls work from any thread, with a per-call timeout; a start failure or
  a timeout comes back as an error message the model reads, not an exception.
- ``close()`` stops the env's sandboxes and waits for them. It is not a tool:
  TRL lists every public *function* of the class as a tool, and ``close`` is a
  descriptor (see :class:`not_a_tool`).

TRL discovers tools with ``inspect.getmembers(type(env), inspect.isfunction)``,
skipping ``reset``, ``get_reward`` and names starting with ``_``; each tool
needs type hints and a Google-style docstring with an ``Args:`` section.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar, Unpack

from harbor_async.agents.task_checks import TRL, UnsupportedTaskError, driver_refusals
from harbor_async.backends import resolve_backend
from harbor_async.engine.loop import await_future
from harbor_async.harnesses.base import BACKENDS_DROPPING_COPY, Harness
from harbor_async.harnesses.bash import BashHarness
from shim import engines, prefetch
from shim.episode import (
    begin_rollout,
    new_episode,
    retire,
    retire_episodes,
    settle,
    stop_episodes,
    uncount,
)
from shim.options import EngineOptions, EngineOptionsKwargs, renamed_kwargs
from shim.task_cache import load_task_cached

if TYPE_CHECKING:
    from harbor_async.core.records import EpisodeRecord
    from harbor_async.episodes.episode import Episode

R = TypeVar("R")

#: The env (weakly: tasks spawned meanwhile keep a copy of the context) and the episode whose harness setup runs
#: in the current task: ``self._env`` inside ``_setup()`` means that episode's sandbox even if the trainer has
#: already called ``reset()`` again (context variables are per task).
PREPARING: contextvars.ContextVar[tuple[weakref.ref[HarborEnv], Episode] | None] = contextvars.ContextVar(
    "shim_preparing", default=None
)

__all__ = ["AGENTS", "BACKENDS_DROPPING_COPY", "HarborBashEnv", "HarborEnv", "not_a_tool"]


class not_a_tool(Generic[R]):
    """A method that TRL does not expose as a tool.

    TRL turns every public *function* of an env class into a tool (1.15+),
    or every public *bound method* of an instance (1.7 to 1.14).
    ``functools.partialmethod`` does not help (on Python 3.12 it returns a
    plain function when read from the class); this descriptor returns itself
    from the class and a ``functools.partial`` (no bound method) from an
    instance, so neither ``inspect.isfunction(type(env).close)`` nor
    ``inspect.ismethod(env.close)`` holds, and ``env.close()`` works.
    """

    def __init__(self, func: Callable[..., R]) -> None:
        self.__func__ = func
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __get__(self, instance: object | None, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self.__func__, instance)


class HarborEnv(Harness):
    """Base TRL environment backed by a Harbor sandbox + verifier, run on the shared engine.

    A :class:`~harbor_async.harnesses.Harness` whose current episode is the
    rollout TRL last reset. Subclasses define the tool methods. The lifecycle TRL drives
    per rollout: ``reset(task_dir)`` (schedule the task's sandbox, return its
    instruction) -> tool methods (exec into the sandbox) -> ``reward`` (run the
    verifier once, lazily, after the rollout).

    Args:
        environment_type: the backend: a Harbor type (``"docker"``, ``"e2b"``,
            ``"daytona"``, ...), this project's ``"local"`` (bubblewrap) or
            ``"simulated"``, or an import path ``"package.module:Class"`` of a
            Harbor ``BaseEnvironment``. A name that cannot be loaded raises
            :class:`~harbor_async.core.errors.BackendError` (a ``ValueError``) here.
        environment_kwargs: extra constructor arguments for every Harbor
            environment this env creates (Harbor's ``--ek``).
        **engine_options: limits, timeouts and retries; see
            :class:`~shim.options.EngineOptions`. Envs with equal options share
            one engine, so limits hold across the batch.
    """

    #: Extra guidance appended to the task instruction by the harness subclass.
    PROMPT_SUFFIX: str = ""

    def __init__(
        self,
        environment_type: str = "docker",
        *,
        environment_kwargs: Mapping[str, Any] | None = None,
        backend_kwargs: Mapping[str, Any] | None = None,
        **engine_options: Unpack[EngineOptionsKwargs],
    ) -> None:
        self._environment_type = environment_type
        self._backend = resolve_backend(environment_type)
        self._options = EngineOptions.from_kwargs(dict(engine_options))
        self._backend_kwargs: dict[str, Any] = dict(renamed_kwargs(environment_kwargs, backend_kwargs) or {})
        # Import the backend class and check its options now (no sandbox starts): a
        # typo or a missing vendor SDK fails at construction, not in the middle of a batch.
        self._backend.check_options(self._backend_kwargs)
        self._episode: Episode | None = None
        self._record: EpisodeRecord | None = None
        # Episodes whose sandbox may still be alive; shared with the finalizer,
        # which must not hold the env itself.
        self._episodes: list[Episode] = []
        self._state_lock = threading.Lock()
        engines.prepare_exit_handlers()
        self._finalizer = weakref.finalize(self, _abandon, self._episodes)
        # At exit the loop module stops every engine's sandboxes; a finalizer
        # running then could only race it.
        self._finalizer.atexit = False

    def _configure(self, options: EngineOptions, backend_kwargs: Mapping[str, Any]) -> None:
        """Apply engine options after construction (the spec's factory uses this).

        TRL-style harness subclasses often define ``__init__(self,
        environment_type="docker")`` only, so the factory cannot pass the
        options to the constructor.
        """
        self._backend.check_options(backend_kwargs)
        self._options = options
        self._backend_kwargs = dict(backend_kwargs)

    # ── TRL's API ────────────────────────────────────────────────────────

    def reset(self, task_dir: str | None = None, **kwargs: Any) -> str:
        """Start a rollout on ``task_dir`` and return its instruction + ``PROMPT_SUFFIX`` at once.

        The previous sandbox is stopped and the new one started in the
        background; the first tool call (or the reward) waits for the start.
        Other keyword arguments (the dataset row's columns) are ignored, as in TRL.

        Raises:
            ValueError: no ``task_dir``; or
                :class:`~harbor_async.tasks.suite.TaskLoadError` (a ``ValueError``)
                when the folder is missing or not a valid Harbor task. The
                previous sandbox is stopped either way.
        """
        if task_dir is None:
            raise ValueError("HarborEnv.reset requires `task_dir` (provided by the dataset row).")
        guard = engines.guard_for(self._options)
        with self._state_lock:
            previous, self._episode = self._episode, None
            self._episodes[:] = [e for e in self._episodes if not e.finished]
        if previous is not None:
            uncount(previous)  # now, not when the loop retires it: the count must be exact here
        try:
            guard.check()  # too many infrastructure failures: stop the trainer, do not train on zeros
            task = load_task_cached(task_dir)
            if refusals := driver_refusals(task, TRL):  # a task from outside HarborSpec's checked suite
                raise UnsupportedTaskError(refusals, self._backend.name)
            engine = engines.engine_for(self._options)
            episode = new_episode(
                task, engine, self._backend, self._backend_kwargs, guard, agent=self._name(),
                on_done=engines.record_sink(self._options),
            )  # fmt: skip
            if not self._owns_reward():
                guard.open_rollout(episode)
        except BaseException:
            if previous is not None:
                engines.submit(retire, previous)
            raise
        with self._state_lock:
            self._episode, self._record = episode, episode.record
            self._episodes.append(episode)
        future = engines.submit(begin_rollout, episode, previous, self._prepare_rollout)
        future.add_done_callback(_report_unexpected)
        return task.instruction + self.PROMPT_SUFFIX

    def _owns_reward(self) -> bool:
        # An env-owned reward (AsyncGRPOTrainer) frees each sandbox as its rollout ends: no batch to wait for.
        return callable(getattr(type(self), "get_reward", None))

    @property
    def reward(self) -> float | None:
        """The verifier's reward for the current rollout (verified once, lazily, then cached).

        A fresh env that was never reset reads 0.0 without touching any backend
        (or even starting the loop thread). A verifier that gave no valid reward
        reads 0.0 (the model's episode); a sandbox that failed for infrastructure
        reasons reads ``None``: there is no verdict, and TRL leaves the rollout
        out of its group statistics. Verifying stops the sandbox in the
        background. ``spec.reward_funcs`` verifies a whole batch at once.
        """
        episode = self._episode
        if episode is None:
            return 0.0
        if episode.verified:
            return episode.reward
        return engines.call(settle, episode)

    @property
    def infrastructure_failure(self) -> bool:
        """Whether the current rollout was left without a verdict for infrastructure reasons."""
        episode = self._episode
        return episode is not None and episode.verified and episode.reward is None

    async def _areward(self) -> float | None:
        """:attr:`reward` for async callers (the env-owned ``get_reward`` path)."""
        episode = self._episode
        if episode is None:
            return 0.0
        if episode.verified:
            return episode.reward
        if engines.in_loop_thread():
            return await settle(episode)
        return await await_future(engines.submit(settle, episode))

    # ── teardown ─────────────────────────────────────────────────────────

    def _close(self) -> None:
        """Stop every sandbox of this env and wait for the stops (idempotent).

        Bounded by the stop budget (twice ``stop_timeout`` when a start has to
        be cancelled first). The env stays usable: a later ``reset`` starts a
        new sandbox.
        """
        episodes = self._detach_episodes()
        if episodes and engines.loop_running():
            engines.call(stop_episodes, episodes, timeout=_close_budget(self._options))

    close = not_a_tool(_close)

    def _detach_episodes(self) -> list[Episode]:
        """Take every episode with a possibly live sandbox; the env forgets them."""
        with self._state_lock:
            episodes = list(self._episodes)
            self._episodes.clear()
            self._episode = None
        return episodes

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close()

    # ── harness helpers ──────────────────────────────────────────────────

    @property
    def episode_record(self) -> EpisodeRecord | None:
        """The current rollout's record (phases, reward, failure), as ``run`` and ``eval`` write them.

        Complete once the rollout's sandbox is stopped (after ``close()``, or
        in the background after the reward); the same object fills in.
        """
        episode = self._episode
        return None if episode is None else episode.record

    @property
    def record(self) -> EpisodeRecord | None:
        """The latest rollout's record, as ``run`` and ``eval`` write theirs (kept after ``close()``).

        Final once the rollout's sandbox is stopped (after ``close()``, or in
        the background after the reward); the same object fills in, and then
        goes to the ``job_dir`` folder when one is set.
        """
        return self._record

    @property
    def sandbox_error(self) -> str | None:
        """Why the current rollout's sandbox cannot run commands or was scored 0.0 without a verdict."""
        episode = self._episode
        if episode is None:
            return None
        error = episode.error or episode.reward_error
        return None if error is None else f"{type(error).__name__}: {error}"

    def _current(self) -> Episode | None:
        if self._session is not None:  # bound to an evaluation's episode (see harbor_async.agents.harness_agent)
            return self._session
        preparing = PREPARING.get()
        if preparing is not None and preparing[0]() is self:
            return preparing[1]
        return self._episode

    def _timeout(self, timeout: float | None) -> float | None:
        return self._options.exec_timeout if timeout is None else float(timeout)

    async def _prepare_rollout(self, episode: Episode) -> None:
        """The harness's preparation of ``episode``'s sandbox (on the loop; ``episode`` is current through PREPARING).

        A sandbox started ahead (prefetch) has had TRL's base step already:
        only the harness's ``_setup`` is left, unless the harness replaced
        ``_prepare`` itself (then it runs whole, as it asks).
        """
        token = PREPARING.set((weakref.ref(self), episode))
        try:
            if type(self)._prepare is Harness._prepare and await prefetch.base_prepared(episode.sandbox):
                await self._setup()
            else:
                await self._prepare()
        finally:
            PREPARING.reset(token)

    def __repr__(self) -> str:
        episode = self._episode
        task = episode.task.name if episode is not None else None
        return f"<{type(self).__name__} backend={self._environment_type!r} task={task!r}>"


class HarborBashEnv(BashHarness, HarborEnv):
    """Single-`bash`-tool harness; submit by writing `/workdir/answer.txt`."""


#: Built-in harnesses, selectable by name in ``HarborSpec(agent=...)``.
AGENTS: dict[str, type[HarborEnv]] = {"bash": HarborBashEnv}


# ── helpers ─────────────────────────────────────────────────────────────

def _close_budget(options: EngineOptions) -> float | None:
    # A stop may first cancel a start, whose cleanup has its own stop budget.
    return None if options.stop_timeout is None else 2 * options.stop_timeout + 10


def _abandon(episodes: list[Episode]) -> None:
    """Finalizer of a garbage-collected env: schedule its stops, never wait (TRL's env hangs here)."""
    if not episodes:
        return
    pending = list(episodes)
    try:
        if not engines.loop_running():
            return
        if engines.in_loop_thread():
            retire_episodes(pending)
        else:
            engines.submit(retire_episodes, pending)
    except Exception:  # noqa: BLE001, S110 - a finalizer must never raise; the exit handler stops what is left
        pass


def _report_unexpected(future: Any) -> None:
    # Episode.run keeps every failure as a value; anything raised here is a bug worth seeing.
    if not future.cancelled() and future.exception() is not None:
        from harbor_async.core.logs import get_logger

        get_logger("harbor_async.shim").error("episode task crashed", error=repr(future.exception()))
