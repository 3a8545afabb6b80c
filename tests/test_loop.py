"""The loop thread: calls from other threads, deadlock guard, engines, and a clean exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import pytest

from harbor_async.core.errors import LoopThreadError, StartError
from harbor_async.engine.loop import LoopThread

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.uvloop_pass  # .ci/run runs these again on uvloop


@pytest.fixture
def loop():
    thread = LoopThread(name="test-loop")
    yield thread
    thread.close(timeout=30)
    assert not thread.running


def test_call_and_submit_run_on_one_loop_thread(loop):
    async def where() -> str:
        await anyio.sleep(0)
        return threading.current_thread().name

    assert loop.call(where) == "test-loop"
    futures = [loop.submit(where) for _ in range(20)]
    assert {f.result(5) for f in futures} == {"test-loop"}


def test_calls_from_many_threads(loop):
    async def double(x: int) -> int:
        await anyio.sleep(0.001)
        return 2 * x

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda x: loop.call(double, x), range(64)))
    assert results == [2 * x for x in range(64)]


def test_blocking_call_from_the_loop_thread_is_a_clear_error(loop):
    async def inner() -> int:
        return 1

    async def reenter() -> int:
        return loop.call(inner)

    with pytest.raises(LoopThreadError, match="would deadlock"):
        loop.call(reenter)


def test_call_timeout_is_bounded(loop):
    with pytest.raises(TimeoutError, match="within 0.2 s"):
        loop.call(anyio.sleep, 30, timeout=0.2)


def test_engine_on_the_loop_thread(loop, example_tasks):
    engine = loop.open_engine(backend_kwargs=dict(start_latency=0.01))

    async def episode() -> float:
        async with engine.sandbox(example_tasks[0], "simulated") as sandbox:
            await sandbox.exec("true")
            return (await sandbox.verify()).reward

    assert loop.call(episode) == 1.0

    async def launch():
        return engine.launch(example_tasks[1], "simulated")

    sandbox = loop.call(launch)
    loop.call(sandbox.wait_started)
    assert not sandbox.done
    loop.close_engine(engine)
    assert sandbox.done
    assert loop.call(engine.live_sandboxes) == []


def test_start_error_surfaces_through_the_portal(loop, example_tasks):
    engine = loop.open_engine(backend_kwargs=dict(start_permanent_failure_rate=1.0))

    async def launch():
        return engine.launch(example_tasks[0], "simulated")

    sandbox = loop.call(launch)
    with pytest.raises(StartError):
        loop.call(sandbox.wait_started)
    loop.close_engine(engine)


EXIT_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from harbor_async.engine import loop
    from harbor_async.suites import example_suite_path
    from harbor_async.tasks.suite import load_suite

    os.environ["HARBOR_ASYNC_LOCAL_ROOT"] = sys.argv[1]
    if sys.argv[3] == "mine":  # the program's own SIGTERM handler, set before the library's loop starts
        import signal

        def mine(signum, frame):
            print("MINE", flush=True)
            sys.exit(7)

        signal.signal(signal.SIGTERM, mine)
    task = load_suite(example_suite_path()).tasks[0]
    engine = loop.open_engine()

    async def launch():
        return engine.launch(task, "local")

    sandboxes = [loop.call(launch) for _ in range(3)]
    for sandbox in sandboxes:
        loop.call(sandbox.wait_started)

    async def background():
        await sandboxes[0].exec("sleep 1000", timeout=2000)

    loop.submit(background)  # a command still running at exit
    print("READY", flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "sigterm", "sigint", "sigterm-mine"])
def test_process_exit_stops_live_sandboxes_and_never_hangs(tmp_path, how):
    """Whatever ends the process, its sandboxes are stopped; a program's own SIGTERM handler is chained to, not replaced."""
    root = tmp_path / "sandboxes"
    mine = "mine" if how == "sigterm-mine" else "-"
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_SCRIPT, str(root), "exit" if how == "exit" else "wait", mine],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout.readline().strip() == "READY"
    # the three sandboxes (pieces the engine's pool made ahead may be there too: they must go as well, below)
    assert len([p for p in root.glob("harbor-async-*") if "-pool-" not in p.name]) == 3
    if how != "exit":
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT if how == "sigint" else signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the process hung at exit")
    stderr = proc.stderr.read()
    if mine == "mine":
        assert proc.stdout.read().strip() == "MINE" and proc.returncode == 7, stderr
    assert list(root.glob("harbor-async-*")) == [], stderr
    left = subprocess.run(["pgrep", "-f", f"bwrap.*{root}"], capture_output=True, text=True).stdout
    assert left == "", f"bubblewrap processes left: {left}"


SIGNAL_ELSEWHERE = textwrap.dedent(
    """
    import signal, sys, threading, anyio
    from harbor_async.engine.loop import LoopThread

    loop = LoopThread(name="signalled-loop")
    loop.start()
    target = {"loop": loop._thread, "main": threading.main_thread()}[sys.argv[1]]

    def interrupt():  # what the kernel may do with a Ctrl-C: hand it to any thread that does not block it
        signal.pthread_kill(target.ident, signal.SIGINT)

    async def long_call():
        print("WAITING", flush=True)
        threading.Timer(0.5, interrupt).start()  # once the main thread waits on this call
        await anyio.sleep(600)

    try:
        loop.call(long_call)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    """
)


@pytest.mark.parametrize("thread", ["loop", "main"])
def test_ctrl_c_interrupts_a_call_whichever_thread_the_kernel_gives_it_to(thread):
    """A SIGINT that a thread other than the main one takes still interrupts the main thread's wait (the shim's
    tool call): before, the main thread slept on in an untimed wait and a trainer hit by Ctrl-C hung."""
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_ELSEWHERE, thread], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.stdout.split() == ["WAITING", "INTERRUPTED"], proc.stderr[-3000:]


def test_a_calls_own_timeout_error_is_raised_as_it_is_not_taken_for_the_waits(loop):
    """A call that raises TimeoutError (a SandboxTimeout is one) fails at once with that error, on the main thread
    as on others: the wait's own timeout is told apart from it (a slice of the wait is not the call's end)."""

    async def times_out() -> None:
        raise TimeoutError("the call's own")

    for timeout in (None, 30.0):  # before: a spin until a signal came; the wait's "no result within 30 s"
        with pytest.raises(TimeoutError, match="the call's own"):
            loop.call(times_out, timeout=timeout)
    box: list[BaseException] = []

    def elsewhere() -> None:
        try:
            loop.call(times_out)
        except BaseException as exc:  # noqa: BLE001 - read below
            box.append(exc)

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join(30)
    assert [str(e) for e in box] == ["the call's own"]


@pytest.mark.range  # .ci/range: on the lowest and highest uvloop the extra allows
def test_the_loop_runs_on_uvloop_exactly_when_asked(loop, monkeypatch):
    """HARBOR_ASYNC_UVLOOP=1 puts the loop thread (and run, eval) on uvloop; .ci/run runs the engine tests so too."""
    import asyncio

    from harbor_async.engine.loop import UVLOOP_VARIABLE, run_loop, uses_uvloop

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert loop.call(loop_module).startswith("uvloop") == uses_uvloop()
    monkeypatch.setenv(UVLOOP_VARIABLE, "1")
    assert run_loop(loop_module).startswith("uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed
    with pytest.raises(LoopThreadError, match="harbor-async\\[uvloop\\]"):
        run_loop(loop_module)
    monkeypatch.setenv(UVLOOP_VARIABLE, "0")  # not asked: asyncio's own loop (uvloop's where the test session made it the policy)
    policy_is_uvloop = type(asyncio.get_event_loop_policy()).__module__.startswith("uvloop")
    assert run_loop(loop_module).startswith("uvloop") == policy_is_uvloop
