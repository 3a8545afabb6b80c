"""``HarborPythonEnv``: a stateful Python kernel plus a shell, as TRL tools.

Tools the model sees:

- ``python(code)``: run a cell in a persistent Python kernel inside the
  sandbox. Variables, imports and functions persist between calls. The result
  is what the cell printed (stdout and stderr, in order, including the output
  of subprocesses it runs), then the ``repr`` of its last expression if that
  is not ``None`` (as in Jupyter), then the traceback if it raised. A cell that
  runs past its time limit (``cell_timeout``, 60 s by default) is interrupted
  with SIGINT (``KeyboardInterrupt``): the cell stops, the kernel and every
  variable defined so far stay. ``sys.exit()`` in a cell is reported, not
  obeyed. A kernel that died (``os._exit``, out of memory) is restarted on the
  next call, which then says that earlier state is gone.
- ``bash(command)``: run a shell command and get its stdout+stderr (a new shell
  per call, as in TRL's bash harness).

The task is submitted by writing the answer to ``/workdir/answer.txt`` (from
either tool); the task's verifier reads it.

How it works: ``_setup()`` (run on the engine's loop right after the sandbox
starts) writes a small kernel server and client to ``/tmp/.harbor-kernel/``
and starts the server, detached (double fork, own session) so that it outlives
the command that started it: on the ``local`` backend sandboxes keep
background processes between commands, as Docker containers do. The server
listens on a unix socket in that folder and runs one cell at a time in one
namespace. Each ``python`` call is one command that runs the client with the
cell (base64 on stdin); the client forwards it, waits for the result up to the
cell's limit, interrupts the kernel past it, and prints the outcome. The
sandbox needs ``python3`` (3.8 or newer) on its ``PATH``; the local backend
takes it from the host's ``/usr``.

Every tool is a plain method that blocks its caller: it works from the
trainer's thread and from any other thread (a worker pool, a thread running
its own asyncio loop), unlike TRL's example Jupyter harness, which calls
``run_until_complete`` on a loop that already runs in another thread.
"""

from __future__ import annotations

import base64
import shlex
from typing import Any

from shim import HarborEnv

#: Where the kernel's files live in the sandbox.
KERNEL_DIR = "/tmp/.harbor-kernel"

#: What the python tool returns at most (head and tail kept); the shim cuts at 8000.
MAX_CELL_OUTPUT = 7000

_SERVER_SOURCE = r'''
"""harbor-async Python kernel: runs cells sent over a unix socket, in one namespace."""
import ast
import json
import linecache
import os
import signal
import socket
import sys
import tempfile
import traceback

HEAD, TAIL, MAX_REPR = 16384, 49152, 20000
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
state = {"in_cell": False, "cells": 0}


def on_sigint(signum, frame):
    # Only a running cell is interrupted; between cells the kernel ignores it.
    if state["in_cell"]:
        raise KeyboardInterrupt


def user_traceback(exc):
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # the kernel's own frames are noise
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_cell(code):
    """(repr of the last expression or None, error text or None, interrupted)."""
    state["cells"] += 1
    filename = "<cell %d>" % state["cells"]
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec")
        tail = compile(last, filename, "eval") if last is not None else None
    except (SyntaxError, ValueError) as exc:
        return None, "".join(traceback.format_exception_only(type(exc), exc)), False
    try:
        state["in_cell"] = True
        try:
            exec(body, namespace)
            value = eval(tail, namespace) if tail is not None else None
        finally:
            state["in_cell"] = False
    except KeyboardInterrupt:
        return None, None, True
    except SystemExit as exc:
        return None, "SystemExit: %r (the kernel keeps running; variables are kept)\n" % (exc.code,), False
    except BaseException as exc:
        return None, user_traceback(exc), False
    if value is None:
        return None, None, False
    namespace["_"] = value
    try:
        text = repr(value)
    except BaseException as exc:
        return None, "repr() of the result failed:\n" + user_traceback(exc), False
    if len(text) > MAX_REPR:
        text = text[:MAX_REPR] + "... [repr cut at %d characters]" % MAX_REPR
    return text, None, False


def read_capture(capture):
    size = capture.seek(0, 2)
    capture.seek(0)
    if size <= HEAD + TAIL:
        data = capture.read()
    else:
        head = capture.read(HEAD)
        capture.seek(size - TAIL)
        data = head + b"\n... [%d bytes of output omitted] ...\n" % (size - HEAD - TAIL) + capture.read()
    return data.decode("utf-8", "replace")


def execute(code):
    """Run one cell with fds 1 and 2 sent to a file (subprocess output included)."""
    with tempfile.TemporaryFile() as capture:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(capture.fileno(), 1)
        os.dup2(capture.fileno(), 2)
        try:
            result, error, interrupted = run_cell(code)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        output = read_capture(capture)
    return {"output": output, "result": result, "error": error, "interrupted": interrupted}


def read_line(conn):
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def serve(conn):
    conn.sendall(json.dumps({"pid": os.getpid(), "cells": state["cells"]}).encode() + b"\n")
    request = read_line(conn)
    if not request:
        return
    reply = execute(json.loads(request)["code"])
    conn.sendall(json.dumps(reply).encode() + b"\n")


def main():
    path = sys.argv[1]
    signal.signal(signal.SIGINT, on_sigint)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    with open(os.path.join(os.path.dirname(path), "kernel.pid"), "w") as pidfile:
        pidfile.write(str(os.getpid()))
    while True:
        try:
            conn, _ = server.accept()
        except KeyboardInterrupt:
            continue
        try:
            serve(conn)
        except BaseException:  # a client gone mid-cell, a stray interrupt: keep serving
            pass
        finally:
            conn.close()


main()
'''

_CLIENT_SOURCE = r'''
"""harbor-async Python kernel client: run one cell (base64 on stdin), print the outcome."""
import base64
import fcntl
import json
import os
import signal
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOCKET = os.path.join(HERE, "kernel.sock")
SERVER = os.path.join(HERE, "server.py")
PIDFILE = os.path.join(HERE, "kernel.pid")
GRACE = 5.0  # seconds an interrupted cell gets to stop
MAX_OUTPUT = int(os.environ.get("HARBOR_KERNEL_MAX_OUTPUT", "7000"))


def start_kernel():
    """Start the server detached (double fork, own session): it outlives this command.

    Under a lock: two first cells at once start one kernel, not two.
    """
    with open(os.path.join(HERE, "start.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return connect()  # another client started it meanwhile
        except OSError:
            return spawn_kernel()


def spawn_kernel():
    for stale in (SOCKET, PIDFILE):
        if os.path.exists(stale):
            os.unlink(stale)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() > 0:
                os._exit(0)
            null = os.open(os.devnull, os.O_RDWR)
            log = os.open(os.path.join(HERE, "kernel.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.execv(sys.executable, [sys.executable, "-u", SERVER, SOCKET])
        finally:
            os._exit(127)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            return connect()
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("the Python kernel did not start; see " + os.path.join(HERE, "kernel.log"))


def connect():
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
    except OSError:
        conn.close()
        raise
    return conn


def receive_line(conn, deadline):
    """One line from the kernel, or None past the deadline (b"" if it hung up)."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None, data
        conn.settimeout(left)
        try:
            chunk = conn.recv(1 << 20)
        except socket.timeout:
            return None, data
        if not chunk:
            return b"", data
        data += chunk
    return data, b""


def kernel_pid():
    try:
        with open(PIDFILE) as file:
            return int(file.read().strip())
    except (OSError, ValueError):
        return None


def shorten(text):
    if len(text) <= MAX_OUTPUT:
        return text
    head, tail = MAX_OUTPUT // 3, MAX_OUTPUT - MAX_OUTPUT // 3
    return text[:head] + "\n... [%d characters omitted] ...\n" % (len(text) - head - tail) + text[-tail:]


def run(code, timeout):
    """Run one cell; return the text for the model."""
    restarted = None
    try:
        conn = connect()
    except OSError:
        if os.path.exists(PIDFILE):
            restarted = ("Note: the Python kernel had stopped and was restarted; "
                         "variables from earlier cells are gone.")
        conn = start_kernel()
    deadline = time.monotonic() + timeout
    hello, _ = receive_line(conn, deadline)  # waits while another cell runs
    if not hello:
        return "Error: the Python kernel is busy (another cell is running) and did not answer within %g s." % timeout
    pid = json.loads(hello)["pid"]
    conn.sendall(json.dumps({"code": code}).encode() + b"\n")
    line, _ = receive_line(conn, deadline)
    timed_out = line is None
    if timed_out:  # past the limit: interrupt the cell, keep the kernel
        for _attempt in range(2):
            os.kill(pid, signal.SIGINT)
            line, _ = receive_line(conn, time.monotonic() + GRACE)
            if line is not None:
                break
        else:  # it does not listen: end it; the next cell starts a new one
            os.kill(pid, signal.SIGKILL)
            return ("Error: the cell ran past its %g s limit and did not stop when interrupted; the Python "
                    "kernel was killed and all variables are lost." % timeout)
    if not line:
        return ("Error: the Python kernel died while running the cell (it is restarted on the next call; "
                "variables are lost).")
    reply = json.loads(line)
    parts = [restarted] if restarted else []
    if reply["output"]:
        parts.append(reply["output"].rstrip("\n"))
    if reply["result"] is not None:
        parts.append(reply["result"])
    if reply["error"]:
        parts.append(reply["error"].rstrip("\n"))
    if reply["interrupted"]:
        parts.append("Error: the cell ran past its %g s limit and was interrupted (KeyboardInterrupt); "
                     "variables defined before it are kept." % timeout if timed_out else "KeyboardInterrupt")
    return "\n".join(parts) if parts else "(no output)"


def main():
    if sys.argv[1:] == ["--start"]:
        try:
            connect().close()
            print("kernel running")
        except OSError:
            start_kernel().close()
            print("kernel started")
        return
    timeout = float(sys.argv[1])
    code = base64.b64decode("".join(sys.stdin.read().split())).decode("utf-8")
    try:
        print(shorten(run(code, timeout)))
    except Exception as exc:
        print("Error: the Python kernel could not run the cell: %s: %s" % (type(exc).__name__, exc))
        sys.exit(1)


main()
'''


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


#: The shell command that installs the kernel in a sandbox and starts it.
INSTALL_COMMAND = (
    f"mkdir -p {KERNEL_DIR} && chmod 700 {KERNEL_DIR}"
    f" && printf %s {_b64(_SERVER_SOURCE)} | base64 -d > {KERNEL_DIR}/server.py"
    f" && printf %s {_b64(_CLIENT_SOURCE)} | base64 -d > {KERNEL_DIR}/client.py"
    f" && if command -v python3 >/dev/null; then python3 {KERNEL_DIR}/client.py --start;"
    " else echo 'python3 is not installed in this sandbox'; fi"
)

_NO_PYTHON = "Error: python3 is not installed in this sandbox, so the python tool cannot run; use the bash tool."

PROMPT_SUFFIX = (
    "\n\nYou have two tools. `python` runs Python code in a persistent kernel: variables, imports and "
    "functions stay defined between calls, the value of a final expression is shown (as in Jupyter), "
    "errors come back as tracebacks, and a call that runs past its time limit is interrupted while "
    "earlier variables are kept. `bash` runs a shell command (a new shell per call) and returns its "
    "stdout+stderr. Commands start in the task's working folder. **Submit your final answer by writing "
    "it to /workdir/answer.txt**, e.g. `open('/workdir/answer.txt', 'w').write(str(answer))` with "
    "`python`. Stating the answer in prose does NOT submit it; only writing the file counts. Keep the "
    "answer short, and do not end your turn without submitting."
)


class HarborPythonEnv(HarborEnv):
    """Harness with a persistent Python kernel (``python``) and a shell (``bash``).

    Args:
        environment_type: the backend, as for :class:`shim.HarborEnv`.
        cell_timeout: seconds a cell may run before it is interrupted
            (default :attr:`CELL_TIMEOUT`); subclass and set ``CELL_TIMEOUT``
            to change it for envs built by ``HarborSpec``.
        **kwargs: engine options and ``backend_kwargs``, as for :class:`shim.HarborEnv`.
    """

    PROMPT_SUFFIX = PROMPT_SUFFIX
    #: Seconds a cell may run before the kernel is interrupted.
    CELL_TIMEOUT: float = 60.0
    #: Seconds the command running a cell gets beyond the cell's limit (interrupt, grace, reply).
    CELL_MARGIN: float = 30.0

    def __init__(self, environment_type: str = "docker", *, cell_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(environment_type, **kwargs)
        if cell_timeout is not None:
            if isinstance(cell_timeout, bool) or not isinstance(cell_timeout, (int, float)) or cell_timeout <= 0:
                raise ValueError(f"cell_timeout must be a positive number of seconds, got {cell_timeout!r}")
            self.CELL_TIMEOUT = float(cell_timeout)

    async def _setup(self) -> None:
        """Install the kernel in the new sandbox and start it (a failure here is retried by the first cell)."""
        await self._aexec(INSTALL_COMMAND, timeout=60)

    def python(self, code: str) -> str:
        """
        Run Python code in a persistent Python kernel in the sandbox. Variables, imports and functions persist
        between calls. Returns what the code printed (stdout and stderr), then the value of the last expression
        (as in Jupyter), then the traceback if it raised. A call that runs too long is interrupted; variables
        defined before it are kept.

        Args:
            code: The Python code to run; it may span several lines.

        Returns:
            The cell's printed output, the repr of its final expression, and any traceback.
        """
        if not isinstance(code, str):
            return f"Error: `code` must be a string, got {type(code).__name__}: {code!r}."
        return self._exec(self._cell_command(code), timeout=self.CELL_TIMEOUT + self.CELL_MARGIN)

    def bash(self, command: str) -> str:
        """
        Run a shell command in the sandbox and return its combined stdout+stderr. Each call runs in a new shell
        (`cd` and variables do not carry over). Use it to explore files (ls, head, cat) and run programs.

        Args:
            command: The shell command to run.

        Returns:
            The command's combined stdout and stderr.
        """
        return self._exec(command)

    def _cell_command(self, code: str) -> str:
        """The shell command that runs one cell through the kernel client (the cell as base64 on stdin)."""
        delimiter = "HARBOR_CELL_EOF"  # base64 never contains it
        return (
            f"if ! command -v python3 >/dev/null; then echo {shlex.quote(_NO_PYTHON)}; exit 127; fi\n"
            f"test -f {KERNEL_DIR}/client.py || {{ {INSTALL_COMMAND} ; }} >/dev/null\n"
            f"HARBOR_KERNEL_MAX_OUTPUT={MAX_CELL_OUTPUT} python3 {KERNEL_DIR}/client.py {self.CELL_TIMEOUT:g}"
            f" <<'{delimiter}'\n{_b64(code)}\n{delimiter}"
        )
