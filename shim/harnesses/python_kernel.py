"""``HarborPythonEnv``: the core Python-kernel harness (:mod:`harbor_async.harnesses.python_kernel`) with TRL's API."""

from harbor_async.harnesses.python_kernel import (
    INSTALL_COMMAND,
    KERNEL_DIR,
    MAX_CELL_OUTPUT,
    PROMPT_SUFFIX,
    PythonHarness,
)
from shim.env import HarborEnv

__all__ = ["PROMPT_SUFFIX", "INSTALL_COMMAND", "KERNEL_DIR", "MAX_CELL_OUTPUT", "HarborPythonEnv"]


class HarborPythonEnv(PythonHarness, HarborEnv):
    """Harness with a persistent Python kernel (``python``) and a shell (``bash``).

    Args:
        environment_type: the backend, as for :class:`shim.HarborEnv`.
        cell_timeout: seconds a cell may run before it is interrupted.
        **kwargs: engine options and ``backend_kwargs``, as for :class:`shim.HarborEnv`.
    """
