"""The shim's link to the async core: one shared engine per option set, on the one loop thread.

Every env of the process reaches the loop thread of :mod:`harbor_async.engine.loop`.
Envs built with equal :class:`~shim.options.EngineOptions` share one
:class:`~harbor_async.engine.engine.Engine`, so ``max_live_sandboxes`` and the other
limits hold across the whole batch (a per-env engine would multiply them).
Engines are opened on first use and closed at interpreter exit (or on SIGTERM)
by the loop module, which stops their live sandboxes within a bounded time.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, TypeVar, cast, overload

from harbor_async.core.logs import get_logger
from harbor_async.engine import loop as _loop
from harbor_async.engine.engine import Engine
from shim.guard import RolloutGuard
from shim.options import EngineOptions

T = TypeVar("T")

# Each option set's engine, as a future: the lock guards only the dict and is
# never held while the loop thread works (the loop reads it too: no deadlock).
_engines: dict[EngineOptions, Future[Engine]] = {}
_engines_lock = threading.Lock()
_guards: dict[EngineOptions, RolloutGuard] = {}


def prepare_exit_handlers() -> None:
    """Register the loop module's exit and SIGTERM handlers without starting its thread.

    Called when an env is constructed: that is usually the main thread, the only
    one that may install a signal handler, whereas the first ``reset()`` may run
    in a worker thread (AsyncGRPOTrainer's tool pool).
    """
    _loop.get_loop()


def loop_running() -> bool:
    """Whether the loop thread is up (nothing to stop when it is not)."""
    return _loop.get_loop().running


def in_loop_thread() -> bool:
    """Whether the caller runs on the loop thread itself."""
    return _loop.get_loop().in_loop_thread()


@overload
def call(fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T: ...
@overload
def call(fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T: ...
def call(fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
    """Run ``fn(*args)`` on the loop thread and block for its result.

    Every blocking call of the shim goes through here (tests count them).
    """
    return _loop.get_loop().call(fn, *args, timeout=timeout)


@overload
def submit(fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]: ...
@overload
def submit(fn: Callable[..., T], *args: Any) -> Future[T]: ...
def submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Schedule ``fn(*args)`` on the loop thread; return its future at once."""
    return _loop.get_loop().submit(fn, *args)


def engine_for(options: EngineOptions) -> Engine:
    """The shared engine for ``options``: opened on first use, reopened if it was closed."""
    with _engines_lock:
        slot = _engines.get(options)
        stale = slot is not None and slot.done() and (slot.exception() is not None or slot.result().closed)
        opener = slot is None or stale
        if opener:
            slot = _engines[options] = Future()
    slot = cast("Future[Engine]", slot)  # a new one where it was None
    if opener:  # outside the lock: opening waits for the loop thread
        try:
            slot.set_result(_loop.open_engine(**options.engine_kwargs()))
        except BaseException as exc:
            slot.set_exception(exc)
            raise
    return slot.result()


def close_engine(options: EngineOptions) -> None:
    """Stop the sandboxes of the engine for ``options`` and end it; a later env with them opens a new one."""
    with _engines_lock:
        slot = _engines.pop(options, None)
    if slot is not None and slot.done() and slot.exception() is None:
        _loop.get_loop().close_engine(slot.result())


def guard_for(options: EngineOptions) -> RolloutGuard:
    """The rollout guard shared by every env with ``options`` (see :mod:`shim.guard`)."""
    with _engines_lock:
        guard = _guards.get(options)
        if guard is None:
            guard = _guards[options] = RolloutGuard(
                options.max_live_sandboxes, options.max_failure_share, options.max_start_failures_in_a_row
            )
        return guard


def open_engines() -> list[Engine]:
    """Every engine the shim opened and that is not closed (for diagnostics and tests)."""
    with _engines_lock:
        slots = list(_engines.values())
    return [s.result() for s in slots if s.done() and s.exception() is None and not s.result().closed]


def live_sandbox_count() -> int:
    """Sandboxes the shim's engines have launched and not yet confirmed stopped."""
    if not loop_running():
        return 0

    def count() -> int:  # read the ledgers on the loop, where they change
        return sum(len(engine.live_sandboxes()) for engine in open_engines())

    return call(count)


_job_folders: dict[str, Any] = {}
log = get_logger("harbor_async.shim")


def record_sink(options: EngineOptions) -> Callable[[Any], None] | None:
    """Where a rollout's record goes when its sandbox stops: the options' ``job_dir`` (one folder per path), or nowhere."""
    if options.job_dir is None:
        return None
    with _engines_lock:
        folder = _job_folders.get(options.job_dir)
        if folder is None:
            from pathlib import Path

            from harbor_async.jobs.folder import JobFolder

            path = Path(options.job_dir)
            exists = (path / "harbor-async.json").is_file()
            folder = JobFolder.open(path) if exists else JobFolder.create(path.parent, path.name, {"command": "shim"})
            _job_folders[options.job_dir] = folder

    def append(record: Any) -> None:
        try:
            folder.append(record)
            folder.close()  # a rollout at a time: no file left open between rollouts (or at exit)
        except (OSError, ValueError) as exc:  # a full disk must not end the engine every rollout runs on
            log.error("rollout record not written", job_dir=options.job_dir, task=record.task, error=repr(exc))

    return append
