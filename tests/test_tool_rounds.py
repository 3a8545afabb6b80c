"""ToolCallsAhead: a round's sync calls run ahead for every rollout, served to a caller that asks one rollout at a time.

The caller here plays TRL's ``_tool_call_loop`` calling block (rollout after
rollout, each call in order, ``{"error": str(e)}`` for a raising tool); the
real loop is exercised in ``tests/test_trainer.py`` against ``GRPOTrainer``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psutil
import pytest

from shim.tool_rounds import CallNotRunError, ToolCallsAhead, worker_threads


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def as_trl_calls(ahead: ToolCallsAhead, completions: list[list[dict[str, Any]]]) -> list[list[Any]]:
    """TRL's calling block: each rollout in turn, its sync calls in order, errors as messages."""
    tools = ahead.tool_dicts()
    results = []
    for index, messages in enumerate(completions):
        mine = []
        for tool_call in messages[-1].get("tool_calls") or []:
            function = tool_call["function"]
            try:
                if function["name"] not in tools[index]:
                    raise ValueError(f"Tool {function['name']} not found.")
                mine.append(tools[index][function["name"]](**function["arguments"]))
            except Exception as e:  # noqa: BLE001 - as TRL
                mine.append({"error": str(e)})
        results.append(mine)
    return results


class Shell:
    """A rollout's sync tools, logging each call; ``gate`` holds a call until another rollout's call has begun."""

    def __init__(self, log: list[tuple[int, str]], index: int, gate: threading.Event | None = None) -> None:
        self.log, self.index, self.gate, self.files = log, index, gate, ""

    def write(self, text: str) -> str:
        self.log.append((self.index, f"write {text}"))
        self.files += text
        return "ok"

    def read(self) -> str:
        if self.gate is not None:
            self.log.append((self.index, f"waited {self.gate.wait(timeout=10)}"))
        self.log.append((self.index, "read"))
        return self.files

    def fail(self, reason: str) -> str:
        raise RuntimeError(f"failed: {reason}")

    def tools(self) -> dict[str, Any]:
        return {"write": self.write, "read": self.read, "fail": self.fail}


@pytest.mark.parametrize("runner", ["executor", "trainer"])
def test_a_rounds_rollouts_run_at_once_each_in_its_own_order(runner: str):
    log: list[tuple[int, str]] = []
    started = threading.Event()
    first = Shell(log, 0, gate=started)  # its read needs rollout 1 to have begun: serially this waits 10 s and logs False
    second = Shell(log, 1)
    second_write = second.write

    def write_and_signal(text: str) -> str:
        started.set()
        return second_write(text)

    second.write = write_and_signal  # type: ignore[method-assign]
    completions = [
        [{"role": "assistant", "tool_calls": [call("write", text="a"), call("read"), call("fail", reason="boom")]}],
        [{"role": "assistant", "tool_calls": [call("write", text="b"), call("nope"), call("read")]}],
    ]
    with ThreadPoolExecutor(4) as pool:  # the trainer's: anyio's worker threads of the loop thread
        with ToolCallsAhead(completions, [first.tools(), second.tools()], pool.submit if runner == "executor" else worker_threads(4)) as ahead:
            results = as_trl_calls(ahead, completions)
    assert results == [["ok", "a", {"error": "failed: boom"}], ["ok", {"error": "Tool nope not found."}, "b"]]
    assert (0, "waited True") in log  # rollout 1 ran while rollout 0 was still in its calls
    assert [entry for i, entry in log if i == 0] == ["write a", "waited True", "read"]  # each rollout's own order
    assert [entry for i, entry in log if i == 1] == ["write b", "read"]  # every call once: none run twice
    assert ahead.rounds == 1 and ahead.waited > 0


def test_only_the_calls_trl_makes_run_ahead_and_an_answered_message_never_runs_again():
    log: list[tuple[int, str]] = []
    shell = Shell(log, 0)
    message = {
        "role": "assistant",
        "tool_calls": [
            call("write", text="x"),
            {"type": "code", "function": {"name": "write", "arguments": {"text": "other type"}}},
            {"type": "function", "function": {"name": "write", "arguments": '{"text": "a string"}'}},
            call("unknown", text="y"),
        ],
    }
    completions = [[message]]
    with ThreadPoolExecutor(2) as pool:
        ahead = ToolCallsAhead(completions, [shell.tools()], pool.submit)
        tools = ahead.tool_dicts()
        assert tools[0]["write"](text="x") == "ok"
        # a rolled-back round leaves the same message last: the next round must not run its calls again
        assert tools[0]["write"](text="later") == "ok"  # not foreseen: run as called
        ahead.close()
    assert log == [(0, "write x"), (0, "write later")]


def test_the_callers_exception_is_the_tools_own():
    shell = Shell([], 0)
    completions = [[{"role": "assistant", "tool_calls": [call("fail", reason="why")]}]]
    with ThreadPoolExecutor(2) as pool:
        ahead = ToolCallsAhead(completions, [shell.tools()], pool.submit)
        with pytest.raises(RuntimeError, match="failed: why"):
            ahead.tool_dicts()[0]["fail"](reason="why")
        ahead.close()


@pytest.mark.parametrize("runner", ["executor", "trainer"])
def test_a_tools_timeout_error_reaches_the_caller_as_it_raised_it(runner: str):
    """A TimeoutError of the tool's own (a socket's, a sandbox's) is the call's answer, not the wait's timeout."""

    def wait() -> str:
        raise TimeoutError("the tool's own")

    completions = [[{"role": "assistant", "tool_calls": [call("wait")]}]]
    with ThreadPoolExecutor(2) as pool:
        with ToolCallsAhead(completions, [{"wait": wait}], pool.submit if runner == "executor" else worker_threads(2)) as ahead:
            with pytest.raises(TimeoutError, match="the tool's own"):
                ahead.tool_dicts()[0]["wait"]()


def test_a_call_whose_worker_never_ran_it_fails_instead_of_waiting():
    def cancelled(fn, *args) -> Future[None]:  # a round's worker cancelled before it took the calls
        future: Future[None] = Future()
        future.cancel()
        return future

    log: list[tuple[int, str]] = []
    completions = [[{"role": "assistant", "tool_calls": [call("write", text="a")]}]]
    with ToolCallsAhead(completions, [Shell(log, 0).tools()], cancelled) as ahead:
        with pytest.raises(CallNotRunError, match="write was not run"):
            ahead.tool_dicts()[0]["write"](text="a")
    assert log == []


def test_without_a_pool_nothing_runs_ahead():
    log: list[tuple[int, str]] = []
    shells = [Shell(log, 0), Shell(log, 1)]
    completions = [[{"role": "assistant", "tool_calls": [call("write", text=str(i)), call("read")]}] for i in range(2)]
    ahead = ToolCallsAhead(completions, [s.tools() for s in shells], None)
    assert as_trl_calls(ahead, completions) == [["ok", "0"], ["ok", "1"]]
    assert log == [(0, "write 0"), (0, "read"), (1, "write 1"), (1, "read")] and ahead.rounds == 0


CTRL_C_MID_ROUND = """
import signal, sys, threading, psutil
import shim
from shim.tool_rounds import CallNotRunError, ToolCallsAhead, worker_threads

envs = [shim.HarborBashEnv("local", job_dir=f"{sys.argv[1]}/{i}") for i in range(2)]
for env in envs:
    env.reset(task_dir=sys.argv[2])
seconds = sys.argv[3]  # this test's own: longer than the exec timeout (an exit that waits for it waits for that)
command = f"sleep {seconds}"
completions = [[{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}]}] for _ in envs]


def interrupt_once_both_run():
    while len([p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", seconds]]) < 2:
        threading.Event().wait(0.05)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


threading.Thread(target=interrupt_once_both_run, daemon=True).start()
with ToolCallsAhead(completions, [{"bash": env.bash} for env in envs], worker_threads(4)) as ahead:
    for tools in ahead.tool_dicts():
        print(tools["bash"](command=command), flush=True)  # as TRL's loop asks: interrupted in the first
"""


@pytest.mark.slow
def test_ctrl_c_mid_round_ends_the_trainer_without_waiting_for_the_calls_ahead(tmp_path):
    """SIGINT while both rollouts' commands run ahead: the process exits, its sandboxes stopped by the engine's
    close at exit. A ``ThreadPoolExecutor`` kept it alive until every command ended (the exec timeout: minutes),
    since the interpreter joins its threads before the exit handlers run."""
    from harbor_async.suites import example_suite_path
    from harbor_async.tasks.suite import load_suite
    from tests.cluster_helpers import child_env

    task = load_suite(example_suite_path()).tasks[0]
    seconds = str(80000 + os.getpid() % 6000)  # unique to this process: another run's sleeps are not counted
    proc = subprocess.run(
        [sys.executable, "-c", CTRL_C_MID_ROUND, str(tmp_path / "jobs"), str(task.task_dir), seconds],
        capture_output=True, text=True, env=child_env(), timeout=100,
    )  # fmt: skip
    assert "KeyboardInterrupt" in proc.stderr and proc.returncode != 0, proc.stderr[-3000:]
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", seconds]]
    assert left == []  # both commands ended with their sandboxes
