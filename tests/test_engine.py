"""The engine's own logic on the simulated backend, under asyncio and trio."""

from __future__ import annotations

import anyio
import pytest

from harbor_async.backends.simulated import SimulatedEnvironment
from harbor_async.core.errors import (
    AsyncLibraryError,
    BackendError,
    Phase,
    SandboxCancelledError,
    SandboxTimeout,
    StartError,
    StopError,
)
from harbor_async.core.policy import Limits, RetryPolicy, Timeouts
from harbor_async.engine.engine import Engine, EngineClosedError

pytestmark = [pytest.mark.anyio, pytest.mark.range, pytest.mark.uvloop_pass]

FAST_RETRY = RetryPolicy(attempts=3, initial_wait=0.01, max_wait=0.02)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest):
    """Under trio the clock is trio's MockClock, jumping ahead whenever every task waits: the
    simulated backend's latencies and the engine's timeouts then take no wall time, and the
    timings the tests assert are exact, not the machine's."""
    if request.param == "trio":
        from trio.testing import MockClock

        return "trio", {"clock": MockClock(autojump_threshold=0)}
    return request.param


def engine(**kwargs) -> Engine:
    backend_kwargs = kwargs.pop("backend_kwargs", {})
    return Engine(retry=kwargs.pop("retry", FAST_RETRY), backend_kwargs=backend_kwargs, **kwargs)


async def run_batch(eng: Engine, tasks, n: int, *, exec_command: str | None = "true") -> list[float]:
    rewards: list[float] = []

    async def one(i: int) -> None:
        async with eng.sandbox(tasks[i % len(tasks)], "simulated") as sandbox:
            if exec_command:
                await sandbox.exec(exec_command)
            rewards.append((await sandbox.verify()).reward)

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    return rewards


async def test_live_sandbox_limit_is_reached_and_never_exceeded(example_tasks):
    async with engine(
        limits=Limits(live_sandboxes=4),
        backend_kwargs=dict(start_latency=0.02, exec_latency=0.01, stop_latency=0.01),
    ) as eng:
        rewards = await run_batch(eng, example_tasks, 16)
        stats = eng.stats()
    assert rewards == [1.0] * 16
    assert SimulatedEnvironment.peak_live == 4
    assert stats.peak_live == 4
    assert stats.started == 16 and stats.stopped == 16 and stats.live == 0
    assert set(stats.phases) >= {"start", "exec", "verify", "stop"}


async def test_create_rate_is_respected(example_tasks):
    async with engine(limits=Limits(creates_per_second=20)) as eng:
        await run_batch(eng, example_tasks, 8, exec_command=None)
    times = sorted(SimulatedEnvironment.start_times)
    assert len(times) == 8
    # 8 creates at 20/s span 0.35 s; allow one gap (50 ms) of scheduling jitter.
    assert times[-1] - times[0] >= 6 / 20, times


async def test_concurrent_exec_limit(example_tasks):
    async with engine(limits=Limits(concurrent_execs=2), backend_kwargs=dict(exec_latency=0.02)) as eng:
        await run_batch(eng, example_tasks, 8)
    assert SimulatedEnvironment.peak_execs == 2


async def test_transient_start_failures_are_retried(example_tasks):
    async with engine(backend_kwargs=dict(fail_first_starts=2)) as eng:
        async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
            assert sandbox.start_attempts == 3
            assert (await sandbox.verify()).reward == 1.0
        assert eng.stats().retried == 2


async def test_transient_start_failures_give_up_after_the_cap(example_tasks):
    async with engine(backend_kwargs=dict(fail_first_starts=5)) as eng:
        sandbox = eng.launch(example_tasks[0], "simulated")
        with pytest.raises(StartError) as info:
            await sandbox.wait_started()
        await sandbox.stop()
        assert eng.live_sandboxes() == []
    assert info.value.start_attempt == 3
    assert info.value.phase is Phase.START
    assert "SimulatedTransientError" in str(info.value)


async def test_permanent_start_failure_fails_fast(example_tasks):
    async with engine(
        retry=RetryPolicy(attempts=5, initial_wait=5.0),
        backend_kwargs=dict(start_permanent_failure_rate=1.0),
    ) as eng:
        sandbox = eng.launch(example_tasks[0], "simulated")
        with pytest.raises(StartError) as info:
            with anyio.fail_after(2):  # a retry would sleep >= 5 s
                await sandbox.wait_started()
    assert info.value.start_attempt == 1
    assert "SandboxBuildFailedError" in str(info.value)
    assert info.value.task == example_tasks[0].name
    assert info.value.sandbox_id == sandbox.id


async def test_hung_exec_times_out_and_sandbox_is_still_stopped(example_tasks):
    async with engine(backend_kwargs=dict(exec_hang_rate=1.0)) as eng:
        # The guard is a deadline on the test's own clock (MockClock under trio jumps to it):
        # an exec that never times out fails here instead of hanging the suite.
        with anyio.fail_after(30), pytest.raises(SandboxTimeout) as info:
            async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
                assert SimulatedEnvironment.live_now == 1
                await sandbox.exec("sleep forever", timeout=0.2)
        assert eng.live_sandboxes() == []
    assert info.value.phase is Phase.EXEC
    assert info.value.sandbox_id == sandbox.id
    assert "exec timed out" in str(info.value)
    assert SimulatedEnvironment.live_now == 0


async def test_episode_deadline_bounds_every_phase(example_tasks):
    async with engine(backend_kwargs=dict(exec_latency=5.0)) as eng:
        with pytest.raises(SandboxTimeout) as info:
            async with eng.sandbox(example_tasks[0], "simulated", episode_timeout=0.3) as sandbox:
                await sandbox.exec("slow", timeout=60)
    assert info.value.phase is Phase.EXEC
    assert "episode deadline" in str(info.value)


@pytest.mark.slow
async def test_cancelling_a_batch_stops_every_sandbox(example_tasks):
    started = 0

    async with engine(
        limits=Limits(live_sandboxes=6),
        backend_kwargs=dict(start_latency="uniform:0.01:0.2", exec_latency=10.0, stop_latency=0.01),
    ) as eng:

        async def one(i: int) -> None:
            nonlocal started
            async with eng.sandbox(example_tasks[i % len(example_tasks)], "simulated") as sandbox:
                started += 1
                await sandbox.exec("long", timeout=60)

        with anyio.move_on_after(1.5):
            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(one, i)
        # Cancelled mid-batch: some sandboxes were running, others waiting for a slot.
        assert 0 < started < 12
        assert eng.live_sandboxes() == []
        assert eng.stats().live == 0
    assert SimulatedEnvironment.live_now == 0


async def test_closing_the_engine_stops_live_sandboxes(example_tasks):
    async with engine(backend_kwargs=dict(start_latency=0.01)) as eng:
        sandboxes = [eng.launch(t, "simulated") for t in example_tasks[:5]]
        for sandbox in sandboxes:
            await sandbox.wait_started()
        assert SimulatedEnvironment.live_now == 5
    assert SimulatedEnvironment.live_now == 0
    assert all(s.done for s in sandboxes)
    with pytest.raises(EngineClosedError):
        eng.launch(example_tasks[0], "simulated")


async def test_stop_failure_is_reported_and_frees_the_slot(example_tasks):
    async with engine(limits=Limits(live_sandboxes=1), backend_kwargs=dict(stop_failure_rate=1.0)) as eng:
        for task in example_tasks[:2]:  # the second start needs the first one's slot
            async with eng.sandbox(task, "simulated") as sandbox:
                pass
            assert isinstance(sandbox.stop_error, StopError)
        assert eng.stats().stop_failures == 2


async def test_stop_budget_is_enforced_and_shielded(example_tasks):
    async with engine(timeouts=Timeouts(stop=0.2), backend_kwargs=dict(stop_latency=30.0)) as eng:
        with anyio.CancelScope() as scope:
            async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
                scope.cancel()  # cancelling the episode must not skip the teardown
        assert isinstance(sandbox.stop_error, SandboxTimeout)
        assert sandbox.stop_error.phase is Phase.STOP
        assert sandbox.done


async def test_stop_before_start_finished_cancels_the_start(example_tasks):
    async with engine(backend_kwargs=dict(start_latency=30.0)) as eng:
        sandbox = eng.launch(example_tasks[0], "simulated")
        await anyio.sleep(0.05)
        with anyio.fail_after(5):
            await sandbox.stop()
        with pytest.raises(SandboxCancelledError, match="cancelled"):
            await sandbox.wait_started()
        assert eng.live_sandboxes() == []
        stats = eng.stats()
        assert (stats.failed, stats.cancelled) == (0, 1)  # a cancelled start is not a failure


@pytest.mark.parametrize("queued", [False, True])
async def test_stop_right_after_launch_returns_at_once(example_tasks, queued):
    limits = Limits(live_sandboxes=1)
    async with engine(limits=limits, backend_kwargs=dict(start_latency=30.0)) as eng:
        if queued:  # the only slot is taken: the second sandbox waits for it
            blocker = eng.launch(example_tasks[0], "simulated")
            await anyio.sleep(0.05)
        sandbox = eng.launch(example_tasks[0], "simulated")
        began = anyio.current_time()
        await sandbox.stop()
        assert anyio.current_time() - began < 5  # the start it cancelled would have taken 30 s
        assert sandbox.done and eng.stats().failed == 0
        if queued:
            await blocker.stop()


@pytest.mark.slow
async def test_waiters_on_a_start_and_a_stop_all_wake_and_live_sandboxes_share_their_settings(example_tasks):
    async with engine(backend_kwargs=dict(start_latency=0.2, stop_latency=0.2)) as eng:
        sandboxes = [eng.launch(example_tasks[0], "simulated") for _ in range(2)]
        first = sandboxes[0]
        woke: list[str] = []

        async def started() -> None:
            await first.wait_started()
            woke.append("started")

        async def stopped() -> None:
            await first.stop()
            woke.append("stopped")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(2):  # waiting for the start and for a stop at once: each wakes at its own
                    tg.start_soon(started)
                await sandboxes[1].wait_started()
                for _ in range(3):  # the first of these stops it, the others wait for that stop
                    tg.start_soon(stopped)
        assert woke == ["started"] * 2 + ["stopped"] * 3 and first.done
        starting = eng.launch(example_tasks[0], "simulated")
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:  # one stop waits for the start it cancels, one for that stop
                tg.start_soon(starting.stop)
                tg.start_soon(starting.stop)
        assert starting.done
        # Per live sandbox, only what is its own: its budgets and backend are one shared object.
        assert sandboxes[1].timeouts is first.timeouts and sandboxes[1].backend is first.backend


async def test_unknown_backend_is_a_clear_error(example_tasks):
    async with engine() as eng:
        with pytest.raises(BackendError, match="unknown backend 'dockr'"):
            eng.launch(example_tasks[0], "dockr")
        with pytest.raises(BackendError, match="package.module:Class"):
            eng.launch(example_tasks[0], ":Nope")
        with pytest.raises(BackendError, match="cannot be loaded"):
            eng.launch(example_tasks[0], "no_such_module:Env")
        assert eng.live_sandboxes() == []


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_asyncio_only_harbor_backend_under_trio_is_a_clear_error(example_tasks):
    async with engine() as eng:
        with pytest.raises(AsyncLibraryError, match="'docker' runs only on asyncio, not on trio"):
            eng.launch(example_tasks[0], "docker")
        assert eng.live_sandboxes() == []


async def test_waiting_for_a_live_slot_is_bounded(example_tasks):
    async with engine(limits=Limits(live_sandboxes=1), timeouts=Timeouts(slot=0.2)) as eng:
        holder = eng.launch(example_tasks[0], "simulated")
        await holder.wait_started()
        waiter = eng.launch(example_tasks[1], "simulated")
        with pytest.raises(SandboxTimeout, match=r"no live-sandbox slot within 0.2 s \(limit: 1 live"):
            await waiter.wait_started()
        assert waiter.done and holder.state.value == "running"
        await holder.stop()
        assert eng.live_sandboxes() == []


@pytest.mark.anyio
async def test_the_old_name_episode_still_yields_a_started_sandbox_with_a_warning(example_tasks):
    """``Engine.episode()`` is now ``Engine.sandbox()`` (it never ran an episode); the old name warns for one release."""
    async with engine() as eng:
        with pytest.warns(DeprecationWarning, match=r"Engine.episode\(\) is Engine.sandbox\(\)"):
            context = eng.episode(example_tasks[0], "simulated")
        async with context as sandbox:
            assert (await sandbox.exec("true")).exit_code == 0
        assert eng.live_sandboxes() == []  # stopped on the way out, as sandbox() does
