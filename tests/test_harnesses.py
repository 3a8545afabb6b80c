"""End-to-end tests of the richer harnesses (shim.harnesses) on the local bubblewrap backend.

Every test runs real sandboxes of the bundled example suite: the Python kernel
and the terminal's background jobs are real processes that persist inside a
sandbox between tool calls, and are checked from the host by unique strings in
their command lines.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

import shim
from harbor_async.suites import example_suite_path
from shim import HarborSpec, engines
from shim.harnesses import HarborPythonEnv, HarborTerminalEnv, python_kernel, terminal
from tests.conftest import _pooled

CELL_TIMEOUT = 2.0
KERNEL_PROCESS = "harbor-kernel/server.py"


def task_dir(name: str = "csv-column-sum") -> str:
    return str(example_suite_path() / "tasks" / name)


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def own_processes(pattern: str) -> dict[int, str]:
    """This test process's processes (sandboxes included) matching ``pattern`` (pgrep -f): pid -> start time.

    Descendants only, so that other runs on this machine never count.
    """
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    mine = {}
    for pid in map(int, found.stdout.split()):
        stat, ancestor = _stat(pid), pid
        start = stat[19] if stat else None
        while stat is not None and ancestor not in (0, 1, os.getpid()):
            ancestor = int(stat[1])
            stat = _stat(ancestor)
        if ancestor == os.getpid() and start is not None:
            mine[pid] = start
    return mine


def still_running(processes: dict[int, str]) -> list[int]:
    """Those of ``processes`` that still run (same pid, same start time, not a zombie)."""
    alive = []
    for pid, start in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[19] == start and stat[0] != "Z":
            alive.append(pid)
    return alive


def tools_of(cls: type) -> list[str]:
    """The tool names TRL derives from an env class (its public functions but reset/get_reward)."""
    return sorted(
        name
        for name, _ in inspect.getmembers(cls, inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    )


@pytest.fixture
def python_env():
    env = HarborPythonEnv("local", cell_timeout=CELL_TIMEOUT)
    prompt = env.reset(task_dir=task_dir())
    assert prompt.endswith(python_kernel.PROMPT_SUFFIX)
    yield env
    kernels = own_processes(KERNEL_PROCESS)
    env.close()
    assert still_running(kernels) == []


@pytest.fixture
def terminal_env():
    env = HarborTerminalEnv("local")
    prompt = env.reset(task_dir=task_dir())
    assert prompt.endswith(terminal.PROMPT_SUFFIX)
    yield env
    env.close()


# -- the tool surface ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (HarborPythonEnv, ["bash", "python"]),
        (
            HarborTerminalEnv,
            ["list_background", "read_notes", "read_output", "run", "start_background",
             "stop_background", "write_note"],
        ),
    ],
)  # fmt: skip
def test_tools_have_schemas_and_are_documented(cls: type, expected: list[str]) -> None:
    assert tools_of(cls) == expected  # helpers are private, close() is not a tool
    env = cls("local")  # never reset: no sandbox starts
    assert env.reward == 0.0
    for name in expected:
        module = inspect.getmodule(getattr(cls, name))  # the core module that defines the tool
        schema = get_json_schema(getattr(env, name))["function"]
        assert schema["name"] == name and schema["description"]
        parameters = inspect.signature(getattr(env, name)).parameters
        assert set(schema["parameters"]["properties"]) == set(parameters)
        for parameter in schema["parameters"]["properties"].values():
            assert parameter["type"] in ("string", "integer") and parameter["description"]
        # the module docstring and the prompt suffix both name every tool
        assert f"``{name}(" in module.__doc__
        assert f"`{name}`" in cls.PROMPT_SUFFIX
    assert "/workdir/answer.txt" in cls.PROMPT_SUFFIX


def test_registered_as_built_in_agents() -> None:
    assert shim.AGENTS["python"] is HarborPythonEnv
    assert shim.AGENTS["terminal"] is HarborTerminalEnv
    with HarborSpec(str(example_suite_path()), agent="terminal", environment_type="local") as spec:
        env = spec.environment_factory()
        assert type(env) is HarborTerminalEnv


# -- the Python kernel -------------------------------------------------------------------------


def test_python_variables_persist_across_cells(python_env: HarborPythonEnv) -> None:
    assert python_env.python("x = 41\nimport math\ndef double(v):\n    return 2 * v") == "(no output)\n"
    assert python_env.python("print('x is', x)\ndouble(x + 1)") == "x is 41\n84\n"
    # only the last expression is shown; `_` is the previous cell's result
    assert python_env.python("math.sqrt(x + 8)\n_ + 1") == "85\n"
    assert python_env.python("y = None\ny") == "(no output)\n"  # None is not shown, as in Jupyter


def test_python_output_order_includes_subprocesses_and_is_bounded(python_env: HarborPythonEnv) -> None:
    mixed = python_env.python(
        "import subprocess, sys\nprint('a')\nprint('b', file=sys.stderr)\n"
        "subprocess.run(['echo', 'c'])\nprint('d')"
    )
    assert mixed == "a\nb\nc\nd\n"
    huge = python_env.python("print('x' * 100_000)\n'tail'")
    assert len(huge) <= 8000 and "characters omitted" in huge and huge.endswith("'tail'\n")


def test_python_exceptions_do_not_kill_the_kernel(python_env: HarborPythonEnv) -> None:
    python_env.python("kept = 'still here'")
    failed = python_env.python("def broken():\n    return 1 / 0\n\nbroken()")
    assert failed.startswith("Traceback (most recent call last):")
    assert 'File "<cell 2>", line 2, in broken' in failed and "return 1 / 0" in failed
    assert failed.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "server.py" not in failed  # the kernel's own frames are hidden
    assert "SyntaxError" in python_env.python("def f(:\n    pass")
    assert "SystemExit: 3" in python_env.python("import sys\nsys.exit(3)")
    assert python_env.python("kept") == "'still here'\n"


@pytest.mark.slow
def test_python_hung_cell_times_out_and_state_survives(python_env: HarborPythonEnv) -> None:
    python_env.python("before = 'defined before'")
    for hung in ("import time\nprint('started')\ntime.sleep(600)", "while True:\n    pass"):
        started = time.monotonic()
        output = python_env.python(hung)
        assert time.monotonic() - started < 60  # a cell that is never interrupted would take 600 s or forever
        assert "ran past its 2 s limit and was interrupted" in output, output
    assert python_env.python("before") == "'defined before'\n"
    assert len(own_processes(KERNEL_PROCESS)) == 1  # the same kernel, not a restarted one
    assert "Note:" not in python_env.python("1")


def test_python_dead_kernel_is_restarted(python_env: HarborPythonEnv) -> None:
    python_env.python("x = 1")
    assert "died while running the cell" in python_env.python("import os\nos._exit(1)")
    restarted = python_env.python("'x' in globals()")
    assert restarted.startswith("Note: the Python kernel had stopped and was restarted")
    assert restarted.endswith("False\n")


@pytest.mark.slow
def test_python_calls_from_other_threads(python_env: HarborPythonEnv) -> None:
    python_env.python("counter = 0")
    with ThreadPoolExecutor(max_workers=2) as pool:  # as AsyncGRPOTrainer's tool pool calls sync tools
        futures = [pool.submit(python_env.python, "import time\ntime.sleep(0.3)\ncounter += 1") for _ in range(2)]
        assert [future.result(timeout=60) for future in futures] == ["(no output)\n"] * 2

    async def from_a_running_loop() -> str:  # the case TRL's example Jupyter harness gets wrong
        return python_env.python("counter += 1\ncounter")

    results: list[str] = []
    worker = threading.Thread(target=lambda: results.append(asyncio.run(from_a_running_loop())))
    worker.start()
    worker.join(60)
    assert results == ["3\n"]


def test_python_and_bash_share_the_sandbox(python_env: HarborPythonEnv) -> None:
    python_env.python("open('/tmp/from-python.txt', 'w').write('hello')")
    assert python_env.bash("cat /tmp/from-python.txt; pwd") == "hello/workdir\n"
    assert python_env.python("import os\nos.getcwd()") == "'/workdir'\n"
    assert python_env.python(["not", "code"]).startswith("Error: `code` must be a string")


def test_python_kernel_solves_a_task() -> None:
    right, wrong = HarborPythonEnv("local"), HarborPythonEnv("local")
    try:
        right.reset(task_dir=task_dir("csv-column-sum"))
        wrong.reset(task_dir=task_dir("csv-column-sum"))
        assert right.python("import csv\nrows = list(csv.DictReader(open('/workdir/sales.csv')))\nlen(rows)") != ""
        total = right.python("total = sum(float(r['amount']) for r in rows)\nround(total, 2)")
        right.python("open('/workdir/answer.txt', 'w').write(f'{total:.2f}')")
        wrong.python("open('/workdir/answer.txt', 'w').write('1.00')")
        assert total == "915.16\n"
        assert (right.reward, wrong.reward) == (1.0, 0.0)
    finally:
        right.close()
        wrong.close()


# -- the terminal ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_terminal_run_keeps_the_folder_and_reports_failures(terminal_env: HarborTerminalEnv) -> None:
    assert terminal_env.run("pwd") == "/workdir\n"
    assert terminal_env.run("mkdir -p sub/dir && cd sub/dir && echo moved") == "moved\n"
    assert terminal_env.run("pwd; export VAR=1") == "/workdir/sub/dir\n"
    assert terminal_env.run('echo "var=[$VAR]"') == "var=[]\n"  # variables do not carry over
    failed = terminal_env.run("echo out; echo err >&2; false")
    assert failed == "out\nerr\n[exit code: 1]\n"  # merged in order, exit code last
    stopped = terminal_env.run("sleep 30", timeout=1)
    assert stopped.startswith("Error: the command timed out after 1 s")
    assert terminal_env.run(42).startswith("Error: `command` must be a string")
    assert terminal_env.run("true", timeout="soon").startswith("Error: `timeout`")


@pytest.mark.slow
def test_terminal_background_job_output_is_readable_later_and_stoppable(terminal_env: HarborTerminalEnv) -> None:
    started = terminal_env.start_background(
        "echo tick-1901 starting; while :; do date +%s%N; sleep 0.05; done", "ticker"
    )
    assert started.startswith("Started background job 'ticker' (pid ")
    assert "already running" in terminal_env.start_background("true", "ticker")
    time.sleep(0.5)
    first = terminal_env.read_output("ticker", 2)
    assert first.startswith("[job 'ticker': running (pid ") and len(first.splitlines()) == 3
    time.sleep(0.5)
    later = terminal_env.read_output("ticker", 1000)
    assert later.splitlines()[1] == "tick-1901 starting" and len(later.splitlines()) > len(first.splitlines())
    job = own_processes("harbor-terminal/jobs/ticker/command.sh")
    assert len(job) == 1  # a real process in the sandbox, between tool calls
    listing = terminal_env.list_background()
    assert listing.startswith("ticker: running (pid ") and "tick-1901" in listing
    stopped = terminal_env.stop_background("ticker")
    assert stopped.startswith("Stopped background job 'ticker' (SIGTERM).")
    assert still_running(job) == []  # stop_background returns once the job is gone
    assert terminal_env.read_output("ticker", 1).startswith("[job 'ticker': stopped by stop_background (SIGTERM);")
    assert "had already ended" in terminal_env.stop_background("ticker")
    # a job that ends by itself, a server reached from a later call, bad input
    quick = terminal_env.start_background("echo done-1902; exit 3", "quick")
    assert quick.startswith("Background job 'quick' started and has already ended (exited with code 3).")
    assert "done-1902" in quick
    terminal_env.start_background("python3 -m http.server 18947 --bind 127.0.0.1", "web")
    fetched = terminal_env.run(
        "for i in $(seq 50); do exec 3<>/dev/tcp/127.0.0.1/18947 && break; sleep 0.1; done 2>/dev/null; "
        "printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3; head -1 <&3"
    )
    assert fetched.startswith("HTTP/1.0 200")
    missing = terminal_env.read_output("nope", 5)
    assert missing.startswith("Error: no background job named 'nope'. Jobs: quick ticker web")
    assert terminal_env.read_output("web", 0).startswith("Error: `tail_lines`")
    assert terminal_env.start_background("true", "../escape").startswith("Error: invalid job name")


def test_terminal_notes_round_trip(terminal_env: HarborTerminalEnv) -> None:
    assert terminal_env.read_notes() == "No notes yet.\n"
    tricky = "total = $(rm -rf /workdir) `id` 'quoted' \"double\" \\ back\nsecond line"
    assert terminal_env.write_note("Plan", "1. read\n2. sum") == "Saved note 'Plan' (/workdir/.notes/plan.md)."
    assert terminal_env.write_note("Findings: $HOME", tricky).startswith("Saved note 'Findings: $HOME'")
    time.sleep(0.01)
    assert terminal_env.write_note("Plan", "revised").startswith("Replaced note 'Plan'")
    notes = terminal_env.read_notes()
    assert notes == f"# Findings: $HOME\n\n{tricky}\n---\n# Plan\n\nrevised\n---\n"
    assert terminal_env.run("ls /workdir/.notes") == "findings-home.md\nplan.md\n"
    assert terminal_env.run("ls /workdir/sales.csv") == "/workdir/sales.csv\n"  # nothing was run from a note
    assert terminal_env.write_note("", "x").startswith("Error: `title` must not be empty")


def test_terminal_solves_a_task(terminal_env: HarborTerminalEnv) -> None:
    terminal_env.write_note("Plan", "sum column 4 of sales.csv with awk")
    terminal_env.run("awk -F, 'NR > 1 { s += $4 } END { printf \"%.2f\", s }' sales.csv > answer.txt")
    assert terminal_env.run("cat /workdir/answer.txt") == "915.16"
    assert terminal_env.reward == 1.0


# -- teardown ----------------------------------------------------------------------------------------


def test_close_leaves_nothing() -> None:
    python_env, terminal_env = HarborPythonEnv("local"), HarborTerminalEnv("local")
    python_env.reset(task_dir=task_dir())
    terminal_env.reset(task_dir=task_dir("word-frequency"))
    assert python_env.python("1 + 1") == "2\n"
    python_env.bash("nohup sleep 1911 > /dev/null 2>&1 &")
    terminal_env.start_background("sleep 1912", "sleeper")
    processes = own_processes(f"{KERNEL_PROCESS}|sleep 191[12]")
    assert len(processes) == 3
    assert engines.live_sandbox_count() == 2
    python_env.close()
    terminal_env.close()
    # no kernel, job or background process, no sandbox, no process joining one
    assert still_running(processes) == []
    assert engines.live_sandbox_count() == 0
    assert own_processes("local/helpers/enter.py") == {}  # no helper joining a sandbox
    pooled_pids, _ = _pooled()  # keepers of pieces made ahead: the open engine's, removed when it closes
    assert {pid for pid in own_processes("bwrap") if str(pid) not in pooled_pids} == set()
    local_root = Path(os.environ.get("HARBOR_ASYNC_LOCAL_ROOT", "/tmp/harbor-async-local"))
    leftovers = [p for p in local_root.glob("harbor-async-*") if any(r in p.name for r in _run_labels())]
    assert [p for p in leftovers if "-pool-" not in p.name] == []  # pieces made ahead belong to the open engine
    python_env.close()  # idempotent
    assert python_env.python("1").startswith("Error: no task is loaded")


def _run_labels() -> list[str]:
    return [engine.run_label for engine in engines.open_engines()]
