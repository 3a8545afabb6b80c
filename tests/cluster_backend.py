"""A simulated environment that counts live sandboxes ACROSS processes, by files in a shared folder.

Each started sandbox leaves a marker file in ``$HARA_LIVE_DIR`` until it
stops, and after every start records how many markers it saw; the highest
count any process saw is the cluster's observed peak of live sandboxes,
counted by the backend, not by any budget's ledger.
"""

from __future__ import annotations

import os
from pathlib import Path

from harbor_async.backends.simulated import SimulatedEnvironment


def live_dir() -> Path:
    return Path(os.environ["HARA_LIVE_DIR"])


def observed_peak(folder: Path) -> int:
    """The highest count of live sandboxes any process observed."""
    return max((int(p.read_text() or 0) for p in folder.glob("peak-*")), default=0)


class CountingEnvironment(SimulatedEnvironment):
    """Simulated sandbox with a marker file while it lives."""

    async def start(self, force_build: bool) -> None:
        await super().start(force_build)
        folder = live_dir()
        (folder / f"live-{os.getpid()}-{self.session_id}").touch()
        seen = len(list(folder.glob("live-*")))
        peak_file = folder / f"peak-{os.getpid()}"
        before = int(peak_file.read_text() or 0) if peak_file.exists() else 0
        if seen > before:
            peak_file.write_text(str(seen))

    async def stop(self, delete: bool) -> None:
        try:
            (live_dir() / f"live-{os.getpid()}-{self.session_id}").unlink(missing_ok=True)
        finally:
            await super().stop(delete)
