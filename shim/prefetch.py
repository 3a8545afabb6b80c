"""Sandboxes started ahead of their ``reset()``: the next GRPO step's starts hidden behind this step's update.

``HarborGRPOTrainer(prefetch=True)`` knows the next step's dataset rows (see
:mod:`shim.lookahead`); once the current step is scored, it hands their tasks
to :func:`prefetch`, which launches one sandbox per row on the
env's engine and parks it in that engine's :class:`PrefetchPool`. The next
``reset()`` on the same task, backend and backend arguments claims a parked
sandbox instead of launching one (:func:`claim`); the harness setup
(``_setup``) still runs per ``reset``, on the env that claimed it. TRL's base
step (the ``mkdir`` of its folders, which needs no env) runs ahead too, right
after the start (:func:`base_prepared`): the first tool round would otherwise
wait one exec round trip for it. Once the next step's resets are in,
:func:`release` stops what no reset claimed, so a wrong guess costs a start
and never holds a slot that a real rollout waits for.

A parked sandbox is an ordinary engine sandbox: it takes a live-sandbox slot
(queued behind the limit like any start), the engine's close stops it, and
its episode deadline is counted again from the claim.

The pools live on the loop thread and are touched only there; :func:`prefetch`,
:func:`release` and :func:`parked_count` hand their work to it.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from harbor_async.core.errors import EngineClosedError
from harbor_async.core.logs import get_logger
from harbor_async.engine.sandbox import SandboxState
from harbor_async.harnesses.base import BACKENDS_DROPPING_COPY, BASE_SETUP_COMMAND
from shim import engines
from shim.task_cache import load_task_cached

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.engine.engine import Engine
    from harbor_async.engine.sandbox import Sandbox
    from shim.options import EngineOptions

log = get_logger("harbor_async.shim")

#: States in which a parked sandbox can still serve a rollout.
_USABLE = frozenset({SandboxState.PENDING, SandboxState.STARTING, SandboxState.RUNNING})

_Key = tuple[str, str, str]


@dataclass
class PrefetchCounts:
    """What became of the sandboxes started ahead since the pool was last released."""

    #: Resets that claimed one.
    hits: int = 0
    #: Sandboxes stopped unclaimed (wrong guess, or their start had failed).
    unused: int = 0


def _key(task: Task, backend: BackendSpec, backend_kwargs: Mapping[str, Any]) -> _Key:
    # The folder as the task cache spells it (relative and absolute spellings meet);
    # repr: backend arguments may hold unhashable values; equal arguments print equal.
    return (
        str(Path(task.paths.task_dir).expanduser().absolute()),
        backend.name,
        repr(sorted(backend_kwargs.items())),
    )


class _BaseSetup:
    """TRL's base step run on a sandbox started ahead, once it is up (loop thread): whether it ran."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._ok = False

    async def run(self, sandbox: Sandbox) -> None:
        try:
            await sandbox.wait_started()
            await sandbox.exec(BASE_SETUP_COMMAND)  # as Harness._prepare: a non-zero exit is not checked there either
            self._ok = True
        except Exception as exc:  # noqa: BLE001 - the claiming reset runs the step itself and reports
            log.debug("base setup ahead failed", sandbox=sandbox.id, error=repr(exc))
        finally:
            self._done.set()

    async def succeeded(self) -> bool:
        await self._done.wait()
        return self._ok


#: Sandboxes started ahead whose base step was scheduled with them; weak: an entry goes with its sandbox.
_base_setups: weakref.WeakKeyDictionary[Sandbox, _BaseSetup] = weakref.WeakKeyDictionary()


async def base_prepared(sandbox: Sandbox | None) -> bool:
    """Whether TRL's base step already ran on ``sandbox`` (started ahead); waits for it if it is running.

    Consumed: a second call for the same sandbox says ``False``, so the step
    is never skipped twice. ``False`` when it failed or was never run ahead:
    the caller then runs it as usual.
    """
    setup = None if sandbox is None else _base_setups.pop(sandbox, None)
    return setup is not None and await setup.succeeded()


class PrefetchPool:
    """One engine's sandboxes started ahead, by task, backend and backend arguments (loop thread only)."""

    def __init__(self, engine: Engine) -> None:
        # Weak: the pools are kept by engine, and a pool must not keep its engine alive.
        self._engine = weakref.ref(engine)
        self._parked: dict[_Key, deque[Sandbox]] = {}
        self.counts = PrefetchCounts()

    def start(self, task: Task, backend: BackendSpec, backend_kwargs: Mapping[str, Any]) -> None:
        """Launch a sandbox for ``task`` and park it.

        Raises:
            EngineClosedError: the engine is closed (or gone).
        """
        engine = self._engine()
        if engine is None:
            raise EngineClosedError("the engine of this prefetch pool is gone")
        sandbox = engine.launch(task, backend, backend_kwargs=backend_kwargs)
        if backend.type not in BACKENDS_DROPPING_COPY:  # there TRL uploads files first, from the env: not ahead
            setup = _base_setups[sandbox] = _BaseSetup()
            engine.start_soon(setup.run, sandbox, name=f"base setup {sandbox.id}")
        self._parked.setdefault(_key(task, backend, backend_kwargs), deque()).append(sandbox)

    def claim(self, task: Task, backend: BackendSpec, backend_kwargs: Mapping[str, Any]) -> Sandbox | None:
        """A parked sandbox for this very task whose start has not failed (oldest first), or ``None``.

        A sandbox started from an earlier version of the task's files (the
        task cache reloaded it since) is stopped, not handed out.
        """
        key = _key(task, backend, backend_kwargs)
        parked = self._parked.get(key)
        while parked:
            sandbox = parked.popleft()
            if sandbox.task is task and sandbox.state in _USABLE and not sandbox.done:
                if not parked:
                    del self._parked[key]
                sandbox.renew_deadline()
                self.counts.hits += 1
                return sandbox
            self._stop(sandbox)  # its start failed or its task changed: a fresh launch, as for any reset
        self._parked.pop(key, None)
        return None

    def release(self) -> PrefetchCounts:
        """Stop every unclaimed sandbox; return the counts since the last release and reset them."""
        for parked in self._parked.values():
            for sandbox in parked:
                self._stop(sandbox)
        self._parked.clear()
        counts, self.counts = self.counts, PrefetchCounts()
        return counts

    @property
    def parked(self) -> int:
        """Sandboxes waiting for a reset."""
        return sum(len(p) for p in self._parked.values())

    def _stop(self, sandbox: Sandbox) -> None:
        self.counts.unused += 1
        engine = self._engine()
        if engine is None:
            return  # gone with its engine, which stopped every sandbox it held
        try:
            engine.stop_soon(sandbox)
        except EngineClosedError:
            pass  # a closed engine stopped (or stops) every sandbox it holds


_pools: weakref.WeakKeyDictionary[Engine, PrefetchPool] = weakref.WeakKeyDictionary()


def pool_for(engine: Engine) -> PrefetchPool:
    """The engine's pool (made on first use; loop thread)."""
    pool = _pools.get(engine)
    if pool is None:
        pool = _pools[engine] = PrefetchPool(engine)
    return pool


def claim(engine: Engine, task: Task, backend: BackendSpec, backend_kwargs: Mapping[str, Any]) -> Sandbox | None:
    """A sandbox started ahead for this task on ``engine``, or ``None`` (loop thread; cheap when nothing is parked)."""
    pool = _pools.get(engine)
    return None if pool is None else pool.claim(task, backend, backend_kwargs)


class EnvSettings(Protocol):
    """What a prefetch reads of a shim ``HarborEnv`` (typed here: importing ``shim.env`` would be a cycle)."""

    _options: EngineOptions
    _backend: BackendSpec
    _backend_kwargs: Mapping[str, Any]


def prefetch(env: EnvSettings, task_dirs: Iterable[str]) -> int:
    """Start one sandbox per task folder, ahead of its reset, as ``env`` (a shim ``HarborEnv``) would.

    The sandboxes take ``env``'s engine options, backend and Harbor ``--ek``
    arguments: a reset claims only a sandbox started with its own.

    Returns at once with the number of sandboxes scheduled; the starts run on
    the loop thread. A folder that is not a valid task is skipped (its reset
    will report it).
    """
    tasks = []
    for task_dir in task_dirs:
        try:
            tasks.append(load_task_cached(task_dir))
        except (OSError, ValueError) as exc:
            log.debug("prefetch skipped a task", task_dir=str(task_dir), error=str(exc))
    if not tasks:
        return 0
    engine = engines.engine_for(env._options)
    backend, backend_kwargs = env._backend, dict(env._backend_kwargs)

    def start_all() -> None:
        pool = pool_for(engine)
        for task in tasks:
            try:
                pool.start(task, backend, backend_kwargs)
            except EngineClosedError:
                return
            except Exception as exc:  # noqa: BLE001 - a start ahead is an optimisation: its reset will launch and report
                log.warning("prefetch could not launch a sandbox", task=task.name, error=repr(exc))

    engines.submit(start_all)
    return len(tasks)


def release(timeout: float | None = None) -> PrefetchCounts:
    """Stop every parked sandbox of every engine in this process; the counts summed.

    Waits for the loop (at most ``timeout`` seconds), not for the stops.
    Called once the step's resets are in: they were handed to the loop before
    this call, the loop starts its tasks in that order, and ``Episode.run``
    claims before its first ``await``, so each reset has claimed its sandbox by
    the time the release runs.
    """
    if not engines.loop_running():
        return PrefetchCounts()

    def release_all() -> PrefetchCounts:
        total = PrefetchCounts()
        for pool in list(_pools.values()):
            counts = pool.release()
            total.hits += counts.hits
            total.unused += counts.unused
        return total

    return engines.call(release_all, timeout=timeout)


def parked_count() -> int:
    """Sandboxes started ahead and not yet claimed, over every engine."""
    if not engines.loop_running():
        return 0
    return engines.call(lambda: sum(pool.parked for pool in list(_pools.values())))
