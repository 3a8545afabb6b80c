"""The local backend's errors."""

from __future__ import annotations

class ExecTimeoutError(RuntimeError):
    """An ``exec`` ran past its ``timeout_sec``; its whole process tree was killed.

    A ``RuntimeError`` with the message Harbor's docker backend uses, so code
    written for Docker handles it the same way; the output captured before the
    kill is kept on ``stdout`` and ``stderr``.
    """

    def __init__(self, timeout_sec: float, stdout: str | None, stderr: str | None) -> None:
        super().__init__(f"Command timed out after {timeout_sec} seconds")
        self.timeout_sec = timeout_sec
        self.stdout = stdout
        self.stderr = stderr


class SandboxPathError(ValueError):
    """A sandbox path that cannot be transferred (read-only host folder, /proc ...)."""
