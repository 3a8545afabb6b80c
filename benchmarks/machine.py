"""A description of the machine and software a benchmark ran on, for its JSON file."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from datetime import UTC, datetime

PACKAGES = ("harbor-async", "harbor", "trl", "anyio", "torch", "transformers")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict:
    """CPU, memory, OS, Python and package versions, and the time of the run."""
    import psutil

    return {
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "packages": {name: _version(name) for name in PACKAGES},
    }
