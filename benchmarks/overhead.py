"""Engine overhead on the simulated backend with zero latency.

- Portal round trip: one exec through the loop thread from another thread (what
  every shim tool call does) against the same exec awaited on the loop, beside
  asyncio's own thread hand-off of a no-op coroutine onto the same loop (no
  engine code: the machine's floor for any hand-off, measured in the same run).
- Capacity: the largest number of live simulated sandboxes one loop thread
  holds, each with an agent issuing about one exec per second, while a probe
  call through the portal from another thread (as a trainer's) stays under the
  bound **at its p99** (20 ms by default; the p50 is recorded beside it): a
  median hides the stalls a trainer waits on. Each size also records why it
  held or missed: how busy the loop thread was during the probe window and
  the collector's pauses there (:mod:`benchmarks.window`).
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
from dataclasses import asdict, dataclass, field

import anyio

from benchmarks.window import UsageWindow
from harbor_async.core.policy import Limits
from harbor_async.core.stats import percentile
from harbor_async.engine.loop import LoopThread
from harbor_async.engine.sandbox import Sandbox
from harbor_async.tasks.suite import load_suite

#: The probe's p99 bound (µs) and the live-sandbox counts the capacity ramp tries, smallest first.
DEFAULT_BOUND_US = 20_000.0
DEFAULT_SIZES = (1000, 2000, 4000, 8000, 10000, 12000, 16000)
#: Seconds to stop one step's sandboxes: past the loop's ceiling, stopping 16,000 takes longer than an exit's budget.
TEARDOWN_S = 600.0


@dataclass
class RoundTrip:
    """Latency of one exec, in microseconds."""

    calls: int
    direct_p50_us: float
    direct_p99_us: float
    portal_p50_us: float
    portal_p99_us: float
    overhead_p50_us: float
    overhead_p99_us: float
    #: asyncio's bare ``run_coroutine_threadsafe`` of a no-op coroutine, waited for from this thread.
    floor_p50_us: float = 0.0
    floor_p99_us: float = 0.0


@dataclass
class CapacityStep:
    """The probe's portal latency with ``sandboxes`` live sandboxes under load."""

    sandboxes: int
    probe_p50_us: float
    probe_p99_us: float
    under_bound: bool
    #: During the probe window: the loop thread's CPU seconds per second, and CPython's collections
    #: (how many, the longest pause, how many paused longer than the bound).
    loop_busy: float = 0.0
    collections: int = 0
    longest_collection_ms: float = 0.0
    collections_over_bound: int = 0
    #: CPython's young-generation threshold during the window (raised with the live count: harbor_async.core.collector).
    young_threshold: int = 0


@dataclass
class OverheadResult:
    """Round trip and capacity figures."""

    round_trip: RoundTrip
    capacity: list[CapacityStep] = field(default_factory=list)
    bound_us: float = DEFAULT_BOUND_US
    max_sandboxes_under_bound: int = 0
    bound_percentile: str = "p99"
    #: The loop thread's event loop class, ``module.Class`` (e.g. ``asyncio.unix_events._UnixSelectorEventLoop``).
    event_loop: str = ""

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)


NO_LIMITS = Limits(live_sandboxes=None)


def _us(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1e6, 1)


def _start_probe(loop: LoopThread, task) -> Sandbox:
    engine = loop.open_engine(limits=NO_LIMITS)

    async def launch() -> Sandbox:
        return engine.launch(task, "simulated")

    sandbox = loop.call(launch)
    loop.call(sandbox.wait_started)
    return sandbox


def _time_portal_calls(loop: LoopThread, probe: Sandbox, calls: int, pause: float = 0.0) -> list[float]:
    """Seconds of each of ``calls`` execs made through the portal from this thread."""
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        loop.call(probe.exec, "true")
        times.append(time.perf_counter() - begin)
        if pause:
            time.sleep(pause)
    return times


def measure_round_trip(loop: LoopThread, probe: Sandbox, calls: int) -> RoundTrip:
    """Time ``calls`` execs awaited on the loop and ``calls`` made through the portal."""

    async def direct() -> list[float]:
        times = []
        for _ in range(calls):
            begin = time.perf_counter()
            await probe.exec("true")
            times.append(time.perf_counter() - begin)
        return times

    async def noop() -> None:
        return None

    aio_loop = loop._aio_loop  # the asyncio loop under the portal (LoopThread's default backend)
    assert aio_loop is not None

    def bare() -> list[float]:
        times = []
        for _ in range(calls):
            begin = time.perf_counter()
            asyncio.run_coroutine_threadsafe(noop(), aio_loop).result()
            times.append(time.perf_counter() - begin)
        return times

    for _ in range(50):  # warm up both paths
        loop.call(probe.exec, "true")
    direct_times = loop.call(direct)
    portal_times = _time_portal_calls(loop, probe, calls)
    floor_times = bare()
    return RoundTrip(
        calls=calls,
        direct_p50_us=_us(direct_times, 50),
        direct_p99_us=_us(direct_times, 99),
        portal_p50_us=_us(portal_times, 50),
        portal_p99_us=_us(portal_times, 99),
        overhead_p50_us=round(_us(portal_times, 50) - _us(direct_times, 50), 1),
        overhead_p99_us=round(_us(portal_times, 99) - _us(direct_times, 99), 1),
        floor_p50_us=_us(floor_times, 50),
        floor_p99_us=_us(floor_times, 99),
    )


def measure_capacity(
    loop: LoopThread,
    probe: Sandbox,
    tasks,
    sizes: list[int],
    probe_calls: int = 300,
    bound_us: float = 20_000.0,
    engine_kwargs: dict | None = None,
) -> list[CapacityStep]:
    """For each size, hold that many live sandboxes under agent-like load and probe the portal; stop at the first miss.

    ``engine_kwargs``: more arguments of each size's engine (the cluster benchmark's Ray budget).
    """
    async def loop_thread_id() -> int:
        return threading.get_ident()

    loop_ident = loop.call(loop_thread_id)
    steps = []
    for size in sizes:
        engine = loop.open_engine(
            limits=NO_LIMITS, backend_kwargs={"exec_latency": "uniform:0.01:0.05"}, **(engine_kwargs or {})
        )

        async def launch_all() -> list[Sandbox]:
            sandboxes = [engine.launch(tasks[i % len(tasks)], "simulated") for i in range(size)]
            for sandbox in sandboxes:
                await sandbox.wait_started()
            return sandboxes

        sandboxes = loop.call(launch_all)

        async def load(done: list) -> None:
            event = anyio.Event()
            done.append(event)

            async def agent(sandbox: Sandbox, seed: int) -> None:
                rng = random.Random(seed)
                while not event.is_set():
                    await anyio.sleep(rng.uniform(0.5, 1.5))  # the model thinking
                    await sandbox.exec("true")

            async with anyio.create_task_group() as tg:
                for i, sandbox in enumerate(sandboxes):
                    tg.start_soon(agent, sandbox, i)
                await event.wait()
                tg.cancel_scope.cancel()

        handle: list = []  # the stop event, created on the loop
        future = loop.submit(load, handle)
        time.sleep(1.5)  # let the agents spread out
        with UsageWindow(loop_ident, bound_us / 1e6) as window:
            times = _time_portal_calls(loop, probe, probe_calls, pause=0.002)
        young = gc.get_threshold()[0]  # read before the sandboxes' stop gives the earlier one back
        loop.call(handle[0].set)
        future.result(60)
        loop.close_engine(engine, timeout=TEARDOWN_S)
        usage = window.usage
        step = CapacityStep(
            size, _us(times, 50), _us(times, 99), _us(times, 99) <= bound_us,  # judged on the tail
            usage.busy, usage.collections, usage.longest_collection_ms, usage.collections_over_bound, young,
        )  # fmt: skip
        steps.append(step)
        if not step.under_bound:
            break
    return steps


def run_overhead(
    calls: int = 2000, sizes: list[int] | None = None, suite: str | None = None, bound_us: float = 20_000.0
) -> OverheadResult:
    """Measure the portal round trip and the loop thread's capacity under a probe bound of ``bound_us`` (p99)."""
    sizes = sizes or list(DEFAULT_SIZES)
    tasks = load_suite(suite).tasks
    loop = LoopThread(name="bench-loop")
    try:
        probe = _start_probe(loop, tasks[0])
        aio_loop = type(loop._aio_loop)
        round_trip = measure_round_trip(loop, probe, calls)
        capacity = measure_capacity(loop, probe, tasks, sizes, bound_us=bound_us)
    finally:
        loop.close()
    held = [s.sandboxes for s in capacity if s.under_bound]
    return OverheadResult(
        round_trip, capacity, bound_us, max(held, default=0), event_loop=f"{aio_loop.__module__}.{aio_loop.__qualname__}"
    )
