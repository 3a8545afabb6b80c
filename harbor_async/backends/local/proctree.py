"""Process trees of execs: find an exec's processes and kill them without touching a recycled pid."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import anyio
from anyio.abc import Process

T = TypeVar("T")


def stat_fields(pid: int) -> tuple[int, int, int]:
    """(parent pid, process group, session) of a host process, from one read of ``/proc/PID/stat``.

    Raises:
        OSError: the process does not exist (any more).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
        # after "pid (comm) ": state, ppid, pgrp, session; comm may hold spaces and parentheses
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[1]), int(fields[2]), int(fields[3])
    except (ValueError, IndexError) as exc:
        raise ProcessLookupError(pid) from exc


def process_table(pids: Iterable[int] | None = None) -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, process group, session) of ``pids`` (default: every host process)."""
    if pids is None:
        pids = (int(name) for name in os.listdir("/proc") if name.isdigit())
    table = {}
    for pid in pids:
        try:
            table[pid] = stat_fields(pid)
        except OSError:
            continue  # ended while listing
    return table


def cgroup_pids(procs_files: Sequence[str]) -> set[int]:
    """The pids in a sandbox's ``cgroup.procs`` files (unreadable ones skipped)."""
    found: set[int] = set()
    for path in procs_files:
        try:
            with open(path) as procs:
                found.update(int(line) for line in procs if line.strip())
        except (OSError, ValueError):
            continue
    return found


def exec_tree(leader: int, table: dict[int, tuple[int, int, int]]) -> set[int]:
    """One exec's processes: its session and process group (``leader`` is the nsenter's pid) and their descendants.

    Safe against recycled pids: a pid stays allocated while any process uses
    it as its session or group, so members found that way are this exec's.
    """
    members = {pid for pid, (_ppid, group, session) in table.items() if leader in (pid, group, session)}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _group, _session) in table.items():
        children[ppid].append(pid)
    pending = list(members)
    while pending:  # `setsid cmd &` leaves the session but stays a descendant while its parent lives
        for child in children.get(pending.pop(), ()):
            if child not in members:
                members.add(child)
                pending.append(child)
    return members


def kill_exec_tree(leader: int, procs_files: Sequence[str] = ()) -> None:
    """Stop, then SIGKILL, every process of one exec but its nsenter (see :func:`exec_tree`).

    Stopping first means nothing can fork away while the tree is collected.
    Each process is signalled through a pidfd, after checking that the pid
    still names a member, so a pid recycled meanwhile is never hit.

    The nsenter itself (``leader``, outside the sandbox) is only continued (it
    stops itself when its child is stopped): it must live to reap its child.
    Killed first, it would hand the child's zombie to the host's init, which
    may never reap it, and a PID namespace cannot end while a zombie of its
    own is left: stopping the sandbox would hang.
    """
    held: dict[int, int] = {}  # pid -> pidfd
    try:
        for _round in range(50):
            # Scoped to the sandbox's own cgroup where it has one: every process an exec makes stays in it (a
            # sandbox cannot move a process out), so a fork bomb's walk is its own 1,024 pids, not the host's table.
            table = process_table({leader} | cgroup_pids(procs_files)) if procs_files else process_table()
            new = exec_tree(leader, table) - held.keys() - {leader}
            if not new:
                break
            for pid in new:
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue
                try:
                    ppid, group, session = stat_fields(pid)
                except (OSError, ValueError, IndexError):
                    os.close(fd)
                    continue
                if leader not in (group, session) and ppid not in held and ppid not in new and ppid != leader:
                    os.close(fd)  # recycled since the listing
                    continue
                held[pid] = fd
                pidfd_signal(fd, signal.SIGSTOP)
        for fd in held.values():
            pidfd_signal(fd, signal.SIGKILL)
    finally:
        for fd in held.values():
            os.close(fd)
    try:
        os.kill(leader, signal.SIGCONT)  # not reaped yet (the caller holds it): not recycled
    except ProcessLookupError:
        pass


async def end_exec(process: Process, procs_files: Sequence[str] = (), kill_group: Path | None = None) -> None:
    """Kill an exec's process tree and wait for its nsenter to exit (it reaps its child, then dies of it).

    Where the exec has a cgroup of its own (``kill_group``, :meth:`.Cgroups.exec_group`), one write
    to its ``cgroup.kill`` ends every process in it at once, forks racing the kill included: nothing
    is walked, however many processes a fork bomb made. Else (or if that write fails) the tree is
    found by walking (:func:`kill_exec_tree`) the sandbox's own processes (``procs_files``: its
    ``cgroup.procs``), or every host process where it has no cgroup (a fork bomb elsewhere makes that
    long): in a worker thread, so the other sandboxes' execs on this loop go on meanwhile.

    Repeated while the nsenter lives: one still entering the namespaces forks
    its child after a round. Past five seconds the nsenter is killed too.
    """
    for _round in range(50):
        # The kernel signals each process within the write: a thread's wait, not the loop's.
        if kill_group is None or not await _off_loop(kill_cgroup, kill_group):
            await _off_loop(kill_exec_tree, process.pid, procs_files)
        with anyio.move_on_after(0.1):
            await process.wait()
        if process.returncode is not None:
            return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    await process.wait()


def kill_cgroup(folder: Path) -> bool:
    """SIGKILL every process in a cgroup2 group (``cgroup.kill``); ``False`` where it cannot be written."""
    try:
        with open(folder / "cgroup.kill", "w") as kill:
            kill.write("1")
    except OSError:
        return False
    return True


async def _off_loop(function: Callable[..., T], *args: object) -> T:
    try:
        return await anyio.to_thread.run_sync(function, *args)
    except RuntimeError:  # no new thread at interpreter shutdown (the exit's stops): on the loop, then
        return function(*args)


def pidfd_signal(fd: int, signum: int) -> None:
    try:
        signal.pidfd_send_signal(fd, signum)
    except (ProcessLookupError, PermissionError):
        pass
