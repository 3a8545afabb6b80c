"""A Harbor environment whose start always fails permanently (fault injection for CLI tests)."""

from __future__ import annotations

from harbor_async.backends.simulated import SimulatedEnvironment


class FailingStartEnvironment(SimulatedEnvironment):
    """Fails every start with a permanent error, as a full disk would."""

    async def start(self, force_build: bool) -> None:
        raise OSError(28, "simulated: disk full (permanent)")
