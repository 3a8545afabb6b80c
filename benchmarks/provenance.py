"""How a benchmark result came to be: commit, command line and settings, machine, load before and after.

Every result file written under ``benchmarks/results/`` or ``--out`` carries
this block (:func:`provenance`), so a figure can be traced to the code that made
it and judged against how busy the machine was. The load before the run is a
snapshot taken when this module is imported (the benchmark's first import) or
when :func:`begin` is called at the start of a command, whichever is later.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.machine import describe_machine

REPO = Path(__file__).resolve().parents[1]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


_started: dict = {"time": _now(), "load": _load()}


def begin() -> None:
    """Mark the start of a benchmark run: the time and the load average it starts under."""
    _started.update(time=_now(), load=_load())


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def command_line(argv: list[str] | None = None) -> str:
    """``argv`` shell-quoted as the user typed it: ``harbor-async bench ...`` or ``python -m benchmarks.X ...``."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    head = Path(argv[0])
    # `python -m harbor_async` and the installed script both are `harbor-async` to the user.
    if head.name == "harbor-async" or (head.name == "__main__.py" and head.parent.name == "harbor_async"):
        first = ["harbor-async"]
    elif head.suffix == ".py" and head.resolve().parent == REPO / "benchmarks":
        first = ["python", "-m", f"benchmarks.{head.stem}"]
    else:
        first = [argv[0]]
    return shlex.join(first + argv[1:])


#: Parts of a variable's name that mark a secret: its value is never written into a result file.
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


def settings(environ: Mapping[str, str] | None = None) -> str:
    """The ``HARBOR_ASYNC_*`` variables the run saw, as ``NAME=value`` words (they change what is measured,
    e.g. ``HARBOR_ASYNC_LOCAL_POOL=0``), a secret's value as ``<redacted>``; empty when none is set."""
    environ = os.environ if environ is None else environ
    words = []
    for name, value in sorted(environ.items()):
        if name.startswith("HARBOR_ASYNC_"):
            secret = any(word in name.upper() for word in SECRET_WORDS)
            words.append(f"{name}={'<redacted>' if secret else value}")
    return shlex.join(words)


def working_folder(cwd: Path | None = None) -> str:
    """Where the command ran, relative to the repository (``.``: its root): what its relative paths mean.

    A folder outside the repository is not named: a result file must not carry this machine's paths.
    """
    folder = Path.cwd() if cwd is None else cwd
    try:
        return folder.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return "(outside the repository)"


def provenance(argv: list[str] | None = None) -> dict:
    """The commit (and whether the tree differs from it), the command and the settings it ran with, the start and
    end, the load before and after."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "command": command_line(argv),
        "settings": settings(),
        "cwd": working_folder(),
        "started": _started["time"],
        "finished": _now(),
        "load_before": list(_started["load"]),
        "load_after": _load(),
    }


def stamp(kind: str, results: dict) -> dict:
    """``results`` with the benchmark kind, the machine and the provenance: the one shape of a result file."""
    return {"benchmark": kind, "machine": describe_machine(), "provenance": provenance(), **results}
