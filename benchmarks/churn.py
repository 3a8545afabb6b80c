"""Does anything the engine does for one sandbox stall the loop thread the others share? (issue 48, "the loop never blocks")

The engine runs on its loop thread (:class:`~harbor_async.engine.loop.LoopThread`),
as under the shim. A trainer-like thread calls through the portal, one call
after another: an exec of a zero-latency simulated sandbox, so the call's
time is the loop's responsiveness and nothing else (**the probe**). Its round
trips are timed idle, then while real local sandboxes on the same loop churn:

- **starts**: sandboxes started, given one command and stopped, again and again;
- **kills**: execs that start 20 background processes and are ended by their
  timeout (0.3 s): each timeout ends the exec's whole tree;
- **transfers**: a folder of 100 files uploaded into a live sandbox and
  downloaded back, again and again.

The figure is the probe's p99 under churn over its idle p99 (target: at most
2x). A loop that blocked on a process walk, a file-tree walk or a spawn
would show here as the probe's tail; what remains is the two cores' contention
with the sandboxes' own processes. Each round runs on asyncio's loop and on
uvloop (``HARBOR_ASYNC_UVLOOP=1``), the order alternating, so the two are
compared on the same machine state.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio

from harbor_async.core.errors import SandboxTimeout
from harbor_async.core.policy import Limits
from harbor_async.core.stats import percentile
from harbor_async.engine.loop import UVLOOP_VARIABLE, LoopThread
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_suite

#: An exec that leaves 20 processes for its timeout to end.
KILLED = "for i in $(seq 20); do sleep 100 & done; wait"
KILL_TIMEOUT = 0.3
FILES = 100
FILE_BYTES = 4096
#: What churns beside the probe.
KINDS = ("starts", "kills", "transfers")


@dataclass
class ChurnRound:
    """One round on one event loop: the probe's round trips (ms) idle and under churn, and what churned."""

    event_loop: str
    idle_p50_ms: float
    idle_p99_ms: float
    churn_p50_ms: float
    churn_p99_ms: float
    p99_ratio: float
    control_p99_ms: float  # the same churn run by another process (the machine as busy; this loop untouched)
    control_ratio: float
    exec_idle_p99_ms: float  # a local sandbox's `true` through the loop thread (issue 44's round trip)
    exec_churn_p99_ms: float
    exec_p99_ratio: float
    exec_control_p99_ms: float
    exec_control_ratio: float
    probe_calls_idle: int
    probe_calls_churn: int
    starts: int
    kills: int
    transfers: int
    churn_errors: int


def churn_files(scratch: Path) -> Path:
    """The folder the transfers move: :data:`FILES` files of :data:`FILE_BYTES` random bytes."""
    files = scratch / "files"
    files.mkdir()
    for i in range(FILES):
        (files / f"f{i:03d}").write_bytes(os.urandom(FILE_BYTES))
    return files


def _ms(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1e3, 3)


def _probe_calls(loop: LoopThread, probe, seconds: float) -> list[float]:
    times: list[float] = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        begin = time.perf_counter()
        loop.call(probe.exec, "true")
        times.append(time.perf_counter() - begin)
    return times


async def run_churners(
    engine, task, files: Path, until: float, counts: dict[str, int], width: int, kinds: tuple[str, ...] = KINDS
) -> None:
    async def starts() -> None:
        while time.monotonic() < until:
            async with engine.sandbox(task, "local") as sandbox:
                await sandbox.exec("true")
            counts["starts"] += 1

    async def kills(sandbox) -> None:
        while time.monotonic() < until:
            try:
                await sandbox.exec(KILLED, timeout=KILL_TIMEOUT)
            except SandboxTimeout:
                counts["kills"] += 1

    async def transfers(sandbox, index: int) -> None:
        back = files.parent / f"back-{index}"
        while time.monotonic() < until:
            await sandbox.upload(files, f"/tmp/files-{index}")
            await sandbox.download(f"/tmp/files-{index}", back, directory=True)
            counts["transfers"] += 1

    async def guarded(fn, *args) -> None:
        try:
            await fn(*args)
        except Exception:  # counted: the figure is the probe's, whatever a churner met
            counts["errors"] += 1

    live = [engine.launch(task, "local") for _ in range(2 * width)]
    try:
        for sandbox in live:
            await sandbox.wait_started()
        async with anyio.create_task_group() as group:
            for i in range(width):
                if "starts" in kinds:
                    group.start_soon(guarded, starts)
                if "kills" in kinds:
                    group.start_soon(guarded, kills, live[i])
                if "transfers" in kinds:
                    group.start_soon(guarded, transfers, live[width + i], i)
    finally:
        for sandbox in live:
            await sandbox.stop()


def _window(loop: LoopThread, probes: tuple, seconds: float) -> tuple[list[float], list[float]]:
    """Both probes at once for ``seconds``: the loop's (a simulated exec) from this thread, a local exec from another."""
    execs: list[float] = []
    other = threading.Thread(target=lambda: execs.extend(_probe_calls(loop, probes[1], seconds)))
    other.start()
    calls = _probe_calls(loop, probes[0], seconds)
    other.join()
    return calls, execs


def run_round(*, uvloop: bool, seconds: float = 6.0, width: int = 2, kinds: tuple[str, ...] = KINDS) -> ChurnRound:
    """One round: the probes idle for ``seconds``, then beside ``width`` churners of each kind, then beside the
    same churn run by another process (the control)."""
    task = load_suite(example_suite_path()).tasks[0]
    previous = os.environ.get(UVLOOP_VARIABLE)
    os.environ[UVLOOP_VARIABLE] = "1" if uvloop else "0"
    loop = LoopThread(name="bench-churn")
    try:
        engine = loop.open_engine(limits=Limits(live_sandboxes=None))

        async def launch_probes():
            probes = (engine.launch(task, "simulated"), engine.launch(task, "local"))
            for probe in probes:
                await probe.wait_started()
            return probes

        async def loop_kind() -> str:
            import asyncio

            kind = type(asyncio.get_running_loop())
            return f"{kind.__module__}.{kind.__qualname__}"

        probes = loop.call(launch_probes)
        kind = loop.call(loop_kind)
        _window(loop, probes, 1.0)  # warm up
        idle, idle_execs = _window(loop, probes, seconds)
        counts = {"starts": 0, "kills": 0, "transfers": 0, "errors": 0}
        with tempfile.TemporaryDirectory() as scratch:
            files = churn_files(Path(scratch))
            until = time.monotonic() + 1.0 + seconds
            churner = threading.Thread(target=loop.call, args=(run_churners, engine, task, files, until, counts, width, kinds))
            churner.start()
            time.sleep(1.0)  # the churners' sandboxes up and their loops going
            churned, churned_execs = _window(loop, probes, seconds)
            churner.join()
        # The control: the same churn in a process of its own (the machine as busy; this loop and GIL untouched).
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.churn_child", str(1.0 + seconds), str(width), ",".join(kinds)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(1.0)
        elsewhere, elsewhere_execs = _window(loop, probes, seconds)
        control = json.loads(child.communicate(timeout=120 + seconds)[0].strip().splitlines()[-1])
        for probe in probes:
            loop.call(probe.stop)
    finally:
        loop.close(timeout=120)
        if previous is None:
            os.environ.pop(UVLOOP_VARIABLE, None)
        else:
            os.environ[UVLOOP_VARIABLE] = previous

    def ratio(values: list[float], base: list[float]) -> float:
        return round(percentile(values, 99) / percentile(base, 99), 2)

    return ChurnRound(
        event_loop=kind, idle_p50_ms=_ms(idle, 50), idle_p99_ms=_ms(idle, 99), churn_p50_ms=_ms(churned, 50),
        churn_p99_ms=_ms(churned, 99), p99_ratio=ratio(churned, idle),
        control_p99_ms=_ms(elsewhere, 99), control_ratio=ratio(elsewhere, idle),
        exec_idle_p99_ms=_ms(idle_execs, 99), exec_churn_p99_ms=_ms(churned_execs, 99),
        exec_p99_ratio=ratio(churned_execs, idle_execs), exec_control_p99_ms=_ms(elsewhere_execs, 99),
        exec_control_ratio=ratio(elsewhere_execs, idle_execs),
        probe_calls_idle=len(idle), probe_calls_churn=len(churned), starts=counts["starts"], kills=counts["kills"],
        transfers=counts["transfers"], churn_errors=counts["errors"] + control["errors"],
    )  # fmt: skip


def run_churn(repeats: int = 3, seconds: float = 6.0, width: int = 2) -> dict:
    """``repeats`` rounds on each event loop (asyncio and uvloop alternating first); the median ratios."""
    rounds: list[ChurnRound] = []
    for repeat in range(repeats):
        for uv in (False, True) if repeat % 2 == 0 else (True, False):
            rounds.append(run_round(uvloop=uv, seconds=seconds, width=width))
    summary = {}
    for name in sorted({r.event_loop for r in rounds}):
        ratios = sorted(r.p99_ratio for r in rounds if r.event_loop == name)
        mine = [r for r in rounds if r.event_loop == name]

        def median(field: str) -> float:
            return statistics.median(getattr(r, field) for r in mine)

        summary[name] = {
            "p99_ratio_median": ratios[len(ratios) // 2], "p99_ratio_min": ratios[0], "p99_ratio_max": ratios[-1],
            "idle_p99_ms_median": median("idle_p99_ms"), "control_ratio_median": median("control_ratio"),
            "exec_p99_ratio_median": median("exec_p99_ratio"), "exec_idle_p99_ms_median": median("exec_idle_p99_ms"),
            "exec_control_ratio_median": median("exec_control_ratio"),
        }  # fmt: skip
    return {
        "options": {"repeats": repeats, "seconds": seconds, "width": width, "kill_timeout": KILL_TIMEOUT, "files": FILES},
        "rounds": [asdict(r) for r in rounds],
        "summary": summary,
    }
