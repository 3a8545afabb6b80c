"""Synchronous TRL shim over the harbor_async engine: a drop-in for ``trl.experimental.harbor``.

Change the import line, keep the rest::

    from shim import HarborSpec   # was: from trl.experimental.harbor import HarborSpec

Every env call runs on harbor_async's one loop thread: ``reset()`` returns at
once and starts the sandbox in the background, tool calls wait only for their
own sandbox, ``spec.reward_funcs`` verifies a batch concurrently, and
``close()`` / interpreter exit / SIGTERM stop every sandbox within a bounded time.

Modules: :mod:`shim.spec` (``HarborSpec``), :mod:`shim.env` (``HarborEnv``,
``HarborBashEnv``), :mod:`shim.rewards` (batched reward, env-owned reward),
:mod:`shim.episode` (one rollout on the loop thread), :mod:`shim.options`
(engine options), :mod:`shim.engines` (shared engines), :mod:`benchmarks.reference`
(TRL's own env on any backend, for comparisons; imports trl).
"""

from harbor_async.errors import InfrastructureBudgetError, PreflightError, SandboxLimitError
from shim.env import AGENTS, HarborBashEnv, HarborEnv
from shim.options import EngineOptions
from shim.spec import HarborSpec

import shim.harnesses  # noqa: E402,F401 - registers the "python" and "terminal" harnesses in AGENTS

__all__ = [
    "AGENTS",
    "EngineOptions",
    "HarborBashEnv",
    "HarborEnv",
    "HarborSpec",
    "InfrastructureBudgetError",
    "PreflightError",
    "SandboxLimitError",
]
