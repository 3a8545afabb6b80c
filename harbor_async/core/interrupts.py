"""SIGINT, SIGTERM and SIGHUP during a batch: stop cleanly, keep the records, exit 128 + signal.

The one interrupt policy of ``run`` and ``eval`` (and of :func:`harbor_async.evaluation.evaluate`
called from a program's main thread):

- The first signal cancels the batch: every episode records itself as
  cancelled, every sandbox is stopped (each stop bounded by the stop budget),
  the records are flushed; the command then prints the partial table and
  exits 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP).
- A second signal does not abort that cleanup (coreutils ``timeout`` sends
  two: one to the command and one to its process group); it is acknowledged.
- A third forces the exit at once, after naming the sandboxes still alive
  for ``harbor-async sandboxes reap``.

Handlers are Python ``signal`` handlers, not event-loop ones, so that the
third signal still works when the loop is stuck; they write to the stderr
file descriptor directly (no console lock can be held by the code they
interrupt) and hand the cancellation to the loop with ``call_soon_threadsafe`` (trio:
its token's ``run_sync_soon``). A Python handler runs on the main thread, and
only once that thread runs Python code: when the kernel hands the signal to
another thread (a worker thread, a keeper thread), plain asyncio would sleep
on in its selector until its next timer. So on asyncio a wake-up file is set
(``signal.set_wakeup_fd``) that the loop reads; trio and uvloop set their own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType

import sniffio

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _drain(wakeup: socket.socket) -> None:
    # Waking the loop is the whole job: the Python handler runs on the main thread as the loop returns to Python.
    try:
        while wakeup.recv(4096):
            pass
    except OSError:  # BlockingIOError: drained
        pass


def _write(text: str) -> None:
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except OSError:
        pass


class Interrupts:
    """Signal handling for one batch; use as a context manager around ``anyio.run``.

    Args:
        leftovers: returns the ids of the sandboxes still alive (read by the third signal).
    """

    def __init__(self, leftovers: Callable[[], list[str]] = list) -> None:
        self.leftovers = leftovers
        self.signum: int | None = None
        self.count = 0
        self._cancel: Callable[[], None] | None = None
        self._soon: Callable[[Callable[[], None]], object] | None = None
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[asyncio.AbstractEventLoop, socket.socket, socket.socket] | None = None

    @property
    def exit_code(self) -> int | None:
        """128 + the first signal's number, once one came (130, 143, 129)."""
        return None if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str:
        """The first signal's name (``SIGTERM``), or an empty string."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def arm(self, cancel: Callable[[], None]) -> None:
        """Call ``cancel`` on the running loop (asyncio or trio) at the first signal (now, if one already came)."""
        if sniffio.current_async_library() == "trio":
            import trio

            self._soon = trio.lowlevel.current_trio_token().run_sync_soon
        else:
            loop = asyncio.get_running_loop()
            self._soon = loop.call_soon_threadsafe
            self._wake_on_signals(loop)
        self._cancel = cancel
        if self.signum is not None:
            cancel()

    def disarm(self) -> None:
        """The batch is over: a first signal from now on only sets the exit code."""
        self._cancel = None

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():  # handlers can be set only there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        self._stop_waking()

    def _wake_on_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make any signal wake ``loop`` (on the main thread, where the handlers are), whichever thread takes it."""
        if not self._previous or threading.current_thread() is not threading.main_thread():
            return
        if self._wakeup is not None:
            if self._wakeup[0] is loop:
                return
            self._stop_waking()  # a later loop of the same batch (run's cluster path, say)
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # the loop keeps its own (uvloop): it wakes on signals already
            signal.set_wakeup_fd(previous)
            read.close()
            write.close()
            return
        loop.add_reader(read.fileno(), _drain, read)
        self._wakeup = (loop, read, write)

    def _stop_waking(self) -> None:
        if self._wakeup is None:
            return
        loop, read, write = self._wakeup
        self._wakeup = None
        current = signal.set_wakeup_fd(-1)
        if current != write.fileno():  # someone set their own meanwhile: theirs stays
            signal.set_wakeup_fd(current)
        if not loop.is_closed():
            loop.remove_reader(read.fileno())
        read.close()
        write.close()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self.signum = signum
            _write(f"\n{name}: stopping every sandbox and keeping the finished episodes' records "
                   "(a third signal forces the exit)\n")  # fmt: skip
            cancel, soon = self._cancel, self._soon
            if cancel is not None and soon is not None:
                try:
                    soon(cancel)
                except RuntimeError:  # the loop is closed: nothing left to cancel
                    pass
            return
        if self.count == 2:
            _write(f"{name}: still stopping sandboxes; send a third signal to exit at once and leave them\n")
            return
        try:
            left = self.leftovers()
        except Exception:  # noqa: BLE001 - read from a signal handler: the ledger may be changing under us
            left = []
        if left:
            _write(f"{name}: exiting now; {len(left)} sandbox(es) may be left: {', '.join(left)}\n"
                   "remove them with `harbor-async sandboxes reap`\n")  # fmt: skip
        else:
            _write(f"{name}: exiting now; if anything was left, `harbor-async sandboxes reap` removes it\n")
        os._exit(128 + (self.signum or signum))
