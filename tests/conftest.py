"""Shared fixtures: both async backends, the bundled suite, and a leak check after every test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Every test session gets its own temporary folder and local-sandbox root, so the
# leak check sees this session's sandboxes only (other runs may share the machine).
# Under `pytest -n`, each worker's folder sits beside the controller's, not inside it (a socket path inside
# two nested session folders is past AF_UNIX's 108 bytes).
os.environ.setdefault("HARBOR_ASYNC_TESTS_TMP", tempfile.gettempdir())
SESSION_DIR = Path(tempfile.mkdtemp(prefix="harbor-async-tests-", dir=os.environ["HARBOR_ASYNC_TESTS_TMP"]))
(SESSION_DIR / "tmp").mkdir()
os.environ["TMPDIR"] = str(SESSION_DIR / "tmp")
tempfile.tempdir = None  # forget the cached default so the new TMPDIR applies
if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of `pytest -n`: its own root, not the one it inherited,
    os.environ["HARBOR_ASYNC_LOCAL_ROOT"] = str(SESSION_DIR / "local")
    # and its own label for sandboxes made outside an engine (their names and cgroups: "adhoc" by default)
    os.environ["HARBOR_ASYNC_RUN_LABEL"] = f"adhoc{os.environ['PYTEST_XDIST_WORKER']}"
os.environ.setdefault("HARBOR_ASYNC_LOCAL_ROOT", str(SESSION_DIR / "local"))
LOCAL_ROOT = Path(os.environ["HARBOR_ASYNC_LOCAL_ROOT"])

from harbor_async.backends.simulated import SimulatedEnvironment  # noqa: E402
from harbor_async.engine.loop import uses_uvloop  # noqa: E402

if uses_uvloop():  # HARBOR_ASYNC_UVLOOP=1 (.ci/run's second pass, the `uvloop_pass` tests): every asyncio loop is uvloop's
    import asyncio

    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
from harbor_async.suites import example_suite_path  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: `-m cluster_or_docker` sees the marker added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (.ci/run), pin the tests that share one thing to one worker each.

    The session's Ray cluster is one per process (a second on the same machine would fight over its
    ports): the tests on it run in order on one worker (group ``ray``). The docker tests build, tag and delete
    the same task images (``sandboxes prune`` and ``--delete`` remove every idle one): they run in order on
    one worker too (group ``docker``), which may be another. Should a test ever use both, every one of them
    shares one group again (``ray-and-docker``). Without xdist the groups do nothing. They are also marked
    ``cluster_or_docker``, which .ci/range selects by: its two environments run the other tests side by side,
    and these one environment after the other. A module whose module-scoped fixture is costly (a trainer's
    runs, a model, a wheel's venv, a browser) is marked ``one_worker``: its other tests share a group named
    after it, since loadgroup hands ungrouped tests out one by one and every worker that got one of them would
    build that fixture again. (A marker, not the module's own ``xdist_group``: xdist joins every group a test
    has into one new name, which would take its Ray or docker tests out of those groups.)
    """
    shared = {item: _shares(item) for item in items}
    both = any(uses == {"ray", "docker"} for uses in shared.values())
    for item, uses in shared.items():
        if uses:
            group = "ray-and-docker" if both else uses.pop()
            item.add_marker(pytest.mark.xdist_group(group))
            item.add_marker(pytest.mark.cluster_or_docker)
        elif item.get_closest_marker("one_worker") is not None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


#: Set in an xdist worker whose loadgroup lost the groups: every grouped test fails with it (a worker's own
#: errors at collection reach the user as an unexplained INTERNALERROR).
_LOST_GROUPS: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker under ``--dist loadgroup``: every grouped test's id must carry its group (``@ray``),
    which is all xdist's scheduler reads. pytest 9.2 silently dropped that suffix (pytest-dev/pytest-xdist#1386):
    the Ray tests then started a cluster on each worker and the docker tests pruned each other's images. The
    grouped tests fail, saying so, instead of running with the groups quietly not holding."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        _LOST_GROUPS.append(
            f"pytest-xdist's loadgroup lost the xdist_group of {len(lost)} tests, which would then share a "
            "worker's Ray cluster or Docker images with another: see pytest-dev/pytest-xdist#1386 and the "
            "pytest pin in pyproject.toml"
        )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _LOST_GROUPS and item.get_closest_marker("xdist_group"):
        pytest.fail(_LOST_GROUPS[0], pytrace=False)


def _shares(item: pytest.Item) -> set[str]:
    """What of the session's shared things a test uses: ``ray`` (the session's cluster) and ``docker`` (the
    daemon's images: marked, named, or saying so in its code)."""
    import inspect

    uses = {"ray"} if "ray_cluster" in getattr(item, "fixturenames", ()) else set()
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        source = ""
    if item.get_closest_marker("docker") is not None or "docker" in item.nodeid or "docker" in source:
        uses.add("docker")
    return uses


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the session folder (leaks were reported by the per-test check)."""
    import shutil

    shutil.rmtree(SESSION_DIR, ignore_errors=True)


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
    from harbor_async.tasks.suite import load_suite

    return load_suite(suite_root).tasks


@pytest.fixture(autouse=True)
def _simulated_observations():
    SimulatedEnvironment.reset_observations()
    yield


@pytest.fixture(autouse=True)
def _fresh_rollout_guards():
    """Each test starts with the shim's failure budgets untouched (they are per option set, process-wide)."""
    yield
    import sys

    engines = sys.modules.get("shim.engines")
    if engines is not None:
        engines._guards.clear()


def _bwrap_pids() -> set[str]:
    """Live bubblewrap processes of this session's sandboxes (zombies hold nothing)."""
    found = subprocess.run(["ps", "-eo", "pid=,stat=,comm=,args="], capture_output=True, text=True)
    pids = set()
    for line in found.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[2] == "bwrap" and not parts[1].startswith("Z") and str(SESSION_DIR) in parts[3]:
            pids.add(parts[0])
    return pids


def _sandbox_dirs() -> set[Path]:
    trial_dirs = set(Path(tempfile.gettempdir()).glob("harbor-async-ha*"))
    local_dirs = set(LOCAL_ROOT.glob("harbor-async-*")) if LOCAL_ROOT.is_dir() else set()
    return trial_dirs | local_dirs


def _pooled() -> tuple[set[str], set[Path]]:
    """The keepers and folders of the local sandboxes made ahead for an engine still open (the shim's
    engines live until exit): owned, not leaked; closing the engine removes them (test_local_pool)."""
    pool = sys.modules.get("harbor_async.backends.local.pool")
    if pool is None:
        return set(), set()
    pieces = pool.POOL.ready(settle=10.0)
    return {str(p.keeper.process.pid) for p in pieces if p.keeper is not None}, {p.folder for p in pieces}


@pytest.fixture(autouse=True)
def no_leaked_sandboxes():
    """After every test: no bubblewrap process, no sandbox folder, no simulated sandbox left."""
    pids_before, dirs_before = _bwrap_pids(), _sandbox_dirs()
    yield
    assert SimulatedEnvironment.live_now == 0, "a simulated sandbox was left running"
    # What runs and exists first, what the pool owns after: a piece its thread was making for an engine
    # still open (a shim's) is in the first and, once made, in the second; one begun after is in neither.
    pids_after, dirs_after = _bwrap_pids(), _sandbox_dirs()
    pooled_pids, pooled_dirs = _pooled()
    # A piece the pool is discarding (its engine closed, its build failed) is being killed now: a leak is what
    # is still running a few seconds later.
    leaked = _still_running(pids_after - pids_before - pooled_pids, within=10.0)
    assert leaked == set(), "a bubblewrap process was left running"
    left = {folder for folder in dirs_after - dirs_before - pooled_dirs if folder.exists()}  # a discard is done now
    assert left == set(), "a sandbox folder was left behind"


def _still_running(pids: set[str], within: float) -> set[str]:
    """Those of ``pids`` still live bubblewrap processes after up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while pids and time.monotonic() < deadline:
        pids &= _bwrap_pids()
        if pids:
            time.sleep(0.1)
    return pids


# ── one Ray cluster for the session ─────────────────────────────────────────


@pytest.fixture(scope="session")
def ray_session_cluster():
    """A real Ray cluster on this machine (a head and one worker node, tests/cluster_helpers.py), started
    once, by the first test that needs one, and stopped at the end of the session. Ray is an extra: without
    it the test errors (it is never skipped). Tests take it through ``ray_cluster``."""
    from tests.cluster_helpers import RayCluster

    cluster = RayCluster(workers=1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def ray_cluster(ray_session_cluster):
    """The session's Ray cluster, this process connected to it; what a test leaves there that the next
    test could trip on (the named budget actor, with that test's caps) is removed after it. Each test keeps
    its own job folders (``tmp_path``)."""
    from tests.cluster_helpers import clean_up_after_a_test, connect

    connect(ray_session_cluster)
    yield ray_session_cluster
    clean_up_after_a_test()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last of a run of cluster tests, disconnect this process from the cluster (left running for
    later ones): a test without ``ray_cluster`` sees a process that never connected, as it would alone."""
    yield
    uses = "ray_cluster" in getattr(item, "fixturenames", ())
    if uses and (nextitem is None or "ray_cluster" not in getattr(nextitem, "fixturenames", ())):
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


# ── the installed TRL ───────────────────────────────────────────────────────


def trl_reads_get_reward() -> bool:
    """Whether the installed TRL counts an env's ``get_reward`` (``HarborSpec(env_reward=True)``, TRL 1.8 on)."""
    import importlib.metadata

    from packaging.specifiers import SpecifierSet

    from harbor_async.cli.machine_checks import SUPPORTED

    try:
        return importlib.metadata.version("trl") in SpecifierSet(SUPPORTED["trl-env-reward"])
    except importlib.metadata.PackageNotFoundError:
        return False


#: For tests of ``env_reward=True`` itself: at the range's lowest end (TRL 1.7) the
#: feature is refused instead, which tests/test_trl_api.py checks there.
needs_trl_get_reward = pytest.mark.skipif(
    not trl_reads_get_reward(),
    reason="HarborSpec(env_reward=True) needs trl>=1.8; its refusal on older TRL is tested in test_trl_api.py",
)


# ── real Docker ─────────────────────────────────────────────────────────────

#: The base image of the bundled suite's Dockerfiles, built offline by .ci/docker-setup.
DOCKER_BASE_IMAGE = "debian:bookworm-slim"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def _docker_problem() -> str | None:
    """Why the docker-marked tests cannot run here, or None when they can."""
    import shutil

    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    checks = (
        (["docker", "info", "--format", "{{.ServerVersion}}"], "the Docker daemon does not answer"),
        (["docker", "compose", "version", "--short"], "Compose v2 ('docker compose') is missing"),
        (["docker", "image", "inspect", DOCKER_BASE_IMAGE], f"the base image {DOCKER_BASE_IMAGE} is missing"),
    )
    for argv, problem in checks:
        try:
            found = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{problem} ({exc})"
        if found.returncode != 0:
            detail = (found.stderr or found.stdout).strip().splitlines()
            return f"{problem}: {detail[-1] if detail else 'exit ' + str(found.returncode)}"
    return None


@pytest.fixture(scope="session")
def docker_daemon() -> str:
    """A Docker daemon with Compose v2 and the suite's base image; returns its version.

    Missing: the test is skipped with the reason, or, with ``CI=true``, fails
    (CI must run the docker tests, never skip them). ``bash .ci/docker-setup``
    (as root) provisions all three.
    """
    problem = _docker_problem()
    if problem is not None:
        message = f"docker tests need a running Docker daemon: {problem}; run `bash .ci/docker-setup` as root"
        if _in_ci():
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    found = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    return found.stdout.strip()


@pytest.fixture
def leak_probe():
    """The leak check's probes, for tests that check teardown in the middle of a test.

    ``bwrap_pids()``: ids of running ``bwrap`` processes; ``sandbox_dirs()``:
    trial and local-sandbox folders that exist now. Both leave out the pieces
    an open engine's pool made ahead (owned, not leaked: see ``_pooled``).
    """
    import types

    return types.SimpleNamespace(
        bwrap_pids=lambda: _bwrap_pids() - _pooled()[0], sandbox_dirs=lambda: _sandbox_dirs() - _pooled()[1]
    )


@pytest.fixture
def host_tmux() -> None:
    """terminus-2 on ``local`` runs the host's tmux (``bash .ci/setup`` installs it); CI must have it."""
    if shutil.which("tmux") is None:
        message = "terminus-2 on local needs tmux on the host: apt-get install tmux (or bash .ci/setup)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes", "on"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
