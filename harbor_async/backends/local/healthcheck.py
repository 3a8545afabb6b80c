"""Harbor's healthcheck loop with anyio's sleeps, so that it also runs under trio."""

from __future__ import annotations

import time
from typing import Any

import anyio
from harbor.environments.base import HealthcheckError
from harbor.models.task.config import HealthcheckConfig


async def run_healthcheck(environment: Any, check: HealthcheckConfig | None) -> None:
    """Run ``check.command`` in ``environment`` until it passes, as Harbor does.

    Raises:
        HealthcheckError: it failed ``check.retries`` times in a row after the start period.
    """
    if check is None:
        return
    start_period_end = time.monotonic() + check.start_period_sec
    failures = 0
    while True:
        in_start_period = time.monotonic() < start_period_end
        result = await environment.exec(check.command, timeout_sec=int(check.timeout_sec))
        if result.return_code == 0:
            return
        if in_start_period:
            await anyio.sleep(check.start_interval_sec)
            continue
        failures += 1
        if failures >= check.retries:
            raise HealthcheckError(f"Healthcheck failed after {check.retries} consecutive retries: {check.command}")
        await anyio.sleep(check.interval_sec)
