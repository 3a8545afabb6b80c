"""The bundled richer harnesses with TRL's API: the core harnesses on the shim's ``HarborEnv``.

- :class:`HarborPythonEnv` (``agent="python"``): a persistent Python kernel
  (``python``) plus a shell (``bash``). See :mod:`harbor_async.harnesses.python_kernel`.
- :class:`HarborTerminalEnv` (``agent="terminal"``): a terminal whose working
  folder persists (``run``), background jobs (``start_background``,
  ``read_output``, ``stop_background``, ``list_background``) and notes
  (``write_note``, ``read_notes``). See :mod:`harbor_async.harnesses.terminal`.

The tools live in the core (``eval`` runs them without the shim); these classes
add ``reset``/``reward`` and the engine options. Importing this package
registers both in :data:`shim.AGENTS` under ``"python"`` and ``"terminal"``.
"""

from shim.env import AGENTS
from shim.harnesses.python_kernel import HarborPythonEnv
from shim.harnesses.terminal import HarborTerminalEnv

AGENTS.setdefault("python", HarborPythonEnv)
AGENTS.setdefault("terminal", HarborTerminalEnv)

__all__ = ["HarborPythonEnv", "HarborTerminalEnv"]
