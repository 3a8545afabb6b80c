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
(engine options), :mod:`shim.engines` (shared engines), :mod:`shim.trl_harness`
(TRL-style harness classes run on the engine), :mod:`shim.trainer`
(``HarborGRPOTrainer``: concurrent tool rounds, failed sandboxes out of the loss,
env metrics; imported on first use, as it imports trl and torch), :mod:`shim.prefetch`
and :mod:`shim.lookahead` (its opt-in starts ahead of the next step),
:mod:`benchmarks.reference` (TRL's own env on any backend, for comparisons; imports trl).
"""

from typing import TYPE_CHECKING, Any

import shim.harnesses  # noqa: E402,F401 - registers the "python" and "terminal" harnesses in AGENTS
from harbor_async.core.errors import (
    InfrastructureBudgetError,
    PreflightError,
    SandboxLimitError,
)
from shim.env import AGENTS, HarborBashEnv, HarborEnv
from shim.options import EngineOptions
from shim.spec import HarborSpec

if TYPE_CHECKING:
    from shim.trainer import HarborGRPOTrainer

__all__ = [
    "AGENTS",
    "EngineOptions",
    "HarborBashEnv",
    "HarborEnv",
    "HarborGRPOTrainer",
    "HarborSpec",
    "InfrastructureBudgetError",
    "PreflightError",
    "SandboxLimitError",
]


def __getattr__(name: str) -> Any:
    # HarborGRPOTrainer imports trl and torch: only when asked for.
    if name == "HarborGRPOTrainer":
        from shim.trainer import HarborGRPOTrainer

        return HarborGRPOTrainer
    raise AttributeError(f"module 'shim' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the lazy one (``HarborGRPOTrainer``), for completion and ``help()``."""
    return sorted({*globals(), *__all__})
