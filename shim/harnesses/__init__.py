"""Richer harnesses than TRL's single ``bash`` tool, as ``shim.HarborEnv`` subclasses.

- :class:`HarborPythonEnv` (``agent="python"``): a persistent Python kernel
  (``python``) plus a shell (``bash``). See :mod:`shim.harnesses.python_kernel`.
- :class:`HarborTerminalEnv` (``agent="terminal"``): a terminal whose working
  folder persists (``run``), background jobs (``start_background``,
  ``read_output``, ``stop_background``, ``list_background``) and notes
  (``write_note``, ``read_notes``). See :mod:`shim.harnesses.terminal`.

Importing this package registers both in :data:`shim.AGENTS` under
``"python"`` and ``"terminal"``, so ``HarborSpec(agent="python")`` works once
it is imported; ``agent="shim.harnesses:HarborPythonEnv"`` works regardless.
"""

from shim.env import AGENTS
from shim.harnesses.python_kernel import HarborPythonEnv
from shim.harnesses.terminal import HarborTerminalEnv

AGENTS.setdefault("python", HarborPythonEnv)
AGENTS.setdefault("terminal", HarborTerminalEnv)

__all__ = ["HarborPythonEnv", "HarborTerminalEnv"]
