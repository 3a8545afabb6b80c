"""harbor_async: an async-native episode engine for Harbor sandboxes.

The public API in one place::

    from harbor_async import Engine, Limits, Timeouts, RetryPolicy, load_suite

    async with Engine(limits=Limits(live_sandboxes=16)) as engine:
        async with engine.sandbox(task, "local") as sandbox:
            print((await sandbox.exec("ls")).output)
            print((await sandbox.verify()).reward)
"""

from harbor_async.core import moved as _moved

_moved.install()  # the flat layout's module paths, for one release

from harbor_async.core.errors import (
    AsyncLibraryError,
    BackendError,
    ExecError,
    FailureClass,
    HarborAsyncError,
    LoopThreadError,
    Phase,
    SandboxCancelledError,
    SandboxClosedError,
    SandboxError,
    SandboxTimeout,
    StartError,
    StopError,
    VerifyError,
)
from harbor_async.core.policy import Limits, RetryPolicy, Timeouts
from harbor_async.core.records import EpisodeRecord
from harbor_async.core.results import ExecOutput, VerifyResult
from harbor_async.core.stats import EngineStats
from harbor_async.engine.engine import Engine, EngineClosedError
from harbor_async.engine.loop import call, get_loop, open_engine, submit
from harbor_async.engine.sandbox import Sandbox, SandboxState
from harbor_async.tasks.suite import TaskSuite, load_suite, load_task

__all__ = [
    "AsyncLibraryError",
    "BackendError",
    "Engine",
    "EngineClosedError",
    "EngineStats",
    "EpisodeRecord",
    "ExecError",
    "ExecOutput",
    "FailureClass",
    "HarborAsyncError",
    "Limits",
    "LoopThreadError",
    "Phase",
    "RetryPolicy",
    "Sandbox",
    "SandboxCancelledError",
    "SandboxClosedError",
    "SandboxError",
    "SandboxState",
    "SandboxTimeout",
    "StartError",
    "StopError",
    "TaskSuite",
    "Timeouts",
    "VerifyError",
    "VerifyResult",
    "call",
    "get_loop",
    "open_engine",
    "submit",
    "evaluate",
    "evaluate_sync",
    "load_suite",
    "load_task",
]


def __getattr__(name: str) -> object:
    # evaluate pulls in openai and the shim: imported on first use, not with the package.
    if name in ("evaluate", "evaluate_sync"):
        from harbor_async import evaluation

        return getattr(evaluation, name)
    raise AttributeError(f"module 'harbor_async' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the lazy ones (``evaluate``), for completion and ``help()``."""
    return sorted({*globals(), *__all__})
