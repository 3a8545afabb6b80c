"""Fault injection for the trainer tests: a simulated backend whose first start in the process fails."""

from __future__ import annotations

from typing import ClassVar

from harbor_async.backends.simulated import SimulatedEnvironment


class OneFailedStart(SimulatedEnvironment):
    """Fails the first start after :meth:`arm` with a permanent error (a full disk); every other start works."""

    armed: ClassVar[bool] = False

    @classmethod
    def arm(cls) -> None:
        """Make the next start fail."""
        cls.armed = True

    async def start(self, force_build: bool) -> None:
        cls = OneFailedStart
        if cls.armed:
            cls.armed = False
            raise OSError(28, "simulated: disk full (permanent)")
        await super().start(force_build)
