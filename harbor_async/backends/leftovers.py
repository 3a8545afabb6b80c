"""What a sandbox leaves on this machine, and the process facts a reaper judges owners by.

Shared by the reaper (the list/reap policy) and each backend's own cleanup
module (which scans for and removes what that backend creates).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Resource:
    """One thing a sandbox holds: ``kind`` is container, network, volume, image,
    process, folder, trial-dir or compose-dir; ``ref`` its id, name, pid or path."""

    kind: str
    ref: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.ref}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class SandboxInfo:
    """A sandbox found on this machine, with what it holds and who owns it.

    ``owner_alive`` is ``None`` when the owner is unknown (no pid recorded, or
    a pid of another pid namespace).
    """

    backend: str  # "docker", "local" or "trial" (only a trial folder is left)
    id: str
    run_label: str | None
    owner_pid: int | None
    created_at: datetime | None
    owner_alive: bool | None = None
    resources: list[Resource] = field(default_factory=list)
    #: a process of the sandbox has a live parent: its owner runs (whatever pid it recorded)
    owned_by_live_process: bool = field(default=False, repr=False)
    #: the recorded owner pid is of another pid namespace (unknown here)
    foreign_pid: bool = field(default=False, repr=False)

    @property
    def age(self) -> timedelta | None:
        """Time since creation (``None`` if unknown)."""
        if self.created_at is None:
            return None
        return datetime.now(UTC) - self.created_at

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        age = self.age
        return {
            "backend": self.backend,
            "id": self.id,
            "run_label": self.run_label,
            "owner_pid": self.owner_pid,
            "owner_alive": self.owner_alive,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "age_seconds": round(age.total_seconds(), 1) if age is not None else None,
            "resources": [str(r) for r in self.resources],
        }




def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, start time in clock ticks since boot, parent pid) of ``pid``, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19]), int(fields[1])
    except (IndexError, ValueError):
        return None


def parent_pid(pid: int) -> int | None:
    found = proc_stat(pid)
    return None if found is None or found[0] in ("Z", "X") else found[2]


def has_live_parent(pids: Iterable[int]) -> bool:
    """Whether a process among ``pids`` has a live parent outside the group that
    is not init: the sandbox's owner, whatever pid it recorded.

    The owner may have recorded its pid in another pid namespace (a container
    sharing this machine's Docker daemon or /tmp), where the number means
    nothing here; a process it spawned still points at it. A killed owner's
    processes are re-parented to init (``--die-with-parent`` bwraps die with it).
    """
    group = set(pids)
    for pid in group:
        parent = parent_pid(pid)
        if parent is None or parent in group or parent <= 1:
            continue
        if process_start_time(parent) is not None and comm(parent) not in ("systemd", "init", "tini", "docker-init"):
            return True
    return False


def boot_time() -> float:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def process_start_time(pid: int) -> datetime | None:
    """When process ``pid`` started (None if it does not exist or is a zombie)."""
    found = proc_stat(pid)
    if found is None or found[0] in ("Z", "X"):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return datetime.fromtimestamp(boot_time() + found[1] / ticks, UTC)


def started_in_time(started: datetime | None, created_at: datetime | None) -> bool:
    if started is None:
        return False
    # btime has a resolution of one second, Docker's "Created" is exact.
    return created_at is None or started <= created_at + timedelta(seconds=2)


def nested_pids() -> dict[int, list[int]]:
    """pid as seen inside a nested pid namespace -> the pids here of the processes that have it."""
    table: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                for inner in line.split()[2:]:  # the first is the pid here
                    table.setdefault(int(inner), []).append(int(entry.name))
                break
    return table


def owner_alive(
    pid: int | None, created_at: datetime | None, nested: dict[int, list[int]] | None = None
) -> bool | None:
    """Whether ``pid`` still runs the process that created a sandbox at ``created_at``.

    A process that started after the sandbox was created reuses the pid and is
    not the owner. The pid may also have been recorded inside a container (a
    nested pid namespace): a live process that has that pid there and started
    in time counts as the owner too (when in doubt, keep). ``nested``: a
    :func:`nested_pids` table to reuse. ``None``: no pid is known.
    """
    if pid is None:
        return None
    if pid == os.getpid():
        return True
    if started_in_time(process_start_time(pid), created_at):
        return True
    candidates = (nested if nested is not None else nested_pids()).get(pid, [])
    return any(started_in_time(process_start_time(host), created_at) for host in candidates)


def processes() -> Iterable[tuple[int, str, list[str]]]:
    """(pid, state, argv) of every live process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        found = proc_stat(pid)
        if found is None or found[0] in ("Z", "X"):
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if argv:
            yield pid, found[0], argv


def kill(pids: Iterable[int], *, wait: float = 5.0) -> list[int]:
    """SIGKILL each pid (and its process group if it leads one); wait until gone.

    Returns the pids still alive after ``wait`` seconds.
    """
    pids = [p for p in set(pids) if p != os.getpid()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid and pid != os.getpgrp():
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if process_start_time(p) is not None]
    return left




def comm(pid: int) -> str:
    """The command name of ``pid`` ('' if gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""



def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time as Docker or the local marker writes it (nanoseconds allowed)."""
    if not text:
        return None
    text = text.strip()
    text = re.sub(r"(\.\d{6})\d+", r"\1", text)  # Python keeps microseconds
    text = re.sub(r"Z$", "+00:00", text)
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        return None
    if value.year < 1971:  # Docker's zero time: unknown
        return None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def mtime(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except OSError:
        return None


def earliest(*times: datetime | None) -> datetime | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def temp_dirs() -> list[Path]:
    """Where the owner's temporary folders may be: our temp dir, and /tmp (its TMPDIR may differ)."""
    return list(dict.fromkeys(Path(p).resolve() for p in (tempfile.gettempdir(), "/tmp")))


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
