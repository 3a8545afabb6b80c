"""A sandbox phase (harbor_async.engine.phase_scope): fail_after's semantics, typed errors, stats and logs, under asyncio and trio."""

from __future__ import annotations

import logging

import anyio
import pytest

from harbor_async.core.errors import ExecError, Phase, SandboxTimeout
from harbor_async.core.logs import ROOT_LOGGER
from harbor_async.engine.engine import Engine

pytestmark = [pytest.mark.anyio, pytest.mark.uvloop_pass]

#: uvloop's clock is libuv's, in whole milliseconds: a phase that ran its whole budget can read a hair under it.
CLOCK_TICK = 0.001


class _Events(logging.Handler):
    """Keeps the event dicts the library logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(record.event_dict)


@pytest.fixture
def events():
    logger = logging.getLogger(ROOT_LOGGER)
    handler, level = _Events(), logger.level
    logger.addHandler(handler)
    yield handler, logger
    logger.removeHandler(handler)
    logger.setLevel(level)


async def test_a_phase_past_its_budget_is_a_typed_timeout_recorded_as_a_failure(example_tasks, events):
    handler, logger = events
    logger.setLevel(logging.WARNING)
    async with Engine(backend_kwargs={"exec_hang_rate": 1.0}) as eng:
        async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
            with anyio.fail_after(30), pytest.raises(SandboxTimeout) as info:
                await sandbox.exec("hang", timeout=0.2)
            exec_stats = eng.stats().phases["exec"]
    assert info.value.phase is Phase.EXEC and isinstance(info.value.__cause__, TimeoutError)
    assert (exec_stats.count, exec_stats.failures) == (1, 1)
    assert exec_stats.max >= 0.2 - CLOCK_TICK and sandbox.times.seconds["exec"] >= 0.2 - CLOCK_TICK
    phases = [e for e in handler.events if e.get("event") == "phase"]
    assert [(e["level"], e["phase"], e["outcome"]) for e in phases] == [("warning", "exec", "timeout")]


async def test_an_unwrapped_phase_lets_the_bare_timeout_through_and_its_body_errors_are_typed(example_tasks):
    async with Engine() as eng:
        async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
            with anyio.fail_after(30), pytest.raises(TimeoutError) as bare:
                async with sandbox.bounded_phase(Phase.AGENT, budget=0.1, wrap=False):
                    await anyio.sleep(10)
            assert not isinstance(bare.value, SandboxTimeout)
            with pytest.raises(ExecError) as typed:
                async with sandbox.bounded_phase(Phase.AGENT, budget=5.0):
                    raise ValueError("the agent broke")
            async with sandbox.bounded_phase(Phase.AGENT, budget=5.0) as seconds:
                await anyio.sleep(0.05)
                assert seconds() >= 0.05 - CLOCK_TICK
            agent_stats = eng.stats().phases["agent"]
    assert isinstance(typed.value.__cause__, ValueError) and "the agent broke" in str(typed.value)
    assert (agent_stats.count, agent_stats.failures) == (3, 2)


async def test_a_typed_error_through_a_phase_keeps_its_own_cause(example_tasks):
    async with Engine() as eng:
        async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
            with pytest.raises(ExecError) as typed:
                async with sandbox.bounded_phase(Phase.AGENT, budget=5.0):
                    async with sandbox.bounded_phase(Phase.AGENT, budget=5.0):
                        raise ValueError("the inner phase broke")
    # The outer phase passes the inner one's typed error on as it is: not chained to itself.
    assert typed.value.__cause__ is not typed.value and isinstance(typed.value.__cause__, ValueError)


async def test_a_cancelled_phase_is_not_a_failure_and_a_finished_one_logs_at_debug_only(example_tasks, events):
    handler, logger = events
    logger.setLevel(logging.DEBUG)
    async with Engine(backend_kwargs={"exec_latency": 10.0}) as eng:
        async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
            with anyio.move_on_after(0.1):  # the caller gives up: no failure, no timeout
                await sandbox.exec("slow", timeout=60)
            exec_stats = eng.stats().phases.get("exec")
    assert exec_stats is None  # a cancelled phase is not recorded
    phases = [e for e in handler.events if e.get("event") == "phase" and e["phase"] == "exec"]
    assert [(e["level"], e["outcome"]) for e in phases] == [("debug", "cancelled")]
    assert phases[0]["sandbox"] == sandbox.id and phases[0]["start_attempt"] == 1


#: The deadline buckets are asyncio's (under trio a phase arms its deadline at once): these run on asyncio only.
asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


@asyncio_only
async def test_a_long_exec_budget_puts_no_timer_on_the_loop(example_tasks, monkeypatch):
    import asyncio

    from harbor_async.engine.phase_scope import waiting_phases

    loop = asyncio.get_running_loop()
    deadline_timers = []  # the timers a cancel scope arms for its deadline (anyio's CancelScope._timeout)
    call_at = loop.call_at

    def counting_call_at(when, callback, *args, **kwargs):
        if getattr(callback, "__name__", "") == "_timeout":
            deadline_timers.append(when)
        return call_at(when, callback, *args, **kwargs)

    async with Engine(backend_kwargs={"exec_latency": 0.01}) as eng:
        async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
            monkeypatch.setattr(loop, "call_at", counting_call_at)
            for _ in range(30):  # each under the default 180 s budget, each done long before it
                await sandbox.exec("true")
            monkeypatch.undo()
            armed = len(deadline_timers)
            async with anyio.create_task_group() as tg:
                tg.start_soon(sandbox.exec, "true")
                await anyio.sleep(0.001)
                waiting = waiting_phases(loop)  # the exec in flight waits in a bucket, with no timer of its own
            after = waiting_phases(loop)
    # Armed at once, every exec would arm a 180 s timer (and cancel it, leaving it on asyncio's heap): 30 of them.
    assert armed == 0
    assert (waiting, after) == (1, 0)


@asyncio_only
async def test_a_long_phase_armed_by_its_bucket_still_times_out_on_its_deadline(example_tasks, monkeypatch):
    import asyncio

    from harbor_async.engine import phase_scope

    monkeypatch.setattr(phase_scope, "ARM_AHEAD", 0.1)  # 0.5 s is then a long budget, in a bucket
    loop = asyncio.get_running_loop()
    async with Engine(backend_kwargs={"exec_hang_rate": 1.0}) as eng:
        async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
            seen = []

            async def watch() -> None:
                await anyio.sleep(0.05)
                seen.append(phase_scope.waiting_phases(loop))

            begin = anyio.current_time()
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                with anyio.fail_after(30), pytest.raises(SandboxTimeout) as info:
                    await sandbox.exec("hang", timeout=0.5)
            took = anyio.current_time() - begin
    assert seen == [1]  # it waited in a bucket ...
    assert 0.5 <= took < 5  # ... and still timed out at its own deadline, as a typed timeout
    assert isinstance(info.value.__cause__, TimeoutError) and phase_scope.waiting_phases(loop) == 0


@pytest.mark.slow
async def test_execs_that_end_timed_out_or_cancelled_leave_no_garbage_for_the_cycle_collector(example_tasks):
    # At 10,000 live sandboxes the loop thread's time goes to CPython's full collections: an exec must
    # free what it made by reference counting, its typed timeout (frames, tracebacks, scopes) included.
    import gc

    async with Engine(backend_kwargs={"exec_latency": 0.02}) as eng:
        async with eng.sandbox(example_tasks[0], "simulated") as sandbox:
            outcomes = {"ok": 0, "timeout": 0, "cancelled": 0}

            async def execs() -> None:
                for _ in range(5):
                    await sandbox.exec("true")  # a long budget: its deadline waits in a bucket
                    outcomes["ok"] += 1
                    try:
                        await sandbox.exec("true", timeout=0.005)  # its own timer, then a typed timeout
                    except SandboxTimeout:  # not pytest.raises: its ExceptionInfo would keep a cycle of its own
                        outcomes["timeout"] += 1
                    with anyio.move_on_after(0.005) as scope:  # the caller gives up
                        await sandbox.exec("true")
                    outcomes["cancelled"] += scope.cancelled_caught

            await execs()  # first calls fill caches
            gc.collect()
            gc.disable()
            try:
                await execs()
                found = gc.collect()
            finally:
                gc.enable()
    assert outcomes == {"ok": 10, "timeout": 10, "cancelled": 10}
    assert found == 0
