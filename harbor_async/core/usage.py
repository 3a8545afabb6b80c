"""What one sandbox used: CPU time, peak memory, disk written, processes, and its billed seconds.

A backend that can measure its sandboxes gives their environments an async
``resource_usage()`` returning a :class:`ResourceUsage` (the local backend from
the sandbox's cgroups, docker from the daemon); the engine reads it once, just
before the stop, and adds the seconds the sandbox existed (``sandbox_seconds``:
from its create call to its stop's end, failed start attempts included, the
unit providers bill). A figure a backend cannot read is ``None`` and left out
of the record; ``source`` says where the others came from.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

#: A record's ``resources`` figures, in the order reports show them.
RESOURCE_FIELDS = ("sandbox_seconds", "cpu_seconds", "memory_peak_bytes", "disk_written_bytes", "processes_peak")
#: The figures that add up over episodes (the others are peaks: the highest counts).
SUMMED_FIELDS = frozenset({"sandbox_seconds", "cpu_seconds"})


@dataclass(frozen=True)
class ResourceUsage:
    """One sandbox's use of the machine over its life (agent and verifier); ``None``: not measured.

    Attributes:
        cpu_seconds: CPU time of every process of the sandbox, user and system.
        memory_peak_bytes: the most memory the sandbox held at once (its files
            on a tmpfs root included, as the kernel charges them).
        disk_written_bytes: what its writable filesystem grew by (apparent
            size: a sparse file counts in full on docker, by its blocks on local).
        processes_peak: the most processes (threads count on cgroup's ``pids``) at once.
        source: where the figures came from (``"cgroup v1"``, ``"docker daemon"`` ...).
    """

    cpu_seconds: float | None = None
    memory_peak_bytes: int | None = None
    disk_written_bytes: int | None = None
    processes_peak: int | None = None
    source: str | None = None

    def then(self, later: ResourceUsage) -> ResourceUsage:
        """This reading followed by ``later`` of a new set of counters (a restarted container): CPU adds up, peaks
        take the higher, the disk is the later reading's (the same files)."""
        return replace(
            later,
            cpu_seconds=_combine(self.cpu_seconds, later.cpu_seconds, operator.add),
            memory_peak_bytes=_combine(self.memory_peak_bytes, later.memory_peak_bytes, max),
            processes_peak=_combine(self.processes_peak, later.processes_peak, max),
            disk_written_bytes=later.disk_written_bytes if later.disk_written_bytes is not None else self.disk_written_bytes,
            source=later.source or self.source,
        )

    def beside(self, other: ResourceUsage) -> ResourceUsage:
        """This reading and ``other``'s of a container that ran at the same time (a Compose side service): CPU
        and disk add up; so do the peaks, an upper bound (the two need not have peaked at once)."""
        return ResourceUsage(
            cpu_seconds=_combine(self.cpu_seconds, other.cpu_seconds, operator.add),
            memory_peak_bytes=_combine(self.memory_peak_bytes, other.memory_peak_bytes, operator.add),
            disk_written_bytes=_combine(self.disk_written_bytes, other.disk_written_bytes, operator.add),
            processes_peak=_combine(self.processes_peak, other.processes_peak, operator.add),
            source=self.source or other.source,
        )

    def as_record(self, sandbox_seconds: float | None) -> dict[str, Any]:
        """The record's ``resources``: the measured figures only, ``sandbox_seconds`` and ``source`` first."""
        out: dict[str, Any] = {}
        if sandbox_seconds is not None:
            out["sandbox_seconds"] = round(sandbox_seconds, 4)
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None and item.name != "source":
                out[item.name] = round(value, 4) if isinstance(value, float) else value
        out["source"] = self.source
        return out


def _combine(a: Any, b: Any, both: Callable[[Any, Any], Any]) -> Any:
    """``both(a, b)``, or the one of them that was measured (``None``: neither was)."""
    return b if a is None else a if b is None else both(a, b)


def counter(path: Path) -> int | None:
    """The first number in a counter file (``None``: missing or not a number)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def counter_field(path: Path, name: str) -> int | None:
    """The value of ``name`` in a ``key value`` counter file such as ``cpu.stat``."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None
