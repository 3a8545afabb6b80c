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

from harbor_async.core.collector import ENV, PER_SANDBOX, TUNING
from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from harbor_async.engine.loop import LoopThread

pytestmark = [pytest.mark.anyio]

UNLIMITED = Limits(live_sandboxes=None)


@pytest.fixture
def example_task(example_tasks):
    return example_tasks[0]


#: What the tests set before each: CPython 3.12's default thresholds.
DEFAULT = (700, 10, 10)


@pytest.fixture(autouse=True)
def expect():
    """From CPython 3.12's thresholds; returns the thresholds expected with ``n`` more sandboxes counted.

    Relative to the sandboxes counted when the test begins: a shim engine another test left open may
    still hold some (its engines close at exit).
    """
    saved = gc.get_threshold()
    gc.set_threshold(*DEFAULT)
    before = TUNING.live

    def thresholds(n: int, base: tuple[int, int, int] = DEFAULT) -> tuple[int, int, int]:
        young = max(base[0], PER_SANDBOX * (before + n)) if base[0] else 0
        return (young, *base[1:])

    yield thresholds
    gc.set_threshold(*saved)


async def launched(engine: Engine, task, count: int, **kwargs):
    sandboxes = [engine.launch(task, "simulated", **kwargs) for _ in range(count)]
    for sandbox in sandboxes:
        await sandbox.wait_started()
    return sandboxes


async def test_threshold_follows_the_count(example_task, expect) -> None:
    before = TUNING.live
    async with Engine(limits=UNLIMITED) as engine:
        sandboxes = await launched(engine, example_task, 300)
        assert gc.get_threshold() == expect(300) and expect(300)[0] >= 3000
        for sandbox in sandboxes[:150]:
            await sandbox.stop()
        assert gc.get_threshold() == expect(150)
        assert TUNING.live == before + 150
    assert TUNING.live == before
    assert gc.get_threshold() == expect(0)


async def test_sandboxes_waiting_for_a_slot_count_too(example_task, expect) -> None:
    async with Engine(limits=Limits(live_sandboxes=10)) as engine:
        sandboxes = [engine.launch(example_task, "simulated") for _ in range(300)]
        assert gc.get_threshold() == expect(300)  # the ledger's count, before any has a slot
        for sandbox in sandboxes:
            await sandbox.stop()
    assert gc.get_threshold() == expect(0)


async def test_off_with_the_setting(example_task, expect, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    before = TUNING.live
    async with Engine(limits=UNLIMITED) as engine:
        await launched(engine, example_task, 300)
        assert gc.get_threshold() == DEFAULT
        assert TUNING.live == before + 300  # counted all the same: turned on again, the next launch applies it
        monkeypatch.setenv(ENV, "1")
        await launched(engine, example_task, 1)
        assert gc.get_threshold() == expect(301)
    assert gc.get_threshold() == DEFAULT


@pytest.mark.slow
async def test_a_users_thresholds_are_kept(example_task, expect) -> None:
    gc.set_threshold(10**7, 20, 30)
    async with Engine(limits=UNLIMITED) as engine:
        sandboxes = await launched(engine, example_task, 300)
        assert gc.get_threshold() == (10**7, 20, 30)  # already above what 300 sandboxes ask
    assert gc.get_threshold() == (10**7, 20, 30)

    gc.set_threshold(1234, 10, 10)
    async with Engine(limits=UNLIMITED) as engine:
        sandboxes = await launched(engine, example_task, 300)
        assert gc.get_threshold() == expect(300, (1234, 10, 10)) and expect(300)[0] >= 3000
        gc.set_threshold(900, 5, 5)  # someone sets their own meanwhile: it becomes what comes back
        await sandboxes[0].stop()
        assert gc.get_threshold() == expect(299, (900, 5, 5))
    assert gc.get_threshold() == expect(0, (900, 5, 5))


async def test_a_collector_switched_off_stays_off(example_task, expect) -> None:
    gc.set_threshold(0, 10, 10)  # automatic collection off: a larger threshold would turn it back on
    async with Engine(limits=UNLIMITED) as engine:
        await launched(engine, example_task, 300)
        assert gc.get_threshold() == (0, 10, 10)
        gc.set_threshold(*DEFAULT)  # on again: the next launch raises it
        await launched(engine, example_task, 1)
        assert gc.get_threshold() == expect(301)
        gc.set_threshold(0, 10, 10)
    assert gc.get_threshold() == (0, 10, 10)


async def test_failed_stops_leave_the_count(example_task, expect) -> None:
    before = TUNING.live
    async with Engine(limits=UNLIMITED, backend_kwargs={"stop_failure_rate": 1.0}) as engine:
        await launched(engine, example_task, 200)
        assert gc.get_threshold() == expect(200)
    assert TUNING.live == before
    assert gc.get_threshold() == expect(0)


def test_engines_on_two_threads_are_counted_together(example_task, expect) -> None:
    loop = LoopThread(name="collector-test-loop")
    try:
        shared = loop.open_engine(limits=UNLIMITED)

        async def launch_shared():
            return await launched(shared, example_task, 200)

        loop.call(launch_shared)
        seen: list[object] = []

        async def own_engine() -> None:
            async with Engine(limits=UNLIMITED) as engine:
                await launched(engine, example_task, 200)
                seen.append(gc.get_threshold())
                loop.close_engine(shared)  # from this thread: the other engine's sandboxes leave the count
                seen.append(gc.get_threshold())

        def in_thread() -> None:
            try:
                anyio.run(own_engine)
            except BaseException as exc:  # shown by the assertion below, not lost in the thread
                seen.append(exc)

        runner = threading.Thread(target=in_thread)
        runner.start()
        runner.join(120)
        assert not runner.is_alive()
        assert seen == [expect(400), expect(200)] and expect(400)[0] >= 4000
        assert gc.get_threshold() == expect(0)
    finally:
        loop.close()
