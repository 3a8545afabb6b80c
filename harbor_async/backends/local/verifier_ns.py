"""The verifier's own view of a local sandbox: only the verifier can write what the reward is read from.

An agent's background process keeps running while the verifier runs (tasks
test the services an agent left behind, as Harbor runs them), and so could
rewrite ``/logs/verifier/reward.json`` after the tests wrote 0, or swap
``/tests/test.sh`` for one that writes 1. So, for the verify phase, a holder
process (``enter.py``'s ``hold``, outside the sandbox's PID namespace) makes a
second mount namespace of the sandbox's in which ``/logs/verifier`` and
``/tests`` are fresh, empty tmpfs mounts. The verifier's execs join that
namespace instead of the keeper's, the tests are uploaded into it and its
output is read from it; the agent's processes, in the keeper's namespace, see
the old folders. They cannot reach the verifier's through ``/proc/PID/root``
(or its ``cwd``, ``fd``, ``mem``): the verifier's processes hold one
capability more than theirs (``VERIFIER_EXTRA_CAPS``), and the kernel allows
that access only to a process whose capabilities are a superset.

What the agent can still change is the environment the verifier runs in:
everything else in the sandbox (a tool on its PATH, a library, a service).
Separate verifier environments are the remedy (see docs/backends.md).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import anyio

from harbor_async.backends.local import hostfs
from harbor_async.backends.local.enter_server import open_join
from harbor_async.backends.local.layout import KEEPER_START_TIMEOUT
from harbor_async.backends.local.sandboxing import join_spec
from harbor_async.core.errors import HarborAsyncError, VerifierPathError

#: ``enter.py``'s ``hold`` exit status when a path to hold is not a folder in the sandbox (``helpers/enter.py``).
NOT_A_FOLDER = 123

#: The folders the verifier gets fresh and to itself.
PRIVATE_DIRS = ("/logs/verifier", "/tests")


class VerifierNamespaceError(HarborAsyncError, RuntimeError):
    """The verifier's own mount namespace could not be made (the holder's error in the message)."""


class VerifierNamespace:
    """The verify-phase half of :class:`~harbor_async.backends.local.LocalEnvironment`."""

    session_id: str
    _keeper: Any
    _confinement: Any
    _verifier_mnt: int | None
    _private_dirs: dict[str, int]

    @contextlib.asynccontextmanager
    async def verifier_scope(self) -> AsyncIterator[None]:
        """Run the body (the verifier's execs and transfers) in the verifier's own mount namespace.

        Raises:
            VerifierPathError: a private folder's path is not a folder in the sandbox (the agent replaced it).
            VerifierNamespaceError: the holder failed otherwise.
        """
        if self._keeper is None or self._confinement is None:
            raise RuntimeError(f"local sandbox {self.session_id} is not started")
        spec = join_spec(self._keeper, self._confinement, {}, "/", [], hold=PRIVATE_DIRS)
        with anyio.CancelScope(shield=True):  # a cancelled spawn must not leak a holder
            process = await open_join(spec, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        opened: list[int] = []
        try:
            assert process.stdout is not None and process.stderr is not None
            line = b""
            with anyio.move_on_after(KEEPER_START_TIMEOUT):
                with contextlib.suppress(anyio.EndOfStream):  # the holder exited without a word
                    line = await process.stdout.receive()
            if not line.startswith(b"ready"):
                with anyio.move_on_after(5):
                    await process.wait()
                detail = b""
                with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
                    with anyio.move_on_after(1):
                        detail = await process.stderr.receive()
                if process.returncode == NOT_A_FOLDER:
                    raise VerifierPathError(" or ".join(PRIVATE_DIRS), detail.decode(errors="replace").strip())
                raise VerifierNamespaceError(
                    f"local sandbox {self.session_id}: the verifier's namespace could not be made: "
                    f"{detail.decode(errors='replace').strip() or f'exit {process.returncode}'}"
                )
            # Not reaped (our child, or the server's, reaped only after aclose): its pid names it.
            mnt = os.open(f"/proc/{process.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            opened.append(mnt)
            root = os.open(f"/proc/{process.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                private = {}
                for path in PRIVATE_DIRS:  # crosses into the fresh mount: no RESOLVE_NO_XDEV here
                    fd = hostfs.openat2(
                        root, path, os.O_PATH | os.O_DIRECTORY,
                        resolve=hostfs.RESOLVE_IN_ROOT | hostfs.RESOLVE_NO_MAGICLINKS,
                    )  # fmt: skip
                    opened.append(fd)
                    private[path] = fd
            finally:
                os.close(root)
            self._verifier_mnt, self._private_dirs = mnt, private
            yield
        finally:
            self._verifier_mnt, self._private_dirs = None, {}
            for fd in opened:
                os.close(fd)
            with anyio.CancelScope(shield=True):
                if process.stdin is not None:
                    await process.stdin.aclose()  # the holder's signal to leave
                with anyio.move_on_after(5):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                await process.aclose()
