"""Preflight: start and stop one sandbox before the first batch, so a misconfiguration fails at once.

A missing backend extra, a missing bubblewrap, wrong credentials or an image
that cannot be built would otherwise surface as a batch of failed rollouts in
the middle of training.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harbor_async.backends import BackendSpec
from harbor_async.core.errors import PreflightError
from harbor_async.tasks.suite import load_task
from shim import engines
from shim.options import EngineOptions


def preflight(task_dir: Path, backend: BackendSpec, options: EngineOptions, backend_kwargs: dict[str, Any]) -> None:
    """Start one sandbox of ``backend`` on the task at ``task_dir``, then stop it.

    Raises:
        PreflightError: the sandbox could not be started (the cause is chained
            and named in the message).
    """
    task = load_task(task_dir)
    engine = engines.engine_for(options)

    async def start_and_stop() -> None:
        sandbox = engine.launch(task, backend, backend_kwargs=backend_kwargs)
        try:
            await sandbox.wait_started()
        finally:
            await sandbox.stop()

    budget = sum(t for t in (options.start_timeout, options.stop_timeout) if t is not None) or None
    try:
        engines.call(start_and_stop, timeout=budget + 5.0 if budget is not None and math.isfinite(budget) else None)
    except Exception as exc:
        raise PreflightError(
            f"preflight: a {backend.name!r} sandbox for task {task.name!r} could not be started, so training "
            f"would only score failures: {exc} (pass preflight=False to skip this check)"
        ) from exc
