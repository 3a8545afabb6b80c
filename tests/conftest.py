"""Shared fixtures: both async backends, the bundled suite, and a leak check after every test."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from harbor_async.backends.simulated import SimulatedEnvironment
from harbor_async.suites import example_suite_path

LOCAL_ROOT = Path(os.environ.get("HARBOR_ASYNC_LOCAL_ROOT", "/tmp/harbor-async-local"))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Core logic runs under both async libraries."""
    return request.param


@pytest.fixture
def suite_root() -> Path:
    """The bundled example suite."""
    return example_suite_path()


@pytest.fixture
def example_tasks(suite_root: Path):
    """The bundled suite's tasks, parsed by Harbor."""
    from harbor_async.tasks import load_suite

    return load_suite(suite_root).tasks


@pytest.fixture(autouse=True)
def _simulated_observations():
    SimulatedEnvironment.reset_observations()
    yield


def _bwrap_pids() -> set[str]:
    """Live bubblewrap processes (zombies waiting for init to reap them hold nothing)."""
    found = subprocess.run(["ps", "-eo", "pid=,stat=,comm="], capture_output=True, text=True)
    return {
        pid
        for pid, stat, comm in (line.split(None, 2) for line in found.stdout.splitlines() if line.strip())
        if comm.strip() == "bwrap" and not stat.startswith("Z")
    }


def _sandbox_dirs() -> set[Path]:
    trial_dirs = set(Path(tempfile.gettempdir()).glob("harbor-async-ha*"))
    local_dirs = set(LOCAL_ROOT.glob("harbor-async-*")) if LOCAL_ROOT.is_dir() else set()
    return trial_dirs | local_dirs


@pytest.fixture(autouse=True)
def no_leaked_sandboxes():
    """After every test: no bubblewrap process, no sandbox folder, no simulated sandbox left."""
    pids_before, dirs_before = _bwrap_pids(), _sandbox_dirs()
    yield
    assert SimulatedEnvironment.live_now == 0, "a simulated sandbox was left running"
    assert _bwrap_pids() - pids_before == set(), "a bubblewrap process was left running"
    assert _sandbox_dirs() - dirs_before == set(), "a sandbox folder was left behind"
