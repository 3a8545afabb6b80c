"""``python``: a stateful Python kernel plus a shell (the shim's ``HarborPythonEnv``).

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
from importlib import resources
from typing import Any

from harbor_async.harnesses.base import Harness

#: Where the kernel's files live in the sandbox.
KERNEL_DIR = "/tmp/.harbor-kernel"

#: What the python tool returns at most (head and tail kept); the shim cuts at 8000.
MAX_CELL_OUTPUT = 7000


def _program(name: str) -> str:
    """The source of a helper program shipped beside this module (run inside the sandbox, not imported)."""
    return resources.files("harbor_async.harnesses").joinpath("kernel", name).read_text(encoding="utf-8")


_SERVER_SOURCE = _program("server.py")
_CLIENT_SOURCE = _program("client.py")


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


class PythonHarness(Harness):
    """Harness with a persistent Python kernel (``python``) and a shell (``bash``).

    Args:
        *args, **kwargs: passed on (the shim's ``HarborPythonEnv`` takes the backend and engine options).
        cell_timeout: seconds a cell may run before it is interrupted
            (default :attr:`CELL_TIMEOUT`); subclass and set ``CELL_TIMEOUT``
            to change it for envs built by ``HarborSpec``.
    """

    PROMPT_SUFFIX = PROMPT_SUFFIX
    NAME = "python"
    #: Seconds a cell may run before the kernel is interrupted.
    CELL_TIMEOUT: float = 60.0
    #: Seconds the command running a cell gets beyond the cell's limit (interrupt, grace, reply).
    CELL_MARGIN: float = 30.0

    def __init__(self, *args: Any, cell_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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
