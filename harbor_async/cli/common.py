"""What every command shares: consoles, markup-safe printing, the bad-input exit, option parsing.

Names, paths and messages come from users' files and from exceptions; rich would
read ``[/]`` or ``[environment]`` in them as markup (and crash or drop the text).
So every such text is printed as a :class:`~rich.text.Text` or escaped, never
formatted into a markup string.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from harbor_async.agents.task_checks import (
    MissingVariablesError,
    UnsupportedTaskError,
)
from harbor_async.backends import resolve_backend
from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.logs import LogSettingError, configure_logging
from harbor_async.core.printing import escape_controls

out = Console()
if not out.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    out = Console(width=200)
err = Console(stderr=True, soft_wrap=True)

__all__ = [
    "checked_backend",
    "err",
    "escape",
    "fail",
    "out",
    "parse_indices",
    "parse_kwargs",
    "say",
    "setup_logging",
]


def say(label: str, message: object, style: str = "yellow", *, console: Console | None = None) -> None:
    """Print ``label`` in ``style`` then ``message`` verbatim (no markup read in it)."""
    (console or err).print(Text.assemble((label, style), " ", escape_controls(str(message), keep_newlines=True)))


def warn_renamed_flags(renamed: dict[str, str], argv: list[str] | None = None) -> list[str]:
    """Say (once per flag, on stderr) which old spellings on the command line have new names; return them.

    Both spellings work for one release; click does not tell which one was typed, so the command line is read.
    """
    words = sys.argv[1:] if argv is None else argv
    used = [old for old in renamed if any(w == old or w.startswith(old + "=") for w in words)]
    for old in used:
        say("deprecated:", f"{old} is now {renamed[old]}; the old name goes in the next release")
    return used


def fail(message: object, code: int = 2) -> typer.Exit:
    """Print ``message`` as a one-line error and return the exit to raise (2: bad input)."""

    tabled = isinstance(message, (MissingVariablesError, UnsupportedTaskError))  # one line per task
    text = " ".join(str(message).split()) if code == 2 and not tabled else str(message)
    say("error:", text, "bold red")
    return typer.Exit(code)


def parse_indices(text: str | None, name: str = "--indices") -> list[int] | None:
    """``"0,3,-1"`` as integers; exit 2 naming the bad item."""
    if text is None:
        return None
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise fail(f"{name} is empty: give comma-separated task indices such as 0,3")
    picked = []
    for item in items:
        try:
            picked.append(int(item))
        except ValueError:
            raise fail(f"{name}: {item!r} is not an integer (give comma-separated task indices such as 0,3)") from None
    return picked


def parse_kwargs(pairs: list[str] | None, name: str = "--ek") -> dict[str, Any]:
    """``key=value`` pairs as Harbor's CLI reads them: JSON values (numbers, booleans, lists), else text."""
    result: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise fail(f"{name} {pair!r}: expected key=value")
        if value in ("True", "False"):
            result[key] = value == "True"
            continue
        try:
            result[key] = json.loads(value)
        except ValueError:
            result[key] = value
    return result


def checked_backend(name: str, options: dict[str, Any]):
    """The backend ``name`` (class loaded), having refused options it does not take; else exit 2 in one line."""

    try:
        spec = resolve_backend(name)
        spec.check_options(options)
    except HarborAsyncError as exc:
        raise fail(exc) from None
    return spec


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure logging for a command: the flag, else the environment variable, else the default; exit 2 if bad."""

    try:
        configure_logging(level, fmt, force=True)
    except LogSettingError as exc:
        raise fail(exc) from None


#: ``--strict-verify``, shared by ``run`` and ``eval``.
StrictVerifyOpt = Annotated[
    bool,
    typer.Option(
        "--strict-verify/--no-strict-verify",
        help="End every process the agent left running before the verifier starts, so that it runs alone "
        "(default; local: a new PID namespace, docker: the main container restarted, files kept). "
        "--no-strict-verify: they keep running, as in Harbor, for tests that check a service the agent started.",
    ),
]


#: ``--episode-disk-limit-mb`` and ``--job-disk-limit-mb``, shared by ``run`` and ``eval``.
EpisodeDiskLimitOpt = Annotated[
    int | None,
    typer.Option(
        "--episode-disk-limit-mb", min=1, show_default="2048",
        help="MiB one episode may copy to the host (logs, artifacts, verifier output; sparse files count in full). "
        "Past it the episode is the agent's (or verifier's) failure, reward 0.",
    ),
]
JobDiskLimitOpt = Annotated[
    int | None,
    typer.Option(
        "--job-disk-limit-mb", min=1, show_default="51200",
        help="MiB the job folder may hold: the download that passes it stops the job (exit 1), resumable.",
    ),
]


def say_refused(refusals: Any, backend: str | None = None) -> None:
    """The tasks a run leaves out, one line each, before anything starts (``run`` and ``eval``; the rest runs)."""
    where = f" on -e {backend}" if backend else ""
    lines = "\n".join("  " + r.line() for r in refusals)
    say("refused:", f"{len({r.task for r in refusals})} task(s) cannot be run as written{where}; the rest runs:\n{lines}", "bold red")


def say_refused_at_end(tasks: int) -> None:
    """The last word of a run that left tasks out (its exit status is 1)."""
    say("refused:", f"{tasks} task(s) were not run (listed at the start and in summary.json)", "bold red")
