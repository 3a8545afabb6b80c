"""The keeper: the long-lived bwrap of a sandbox, its PID 1, and the tools that build and join it."""

from __future__ import annotations

import functools
import os
import queue
import select
import shutil
import signal
import subprocess
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio
from harbor.environments.base import SandboxBuildFailedError

from harbor_async.backends.local.layout import (
    NAMESPACES,
    SANDBOX_CAPS,
    SYSTEM_DIRS,
    under,
)
from harbor_async.backends.local.proctree import pidfd_signal, stat_fields


@dataclass(frozen=True)
class Tools:
    """Host programs the keeper's start runs (``sh`` also inside the sandbox, its PID 1, from the host's /usr)."""

    bwrap: str
    setpriv: str
    sh: str
    prlimit: str


def find_tools() -> Tools:
    """Locate bwrap, setpriv, prlimit and sh on ``PATH``, or say clearly what is missing.

    Looked up once per ``PATH`` (a start reads it on the loop thread); a failure is not kept, so it is
    looked up again.

    Raises:
        SandboxBuildFailedError: a program is missing, or one that must run
            inside the sandbox is not under a host folder the sandbox sees.
    """
    return tools_on(os.environ.get("PATH", os.defpath))


@functools.cache
def tools_on(search_path: str) -> Tools:
    """:func:`find_tools` for one ``PATH`` (cached: ``tools_on.cache_clear()`` forgets what was found)."""
    found = {name: shutil.which(name, path=search_path) for name in ("bwrap", "setpriv", "sh", "prlimit")}
    if found["bwrap"] is None:
        raise SandboxBuildFailedError("bubblewrap is not installed (apt-get install bubblewrap)")
    missing = [name for name in ("setpriv", "prlimit") if found[name] is None]
    if missing:
        raise SandboxBuildFailedError(
            f"the local backend needs setpriv and prlimit from util-linux, not found: "
            f"{', '.join(missing)} (util-linux is essential on Debian and Ubuntu; "
            "elsewhere: apt-get install util-linux, or your distribution's util-linux package)"
        )
    for name in ("sh",):  # the sandbox's PID 1
        path = found[name]
        if path is None or not under(os.path.realpath(path), SYSTEM_DIRS):
            raise SandboxBuildFailedError(
                f"the local backend runs {name} inside the sandbox, so it must live under "
                f"{', '.join(SYSTEM_DIRS)} on the host; found: {path}"
            )
    return Tools(**{name: path for name, path in found.items() if path is not None})


def sandbox_caps() -> tuple[str, ...]:
    """The capabilities a sandbox process has inside its user namespace (the keeper's, given by bwrap).

    bwrap always runs unprivileged now (as the sandbox's host uid, or as the
    caller), so these are capabilities of the sandbox's user namespace only:
    they act on what that namespace owns, never on the host.
    """
    return SANDBOX_CAPS


class Keeper:
    """The long-lived bwrap of one sandbox, its PID 1 and the namespace files execs join."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process  # the outer bwrap, on the host (our child)
        self.process_fd: int | None = os.pidfd_open(process.pid)  # readable once it exited
        self.init_pid: int | None = None  # the sandbox's PID 1, as the host sees it
        self.pidfd: int | None = None  # pins init_pid: a recycled pid is never signalled
        self.namespaces: dict[str, int] = {}  # name -> open namespace file (those unlike ours)

    def attach(self, info: dict[str, Any]) -> None:
        """Take hold of the init (pid from bwrap's ``--info-fd``) and its namespaces.

        Raises:
            SandboxBuildFailedError: bwrap reported no pid, or the init is gone.
        """
        pid = info.get("child-pid")
        if not isinstance(pid, int):
            raise SandboxBuildFailedError(f"bubblewrap reported no sandbox pid: {info!r}")
        try:
            self.pidfd = os.pidfd_open(pid)
            self.init_pid = pid
            if stat_fields(pid)[0] != self.process.pid:  # not the child of our bwrap
                raise ProcessLookupError(pid)
            for name in NAMESPACES:
                theirs = f"/proc/{pid}/ns/{name}"
                if os.stat(theirs).st_ino != os.stat(f"/proc/self/ns/{name}").st_ino:
                    self.namespaces[name] = os.open(theirs, os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError) as exc:
            raise SandboxBuildFailedError(f"the sandbox's init process vanished at start: {exc}") from exc
        # Alive after the opens: the files are its namespaces, not a recycled pid's.
        if not self.alive():
            raise SandboxBuildFailedError("the sandbox's init process exited at start")

    def alive(self) -> bool:
        """Whether the sandbox's PID 1 still runs (a pidfd reads as ready when it has exited)."""
        return self.pidfd is not None and not pidfd_exited(self.pidfd)

    def kill_init(self) -> None:
        """SIGKILL the sandbox's PID 1: the kernel then kills every process in the namespace."""
        if self.pidfd is not None:
            pidfd_signal(self.pidfd, signal.SIGKILL)

    async def wait(self) -> None:
        """Wait until the outer bwrap has exited, and reap it."""
        while self.process.poll() is None:
            if self.process_fd is None:  # closed already (abandoned)
                await anyio.sleep(0.01)
            else:
                await anyio.wait_readable(self.process_fd)

    def close(self) -> None:
        for fd in [*self.namespaces.values(), self.pidfd, self.process_fd]:
            if fd is not None:
                os.close(fd)
        self.namespaces.clear()
        self.pidfd = self.process_fd = None

    def abandon(self) -> None:
        """Finalizer of an environment dropped without ``stop()``: end its processes at least."""
        self.kill_init()
        if self.init_pid is None and self.process.returncode is None:
            self.process.kill()  # not attached: no init to kill
        self.close()


def pidfd_exited(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class KeeperThread:
    """The one long-lived thread that forks every keeper.

    bwrap's ``--die-with-parent`` (``PR_SET_PDEATHSIG``) ties a keeper to the
    *thread* that forked it, not to the process. trio forks in its worker
    threads, which retire after seconds of idleness: the keeper, and the whole
    sandbox, would die with them. This daemon thread never ends before the
    process does, so a keeper dies with the process, and only then.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Any, Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, function: Any) -> Future[Any]:
        """A future of ``function()`` run on the thread; at interpreter exit, where no thread may start, a future
        of that ``RuntimeError`` when the thread was not running yet (nothing would ever run what is queued)."""
        future: Future[Any] = Future()
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="harbor-async-keepers", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # kept unset: a start that is allowed later starts it then
                    future.set_exception(exc)
                    return future
                self._thread = thread
        self._queue.put((function, future))
        return future

    def _run(self) -> None:
        while True:
            function, future = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function())
                except BaseException as exc:
                    future.set_exception(exc)


KEEPER_THREAD = KeeperThread()


async def spawn_from_keeper_thread(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)``, forked by :data:`KEEPER_THREAD`."""
    future = KEEPER_THREAD.submit(functools.partial(subprocess.Popen, argv, **kwargs))
    return await anyio.to_thread.run_sync(future.result)

