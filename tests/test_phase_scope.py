"""A sandbox phase (harbor_async.phase_scope): fail_after's semantics, typed errors, stats and logs, under asyncio and trio."""

from __future__ import annotations

import logging

import anyio
import pytest

from harbor_async.engine import Engine
from harbor_async.errors import ExecError, Phase, SandboxTimeout
from harbor_async.logs import ROOT_LOGGER

pytestmark = pytest.mark.anyio


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
        async with eng.episode(example_tasks[0], "simulated") as sandbox:
            with anyio.fail_after(30), pytest.raises(SandboxTimeout) as info:
                await sandbox.exec("hang", timeout=0.2)
            exec_stats = eng.stats().phases["exec"]
    assert info.value.phase is Phase.EXEC and isinstance(info.value.__cause__, TimeoutError)
    assert (exec_stats.count, exec_stats.failures) == (1, 1)
    assert exec_stats.max >= 0.2 and sandbox.times.seconds["exec"] >= 0.2
    phases = [e for e in handler.events if e.get("event") == "phase"]
    assert [(e["level"], e["phase"], e["outcome"]) for e in phases] == [("warning", "exec", "timeout")]


async def test_an_unwrapped_phase_lets_the_bare_timeout_through_and_its_body_errors_are_typed(example_tasks):
    async with Engine() as eng:
        async with eng.episode(example_tasks[0], "simulated") as sandbox:
            with anyio.fail_after(30), pytest.raises(TimeoutError) as bare:
                async with sandbox.bounded_phase(Phase.AGENT, budget=0.1, wrap=False):
                    await anyio.sleep(10)
            assert not isinstance(bare.value, SandboxTimeout)
            with pytest.raises(ExecError) as typed:
                async with sandbox.bounded_phase(Phase.AGENT, budget=5.0):
                    raise ValueError("the agent broke")
            async with sandbox.bounded_phase(Phase.AGENT, budget=5.0) as seconds:
                await anyio.sleep(0.05)
                assert seconds() >= 0.05
            agent_stats = eng.stats().phases["agent"]
    assert isinstance(typed.value.__cause__, ValueError) and "the agent broke" in str(typed.value)
    assert (agent_stats.count, agent_stats.failures) == (3, 2)


async def test_a_cancelled_phase_is_not_a_failure_and_a_finished_one_logs_at_debug_only(example_tasks, events):
    handler, logger = events
    logger.setLevel(logging.DEBUG)
    async with Engine(backend_kwargs={"exec_latency": 10.0}) as eng:
        async with eng.episode(example_tasks[0], "simulated") as sandbox:
            with anyio.move_on_after(0.1):  # the caller gives up: no failure, no timeout
                await sandbox.exec("slow", timeout=60)
            exec_stats = eng.stats().phases.get("exec")
    assert exec_stats is None  # a cancelled phase is not recorded
    phases = [e for e in handler.events if e.get("event") == "phase" and e["phase"] == "exec"]
    assert [(e["level"], e["outcome"]) for e in phases] == [("debug", "cancelled")]
    assert phases[0]["sandbox"] == sandbox.id and phases[0]["start_attempt"] == 1
