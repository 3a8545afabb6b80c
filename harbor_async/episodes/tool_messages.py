"""What a model reads when its tool command did not run to the end: the text of :meth:`Episode.exec_text`'s errors.

The wording is TRL's env's where TRL has one (a start that failed, a timeout)
and the same for every driver (``eval``'s harnesses and the shim), so a model
trained on it reads the same at evaluation.
"""

from __future__ import annotations

import math

from harbor_async.core.errors import (
    Phase,
    SandboxClosedError,
    SandboxTimeout,
    StartError,
)


def describe_unavailable(error: BaseException) -> str:
    """The tool-call message for an episode whose sandbox cannot run commands."""
    if isinstance(error, StartError) or (isinstance(error, SandboxTimeout) and error.phase is Phase.START):
        return (
            f"Error: the sandbox for this task could not be started, so no command can run in this episode ({error})."
        )
    if isinstance(error, SandboxClosedError):
        return f"Error: the sandbox of this episode is no longer available ({error})."
    return (
        "Error: the sandbox for this task could not be prepared, so no command can run "
        f"in this episode ({type(error).__name__}: {error})."
    )


def agent_time_up(budget: float | None, *, stopped: bool) -> str:
    """The agent's time budget is spent: the command was ``stopped`` by it, or none runs any more."""
    then = "the command was stopped." if stopped else "no more commands run in this episode."
    return f"Error: this task's time limit for the agent ({seconds(budget)}) was reached; {then}"


def timed_out(timeout: float | None) -> str:
    """The command ran past its own timeout."""
    return f"Error: the command timed out after {seconds(timeout)} and was stopped."


#: The episode's own deadline ended the command.
DEADLINE = "Error: the episode's time limit was reached; the command was stopped."


def not_run(error: BaseException) -> str:
    """The sandbox could not run the command (not a command that failed)."""
    return f"Error: the command could not be run ({error})."


def seconds(value: float | None) -> str:
    """A duration as the messages give it."""
    if value is None or not math.isfinite(value):
        return "its time limit"
    return f"{value:g} s"
