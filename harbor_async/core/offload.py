"""Blocking work off the loop thread: file and cgroup operations that take milliseconds under load.

:func:`off_loop` runs a function in one of anyio's worker threads, and in
the caller's thread only where no new thread may start (at interpreter exit,
when the loop thread stops the last sandboxes): a teardown must finish either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio


async def off_loop[T](fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread (inline at interpreter exit, where threads cannot start)."""
    try:
        return await anyio.to_thread.run_sync(fn, *args)
    except RuntimeError as exc:
        if "interpreter shutdown" not in str(exc):
            raise
        return fn(*args)
