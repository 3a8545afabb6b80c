"""CPython's young-generation threshold follows the live sandboxes of every engine in the process.

What it buys is measured by ``harbor-async bench overhead`` (docs/benchmarks.md):
with thousands of live sandboxes the collector's pauses, not the loop's CPU,
broke the probe's 20 ms p99. These tests hold the rule itself: the threshold
while sandboxes live, given back when they are gone (a user's own setting
included), shared by engines on two threads, and off on request.
"""

from __future__ import annotations

import gc
import threading

import anyio
import pytest

from harbor_async.collector import ENV, PER_SANDBOX, TUNING
from harbor_async.engine import Engine
from harbor_async.loop import LoopThread
from harbor_async.policy import Limits

pytestmark = [pytest.mark.anyio, pytest.mark.range]

UNLIMITED = Limits(live_sandboxes=None)


@pytest.fixture
def example_task(example_tasks):
    return example_tasks[0]


@pytest.fixture(autouse=True)
def thresholds():
    """Each test starts from CPython's default thresholds, with no sandbox counted, and leaves them so."""
    saved = gc.get_threshold()
    assert TUNING.live == 0, "an earlier test left sandboxes counted"
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


async def launched(engine: Engine, task, count: int, **kwargs):
    sandboxes = [engine.launch(task, "simulated", **kwargs) for _ in range(count)]
    for sandbox in sandboxes:
        await sandbox.wait_started()
    return sandboxes


async def test_threshold_follows_the_live_count(example_task) -> None:
    async with Engine(limits=UNLIMITED) as engine:
        sandboxes = await launched(engine, example_task, 300)
        assert gc.get_threshold() == (300 * PER_SANDBOX, 10, 10)
        for sandbox in sandboxes[:150]:
            await sandbox.stop()
        assert gc.get_threshold() == (150 * PER_SANDBOX, 10, 10)
        assert TUNING.live == 150
    assert TUNING.live == 0
    assert gc.get_threshold() == (700, 10, 10)


async def test_few_sandboxes_change_nothing(example_task) -> None:
    async with Engine(limits=UNLIMITED) as engine:
        await launched(engine, example_task, 700 // PER_SANDBOX)
        assert gc.get_threshold() == (700, 10, 10)


async def test_off_with_the_setting(example_task, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    async with Engine(limits=UNLIMITED) as engine:
        await launched(engine, example_task, 300)
        assert gc.get_threshold() == (700, 10, 10)
        assert TUNING.live == 300  # counted all the same: turning it on again applies at once
        monkeypatch.setenv(ENV, "1")
        await launched(engine, example_task, 1)
        assert gc.get_threshold()[0] == 301 * PER_SANDBOX
    assert gc.get_threshold() == (700, 10, 10)


async def test_a_users_thresholds_are_kept(example_task) -> None:
    gc.set_threshold(50_000, 20, 30)
    async with Engine(limits=UNLIMITED) as engine:
        sandboxes = await launched(engine, example_task, 300)
        assert gc.get_threshold() == (50_000, 20, 30)  # already above what 300 sandboxes ask
    assert gc.get_threshold() == (50_000, 20, 30)

    gc.set_threshold(1234, 10, 10)
    async with Engine(limits=UNLIMITED) as engine:
        sandboxes = await launched(engine, example_task, 300)
        assert gc.get_threshold()[0] == 3000
        gc.set_threshold(900, 5, 5)  # someone sets their own meanwhile: it becomes what comes back
        await sandboxes[0].stop()
        assert gc.get_threshold() == (299 * PER_SANDBOX, 5, 5)
    assert gc.get_threshold() == (900, 5, 5)


async def test_failed_stops_leave_the_count(example_task) -> None:
    async with Engine(limits=UNLIMITED, backend_kwargs={"stop_failure_rate": 1.0}) as engine:
        await launched(engine, example_task, 200)
        assert gc.get_threshold()[0] == 200 * PER_SANDBOX
    assert TUNING.live == 0
    assert gc.get_threshold() == (700, 10, 10)


def test_engines_on_two_threads_are_counted_together(example_task) -> None:
    loop = LoopThread(name="collector-test-loop")
    try:
        shared = loop.open_engine(limits=UNLIMITED)

        async def launch_shared():
            return await launched(shared, example_task, 200)

        loop.call(launch_shared)
        seen: list[tuple[int, int, int]] = []

        async def own_engine() -> None:
            async with Engine(limits=UNLIMITED) as engine:
                await launched(engine, example_task, 200)
                seen.append(gc.get_threshold())
                loop.close_engine(shared)  # from this thread: the other engine's sandboxes leave the count
                seen.append(gc.get_threshold())

        runner = threading.Thread(target=anyio.run, args=(own_engine,))
        runner.start()
        runner.join(60)
        assert seen == [(400 * PER_SANDBOX, 10, 10), (200 * PER_SANDBOX, 10, 10)]
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        loop.close()
