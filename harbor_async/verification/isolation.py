"""What the verify phase does before the verifier runs, on every backend: isolate it from the agent.

Harbor runs the verifier in the agent's sandbox while the agent's background
processes keep running (tasks test services an agent left behind). A backend
that can give the verifier folders of its own does so through
``environment.verifier_scope()`` (the local backend: a private mount
namespace, see :mod:`harbor_async.backends.local.verifier_ns`); others run the
verifier as Harbor does. ``strict_verify`` (the default) goes further on every
backend: no process of the agent's is left when the verifier starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from harbor_async.core.errors import HarborAsyncError

_SCRIPT = resources.files("harbor_async.verification") / "helpers" / "end_agent_processes.sh"
#: Seconds a failed verify may spend saving what the tests printed.
SAVE_OUTPUT_SEC = 10.0
#: The dynamic loader's files in a sandbox's ``/etc`` that every backend puts back before a restarted
#: sandbox's first process (the agent's copy keeps its content under a name with HIDDEN_SUFFIX).
PRELOAD, CACHE = "ld.so.preload", "ld.so.cache"
HIDDEN_SUFFIX = ".harbor-async-hidden"


class AgentProcessesSurvivedError(HarborAsyncError, RuntimeError):
    """``strict_verify``: the agent's processes could not be ended before verification."""


async def end_agent_processes(environment: Any, timeout_sec: int = 30) -> None:
    """End the agent's processes before the verifier (``strict_verify``).

    A backend that can restart the sandbox's processes with its files kept
    does so (``environment.end_agent_processes()``: local starts a new PID
    namespace, docker restarts the main container); on the others every
    process but the sandbox's init and main command is killed, as its root.

    Raises:
        AgentProcessesSurvivedError: some survived (a fork bomb outpacing 10 s of rounds), or the script failed.
    """
    restart = getattr(environment, "end_agent_processes", None)
    if restart is not None:
        await restart()
        return
    result = await environment.exec(_SCRIPT.read_text(), timeout_sec=timeout_sec, user="root")
    if result.return_code not in (0, None):
        raise AgentProcessesSurvivedError(
            f"ending the agent's processes failed (exit {result.return_code}): "
            f"{(result.stderr or result.stdout or '').strip()[-500:]}"  # docker's exec merges stderr into stdout
        )


async def save_verifier_output(environment: Any, env_paths: Any, trial_paths: Any) -> None:
    """Copy the verifier's folder into the trial folder after a failed verify (Harbor copies it only on success).

    Inside the verifier's scope (its own folder, on local), bounded in time and
    size, shielded from the cancellation being raised; best effort.
    """
    import anyio

    with anyio.CancelScope(shield=True), anyio.move_on_after(SAVE_OUTPUT_SEC):
        try:
            await environment.download_dir(str(env_paths.verifier_dir), trial_paths.verifier_dir)
        except Exception:  # noqa: BLE001 - the failure being raised is what counts
            return


@contextlib.asynccontextmanager
async def verifier_scope(environment: Any) -> AsyncIterator[bool]:
    """The verifier's own view of the sandbox where the backend has one; yields whether it has."""
    scope = getattr(environment, "verifier_scope", None)
    if scope is None:
        yield False
        return
    async with scope():
        yield True


#: Seconds granted to look at the verifier's folders after their transfer failed.
LOOK_SEC = 10


async def replaced_verifier_folders(environment: Any, env_paths: Any) -> str | None:
    """Why the verifier's folders could not be used, when the sandbox's own state says so; else ``None``.

    Asked after a transfer into or out of them failed (Harbor's
    ``AddTestsDirError``): when the sandbox answers and ``/tests`` or
    ``/logs/verifier`` is not a folder there (a file, a link), the agent
    replaced it, and the failed verification is its episode's, not the
    infrastructure's. A sandbox that cannot answer gives no such evidence:
    ``None``, and the failure stays the backend's.
    """
    folders = " ".join(f'"{path}"' for path in (env_paths.tests_dir, env_paths.verifier_dir))
    script = f'for d in {folders}; do if [ -L "$d" ] || [ ! -d "$d" ]; then echo "$d"; fi; done'
    try:
        result = await environment.exec(script, timeout_sec=LOOK_SEC, user="root")
    except Exception:  # noqa: BLE001 - no answer: no evidence against the sandbox
        return None
    replaced = (result.stdout or "").split() if result.return_code == 0 else []
    if not replaced:
        return None
    return f"{' and '.join(replaced)} is not a folder in the sandbox (the agent replaced it): no verifier can run"
