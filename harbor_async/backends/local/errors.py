"""The local backend's errors (each a :class:`~harbor_async.core.errors.HarborAsyncError`)."""

from __future__ import annotations

from pathlib import Path

from harbor.environments.base import SandboxBuildFailedError

from harbor_async.core.errors import (
    BackendExecTimeout,
    HarborAsyncError,
    TaskDefinitionError,
)


class ExecTimeoutError(BackendExecTimeout):
    """An ``exec`` ran past its ``timeout_sec``; its whole process tree was killed.

    The output captured before the kill is kept on ``stdout`` and ``stderr``.
    """


class SandboxPathError(HarborAsyncError, ValueError):
    """A sandbox path that cannot be transferred (read-only host folder, /proc ...)."""


class TaskPathEscapeError(TaskDefinitionError):
    """A task file (COPY source, ``instruction.md``, ``tests/``, ``solution/``) is a symlink out of the task.

    Refused as Docker refuses a build-context escape: following it would copy
    a host file into the sandbox (or make it the prompt).
    """

    def __init__(self, path: Path, target: Path) -> None:
        super().__init__(f"{path} leads out of the task folder (to {target}); refusing to follow it")
        self.path = path
        self.target = target


class LimitUnavailableError(HarborAsyncError, SandboxBuildFailedError):
    """As root, the sandbox's cgroups (its memory, CPU and process limits) could not be made.

    Refused rather than run unlimited; ``--ek require_limits=false`` runs it with rlimits only.
    """

    def __init__(self, session_id: str, reason: str) -> None:
        super().__init__(
            f"local sandbox {session_id}: its memory, CPU and process limits cannot be applied ({reason}); "
            "refusing to run it unlimited (--ek require_limits=false runs it with rlimits only)"
        )
        self.reason = reason
