"""Task suites bundled with harbor_async as package data.

The ``example`` suite is a set of small Harbor tasks (POSIX sh + coreutils/awk/sed
only) that run on the local bubblewrap backend and in ``debian:bookworm-slim``
images alike. It is the default suite for demos, tests and benchmarks.

Imports: nothing of harbor_async.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["example_suite_path"]

_HERE = Path(__file__).resolve().parent


def example_suite_path() -> Path:
    """Return the root of the bundled example suite (the folder holding ``tasks/``).

    The suite ships inside the package (hatchling includes non-Python files under
    ``harbor_async/``), so this is a real directory on disk for both editable and
    wheel installs; pass it to :func:`harbor_async.tasks.suite.load_suite`.
    """
    root = _HERE / "example"
    if not (root / "tasks").is_dir():  # pragma: no cover - broken install
        raise FileNotFoundError(f"bundled example suite is missing: {root / 'tasks'}")
    return root
