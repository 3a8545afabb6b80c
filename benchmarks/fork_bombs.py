"""Fork bombs killed while other sandboxes exec (issue 44): does one sandbox's kill stall the others?

On the local backend, some sandboxes (the probes) run ``true`` one exec after
another while the others (the bombers) run a fork bomb under an exec timeout,
again and again: each bomb grows to its sandbox's pids limit, each timeout
ends the exec's process tree (:func:`harbor_async.backends.local.proctree.end_exec`:
one write to the exec's own ``cgroup.kill`` where a cgroup2 hierarchy has one,
else a walk of the sandbox's cgroup), and the next bomb grows again. The
probes' round trips are measured idle (no bomber running) and under the
bombs, in the same run and engine; the figure is the ratio of the two p99s
(target: at most 2x). A control half runs the same bombs, grown before the
window and never killed in it, so that what a grown bomb takes and what the
kill-and-regrow cycle adds are told apart. Each kill is timed too (from the
timeout to the exec's return), and so are, after the windows and mid-bomb,
one walk of the host's whole process table and one of a bomber's cgroup
(what a kill would read where no ``cgroup.kill`` exists).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio

from harbor_async.backends.local.proctree import cgroup_pids, process_table
from harbor_async.core.errors import SandboxTimeout
from harbor_async.core.policy import Limits
from harbor_async.core.stats import percentile
from harbor_async.engine.engine import Engine
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_suite, load_task

#: Each bomb forks until the sandbox's pids limit (1,024 on local), then the timeout ends it. The exec's
#: shell becomes a sleep (no fork needed) so that the exec lasts until its timeout: a shell that exited at
#: once would leave its bomb running in the background, never killed, and the next bomb nothing to grow into.
FORK_BOMB = "bomb() { bomb | bomb & }; bomb; exec sleep 1000"


@dataclass
class ForkBombRound:
    """One round: the probes' exec round trips idle and under bombs (ms), the kills (s)."""

    idle_p50_ms: float
    idle_p99_ms: float
    bombed_p50_ms: float
    bombed_p99_ms: float
    p99_ratio: float
    unkilled_p99_ms: float  # the control: the same bombs running through the window, none killed in it
    unkilled_ratio: float
    probe_execs_idle: int
    probe_execs_bombed: int
    kills: int
    bombs_ended_early: int  # bomb execs that returned before their timeout (each should be ended by it)
    kill_p50_s: float
    kill_max_s: float
    table_walk_ms: float  # one walk of the host's whole process table while the bombs run
    host_processes: int  # how many that walk found
    cgroup_walk_ms: float  # one walk of a bomber's own cgroup (what a kill reads where the sandbox has cgroups)
    cgroup_processes: int  # how many that walk found (0: no cgroups here, kills walk the host's table)


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 2)


async def _probe(sandbox, until: float, into: list[float]) -> None:
    while time.monotonic() < until:
        begin = time.perf_counter()
        await sandbox.exec("true")
        into.append(time.perf_counter() - begin)


async def _bomb(sandbox, until: float, timeout: float, kills: list[float], early: list[float]) -> None:
    while time.monotonic() < until:
        begin = time.perf_counter()
        try:
            await sandbox.exec(FORK_BOMB, timeout=timeout)
        except SandboxTimeout:
            kills.append(time.perf_counter() - begin - timeout)
        else:  # ended before its timeout: no kill, and a bomb perhaps left behind
            early.append(time.perf_counter() - begin)


def _task_with_cpus(folder: Path, cpus: float):
    """The bundled suite's first task, copied into ``folder`` with the task's ``cpus`` set (the bombers' share)."""
    source = load_suite(example_suite_path()).tasks[0]
    target = folder / source.name
    shutil.copytree(source.paths.task_dir, target)
    toml = target / "task.toml"
    toml.write_text(toml.read_text().replace("[environment]\n", f"[environment]\ncpus = {cpus}\n", 1))
    return load_task(target)


async def run_round(
    *,
    probes: int = 2,
    bombers: int = 2,
    seconds: float = 6.0,
    timeout: float = 1.0,
    bomber_cpus: float = 0.5,
    bomber_pids: int | None = None,
) -> ForkBombRound:
    """Start ``probes + bombers`` local sandboxes; time the probes idle, then beside the bombers.

    The bombers' task asks for ``bomber_cpus`` CPUs (enforced by the sandbox's cgroup, as root): what a bomb
    takes from the others is then its share, and what is left to measure is the cost of ending it.
    """
    task = load_suite(example_suite_path()).tasks[0]
    with tempfile.TemporaryDirectory() as scratch:
        bomber_task = _task_with_cpus(Path(scratch), bomber_cpus)
        options = {"pids_limit": bomber_pids} if bomber_pids else None
        return await _measure(task, bomber_task, options, probes, bombers, seconds, timeout)


async def _walk_mid_bomb(bombing: list, timeout: float) -> list[tuple[float, int]]:
    """Mid-bomb, outside every measured window: one walk of the host's whole process table, one of a bomber's cgroup.

    A walk holds the GIL for its length (about 0.1 s here), so timed inside a probe window
    it would stall the loop thread it is meant to be compared with.
    """
    walks: list[tuple[float, int]] = []
    async with anyio.create_task_group() as bombs:
        bombs.start_soon(_bomb, bombing[0], time.monotonic() + timeout, 2 * timeout, [], [])
        await anyio.sleep(timeout * 0.8)
        begin = time.perf_counter()
        table = await anyio.to_thread.run_sync(process_table)
        walks.append((time.perf_counter() - begin, len(table)))
        procs_files = bombing[0].environment._procs_files()
        begin = time.perf_counter()
        table = await anyio.to_thread.run_sync(lambda: process_table(cgroup_pids(procs_files)) if procs_files else {})
        walks.append((time.perf_counter() - begin, len(table)))
        bombs.cancel_scope.cancel()
    return walks


async def _measure(task, bomber_task, bomber_options, probes: int, bombers: int, seconds: float, timeout: float) -> ForkBombRound:
    async with Engine(limits=Limits(live_sandboxes=probes + bombers)) as engine:
        sandboxes = [engine.launch(task, "local") for _ in range(probes)]
        sandboxes += [engine.launch(bomber_task, "local", backend_kwargs=bomber_options) for _ in range(bombers)]
        for sandbox in sandboxes:
            await sandbox.wait_started()
        probing, bombing = sandboxes[:probes], sandboxes[probes:]
        idle: list[float] = []
        until = time.monotonic() + seconds
        async with anyio.create_task_group() as group:
            for sandbox in probing:
                group.start_soon(_probe, sandbox, until, idle)
        bombed: list[float] = []
        kills: list[float] = []
        early: list[float] = []
        until = time.monotonic() + seconds
        async with anyio.create_task_group() as group:
            for sandbox in bombing:
                group.start_soon(_bomb, sandbox, until, timeout, kills, early)
            for sandbox in probing:
                group.start_soon(_probe, sandbox, until, bombed)
        walks = await _walk_mid_bomb(bombing, timeout)
        # The control: the same bombs, grown before the window and left running through it (no kill, no
        # growth in it), then ended.
        unkilled: list[float] = []
        async with anyio.create_task_group() as bombs:
            for sandbox in bombing:
                bombs.start_soon(_bomb, sandbox, time.monotonic() + 4 * seconds, 4 * seconds, [], [])
            await anyio.sleep(timeout)
            until = time.monotonic() + seconds
            async with anyio.create_task_group() as group:
                for sandbox in probing:
                    group.start_soon(_probe, sandbox, until, unkilled)
            bombs.cancel_scope.cancel()  # the bombs' execs end here, outside the window
        for sandbox in sandboxes:
            await sandbox.stop()
    (walk_s, found), (cgroup_s, in_cgroup) = walks
    return ForkBombRound(
        idle_p50_ms=_ms(idle, 50), idle_p99_ms=_ms(idle, 99), bombed_p50_ms=_ms(bombed, 50),
        bombed_p99_ms=_ms(bombed, 99), p99_ratio=round(percentile(bombed, 99) / percentile(idle, 99), 2),
        unkilled_p99_ms=_ms(unkilled, 99), unkilled_ratio=round(percentile(unkilled, 99) / percentile(idle, 99), 2),
        probe_execs_idle=len(idle), probe_execs_bombed=len(bombed), kills=len(kills), bombs_ended_early=len(early),
        kill_p50_s=round(percentile(kills, 50), 3) if kills else 0.0, kill_max_s=round(max(kills, default=0.0), 3),
        table_walk_ms=round(walk_s * 1e3, 1), host_processes=found, cgroup_walk_ms=round(cgroup_s * 1e3, 1),
        cgroup_processes=in_cgroup,
    )  # fmt: skip


def run_fork_bombs(repeats: int = 3, **options: float | None) -> dict:
    """``repeats`` rounds and the median ratio over them (the figure)."""
    rounds = [anyio.run(lambda: run_round(**options)) for _ in range(repeats)]
    ratios = sorted(r.p99_ratio for r in rounds)
    return {
        "options": {"probes": 2, "bombers": 2, "seconds": 6.0, "timeout": 1.0, "bomber_cpus": 0.5, "bomber_pids": None, **options},
        "rounds": [asdict(r) for r in rounds],
        "p99_ratio": {"median": ratios[len(ratios) // 2], "min": ratios[0], "max": ratios[-1]},
    }
