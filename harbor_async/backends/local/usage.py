"""A local sandbox's resource use, read from the kernel's own counters: no process walk, no file-tree walk.

- CPU seconds: ``usage_usec`` of ``cpu.stat`` in the sandbox's cgroup2 folder
  (the unified hierarchy, or on a v1 host its ``unified`` companion, which
  keeps CPU time without any controller); it counts every exec's own group below.
- Peak memory: ``memory.peak`` (v2) or ``memory.max_usage_in_bytes`` (v1); the
  sandbox's tmpfs root is charged to it, as Docker charges a tmpfs.
- Processes: ``pids.peak`` (Linux 6.1; else the current count).
- Disk written: the blocks in use on the sandbox's sized tmpfs root now, less
  those in use when its start was done (``statvfs``).

The counters outlive the processes, so a reading just before the stop covers
the sandbox's whole life, the verifier's run included (a strict verify's new
keeper joins the same cgroups). Without root there are no cgroups and no
tmpfs: nothing is read.
"""

from __future__ import annotations

import os
from pathlib import Path

from harbor_async.backends.local.limits import Cgroups
from harbor_async.core.usage import ResourceUsage, counter, counter_field


def used_bytes(mount: Path | None) -> int | None:
    """Bytes in use on the filesystem mounted at ``mount`` (``None``: no mount, or it cannot be read)."""
    if mount is None:
        return None
    try:
        info = os.statvfs(mount)
    except OSError:
        return None
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def cgroup_usage(cgroups: Cgroups | None, mount: Path | None, disk_at_start: int | None) -> ResourceUsage | None:
    """What the sandbox with ``cgroups`` and its tmpfs root at ``mount`` used so far (blocking: a worker thread's)."""
    if cgroups is None:
        return None
    if cgroups.version == "v2":
        (folder,) = cgroups.folders
        pids_dir = memory_dir = folder
        memory_file = "memory.peak"
    else:
        pids_dir, memory_dir = cgroups.folders[0], cgroups.folders[1]
        memory_file = "memory.max_usage_in_bytes"
    cpu_dir = cgroups.kill_parent or (cgroups.folders[0] if cgroups.version == "v2" else None)
    usage_usec = counter_field(cpu_dir / "cpu.stat", "usage_usec") if cpu_dir is not None else None
    disk = used_bytes(mount)
    return ResourceUsage(
        cpu_seconds=None if usage_usec is None else usage_usec / 1e6,
        memory_peak_bytes=counter(memory_dir / memory_file),
        processes_peak=counter(pids_dir / "pids.peak") or counter(pids_dir / "pids.current"),
        disk_written_bytes=None if disk is None or disk_at_start is None else max(disk - disk_at_start, 0),
        source=f"cgroup {cgroups.version}",
    )

