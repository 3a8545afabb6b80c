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
its token's ``run_sync_soon``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

import sniffio

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
            self._soon = asyncio.get_running_loop().call_soon_threadsafe
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
