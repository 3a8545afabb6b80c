"""The one loop thread: an anyio (asyncio) event loop behind a BlockingPortal.

Every Harbor object lives on this loop. Synchronous code (the TRL shim, the
CLI) reaches it with :func:`call` (blocks for the result) or :func:`submit`
(returns a ``concurrent.futures.Future``). The thread is a daemon started on
first use; at interpreter exit (and on SIGTERM) it stops every engine's live
sandboxes within a bounded time and never hangs the exit.

Why not ``anyio.from_thread.start_blocking_portal``: leaving its context waits
for the loop thread without a bound, and exit must stay bounded even when a
backend wedged the loop with a blocking call. So this module owns the (daemon)
thread and runs anyio's own ``BlockingPortal`` in it; plain submits skip the
portal's hand-shake (one thread wake-up fewer, see :meth:`LoopThread.submit`).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar, cast, overload

import anyio
import sniffio
from anyio.from_thread import BlockingPortal

from harbor_async.core.errors import LoopThreadError
from harbor_async.engine.engine import Engine

T = TypeVar("T")

#: Seconds the exit handler waits for engines to stop their sandboxes (``HARBOR_ASYNC_EXIT_BUDGET``).
EXIT_BUDGET = float(os.environ.get("HARBOR_ASYNC_EXIT_BUDGET") or 60.0)
#: Seconds the exit handler then waits for the loop itself to end.
LOOP_STOP_BUDGET = 5.0
#: Seconds between a waiting thread's looks at its signal handlers and its future (see :func:`wait_done`).
SIGNAL_CHECK = 0.2
#: Set to 1 to run every event loop of harbor-async (the loop thread, ``run``, ``eval``) on uvloop.
UVLOOP_VARIABLE = "HARBOR_ASYNC_UVLOOP"


def uses_uvloop() -> bool:
    """Whether ``HARBOR_ASYNC_UVLOOP`` asks for uvloop (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(UVLOOP_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def run_loop[T](fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(fn, *args)`` on asyncio, on uvloop where :func:`uses_uvloop` says so.

    Raises:
        LoopThreadError: uvloop is asked for and not installed (the ``uvloop`` extra).
    """
    options: dict[str, Any] = {}
    if uses_uvloop():
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise LoopThreadError(
                f"{UVLOOP_VARIABLE}=1 asks for uvloop, which is not installed: pip install 'harbor-async[uvloop]'"
            ) from None
        options["use_uvloop"] = True
    return anyio.run(fn, *args, backend="asyncio", backend_options=options)


class LoopThread:
    """A daemon thread running one asyncio event loop, reachable through a portal."""

    def __init__(self, name: str = "harbor-async-loop") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._portal: BlockingPortal | None = None
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._engines: list[Engine] = []
        self._closing: list[Engine] = []  # engines close() is stopping (for a forced exit's report)

    # ── thread ──────────────────────────────────────────────────────────

    def _main(self) -> None:
        async def serve() -> None:
            async with BlockingPortal() as portal:
                self._aio_loop = asyncio.get_running_loop()
                self._portal = portal
                self._ready.set()
                await portal.sleep_until_stopped()

        try:
            run_loop(serve)
        except BaseException as exc:  # surfaced to the caller waiting in start()
            self._error = exc
        finally:
            self._portal = None
            self._ready.set()

    def start(self) -> BlockingPortal:
        """Start the thread if needed; return its portal."""
        with self._lock:
            if self._portal is not None and self._thread is not None and self._thread.is_alive():
                return self._portal
            self._ready.clear()
            self._error = None
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
            self._thread.start()
            self._ready.wait()
            if self._portal is None:
                raise RuntimeError(f"the loop thread failed to start: {self._error!r}")
            return self._portal

    @property
    def running(self) -> bool:
        """Whether the thread and its loop are up."""
        return self._portal is not None and self._thread is not None and self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the loop thread itself."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _check_caller(self, what: str) -> None:
        if self.in_loop_thread():
            raise LoopThreadError(
                f"{what} blocks for the loop thread's result and was called from the loop "
                "thread itself, which would deadlock; await the coroutine directly instead"
            )

    # ── calls ───────────────────────────────────────────────────────────

    @overload
    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T: ...
    @overload
    def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T: ...
    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run ``fn(*args)`` on the loop and block for its result.

        ``timeout`` bounds the wait (``TimeoutError``); the call itself is then
        cancelled on the loop.
        """
        self._check_caller("call()")
        future = self.submit(fn, *args)
        if not wait_done(future, timeout):
            future.cancel()
            raise TimeoutError(f"no result from the loop thread within {timeout} s")
        return future.result()  # the call's own error as it raised it (a SandboxTimeout is a TimeoutError too)

    @overload
    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]: ...
    @overload
    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]: ...
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Schedule ``fn(*args)`` on the loop; return a future at once.

        A coroutine function goes straight to asyncio's
        ``run_coroutine_threadsafe``; a plain callable runs in a task the same
        way (an awaitable it returns is awaited). Both are one thread hand-off
        and never wait for the loop, so a
        submit (a finalizer's, say) cannot hang on a wedged loop; the portal's
        ``start_task_soon`` waits for the loop to take the task. Every shim
        tool call pays this hand-off; ``harbor-async bench overhead`` measures
        it against the machine's floor (docs/benchmarks.md).
        """
        if self.in_loop_thread():
            raise LoopThreadError("submit() is for other threads; on the loop thread, spawn a task")
        self.start()
        aio_loop = cast(asyncio.AbstractEventLoop, self._aio_loop)  # set before start() returns
        if inspect.iscoroutinefunction(fn):
            return asyncio.run_coroutine_threadsafe(fn(*args), aio_loop)
        return asyncio.run_coroutine_threadsafe(_call_in_task(fn, *args), aio_loop)

    # ── engines ─────────────────────────────────────────────────────────

    def open_engine(self, **kwargs: Any) -> Engine:
        """Create an :class:`Engine` with ``kwargs`` and run it on the loop until closed."""
        self._check_caller("open_engine()")
        portal = self.start()

        async def make() -> Engine:
            return Engine(**kwargs)

        engine = portal.call(make)
        engine.host = self
        _, started = portal.start_task(engine.serve, name=f"engine {engine.run_label}")
        with self._lock:
            self._engines.append(engine)
        return started

    def close_engine(self, engine: Engine, timeout: float | None = EXIT_BUDGET) -> None:
        """Stop ``engine``'s sandboxes and end it (blocks up to ``timeout``)."""
        with self._lock:
            if engine in self._engines:
                self._engines.remove(engine)
        if self.running:
            self.call(engine.aclose, timeout=timeout)

    def close(self, timeout: float = EXIT_BUDGET) -> None:
        """Close every engine (bounded by ``timeout``), then stop the loop thread."""
        if not self.running:
            return
        with self._lock:
            engines, self._engines = list(self._engines), []
            self._closing = engines
        if engines:
            future = self.submit(_close_all, engines)
            try:
                future.result(timeout)
            except FutureTimeout:
                print(
                    f"harbor-async: sandboxes still stopping after {timeout:.0f} s at exit; "
                    "run `harbor-async sandboxes reap` to remove leftovers",
                    file=sys.stderr,
                )
            except Exception as exc:  # an exit handler must not raise
                print(f"harbor-async: error while stopping sandboxes at exit: {exc!r}", file=sys.stderr)
        portal, thread = self._portal, self._thread
        if portal is not None:
            # Never portal.call here: a loop wedged by a blocking call would hang the exit.
            try:
                self.submit(portal.stop, True).result(LOOP_STOP_BUDGET)
            except FutureTimeout:
                print(
                    f"harbor-async: the loop thread did not stop within {LOOP_STOP_BUDGET:.0f} s "
                    "(a blocking call on it?); leaving it behind",
                    file=sys.stderr,
                )
                return  # a daemon thread: the process exits without it
            except Exception:  # the loop may already be gone
                pass
        if thread is not None:
            thread.join(timeout=LOOP_STOP_BUDGET)
        if _terminating and threading.current_thread() is threading.main_thread():
            # Cleanup is done: a late second SIGTERM must not kill the exit Python's
            # finalization is about to make (it puts default handlers back).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def wait_done(future: Future[Any], timeout: float | None = None) -> bool:
    """Wait until ``future`` is done (``True``) or ``timeout`` passed (``False``); a signal interrupts the main thread's.

    The kernel gives a process's SIGINT to any of its threads that does not
    block it. Python's handler then only flags it for the main thread, and a
    main thread asleep in an untimed wait never looks at the flag: Ctrl-C
    during a shim tool call hung the trainer whenever the loop thread or a
    keeper thread took the signal (seen under load). So the main thread waits
    in slices of :data:`SIGNAL_CHECK` seconds, and a flagged signal's handler
    (``KeyboardInterrupt``, a program's own) runs between two of them.
    Waiting apart from ``future.result()`` keeps the wait's own timeout apart
    from a ``TimeoutError`` that the call itself raised. Each slice also reads
    ``future.done()``: a future cancelled by ``cancel()`` alone (no executor
    took it) never wakes ``concurrent.futures.wait``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if future.done():
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if wait_futures([future], SIGNAL_CHECK if left is None else max(0.0, min(SIGNAL_CHECK, left))).done:
            return True
        if left is not None and left <= SIGNAL_CHECK:
            return future.done()


def wait_result[T](future: Future[T], timeout: float | None = None) -> T:
    """``future.result(timeout)`` that a signal interrupts on the main thread (see :func:`wait_done`).

    Raises:
        concurrent.futures.TimeoutError: not done within ``timeout``; else whatever the call raised.
    """
    if not wait_done(future, timeout):
        raise FutureTimeout(f"not done within {timeout} s")
    return future.result()


async def await_future(future: Future[T]) -> T:
    """Await a loop thread's ``future`` from another event loop without blocking that loop.

    On asyncio, cancelling the awaiting task cancels the future, hence the work
    on the loop thread; on trio the wait runs in a worker thread.
    """
    if sniffio.current_async_library() == "asyncio":
        return await asyncio.wrap_future(future)
    return await anyio.to_thread.run_sync(future.result)


async def _call_in_task(fn: Callable[..., Any], *args: Any) -> Any:
    # A plain callable runs inside a task: anyio's task groups and limiters need one.
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


async def _close_all(engines: list[Engine]) -> None:
    async with anyio.create_task_group() as tg:
        for engine in engines:
            tg.start_soon(engine.aclose)


_default: LoopThread | None = None
_default_lock = threading.Lock()
_terminating = False  # a SIGTERM began the exit


def get_loop() -> LoopThread:
    """The process-wide loop thread (created on first use, closed at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = LoopThread()
            atexit.register(_default.close)
            _install_sigterm_handler()
        return _default


def call(fn: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T:
    """Run ``fn(*args)`` on the shared loop thread and block for the result."""
    return get_loop().call(fn, *args, timeout=timeout)


def submit(fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
    """Schedule ``fn(*args)`` on the shared loop thread; return a future."""
    return get_loop().submit(fn, *args)


def open_engine(**kwargs: Any) -> Engine:
    """An :class:`Engine` running on the shared loop thread (closed at exit)."""
    return get_loop().open_engine(**kwargs)


def _install_sigterm_handler() -> None:
    """Make SIGTERM stop the sandboxes: a normal exit (atexit stops them), or the program's own handler first.

    Only from the main thread (signal handlers cannot be installed elsewhere).
    With no handler of the program's, the first SIGTERM exits normally; with
    one, that handler is chained to, never replaced: it decides what a SIGTERM
    means, and the sandboxes are stopped at exit as always. An ignored SIGTERM
    stays ignored. A second SIGTERM during the cleanup (coreutils ``timeout``
    sends two) is acknowledged and ignored; a third ends the process at once,
    after naming what is left for the reaper.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN or previous is None:  # ignored, or set outside Python: leave it alone
        return
    received = 0

    def _exit(signum: int, frame: Any) -> None:
        nonlocal received
        received += 1
        if received < 3 and callable(previous):  # the program's handler decides; atexit still stops the sandboxes
            previous(signum, frame)
            return
        if received == 1:
            global _terminating
            _terminating = True
            raise SystemExit(128 + signum)
        if received == 2:
            print("harbor-async: still stopping sandboxes; a third signal exits at once", file=sys.stderr)
            return
        engines = [*_default._engines, *_default._closing] if _default else []
        left = sum(len(engine.live_sandboxes()) for engine in engines)
        print(
            f"harbor-async: exiting now; {left} sandbox(es) may be left: run `harbor-async sandboxes reap`",
            file=sys.stderr,
        )
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
