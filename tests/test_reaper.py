"""The leaked-sandbox reaper on the local (bubblewrap) backend, its CLI and the
engine's ``reap_stale`` option; the docker side is in test_docker.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from harbor_async.backends import leftovers, reaper
from harbor_async.backends.docker import cleanup as docker_cleanup
from harbor_async.backends.local.cleanup import read_marker
from harbor_async.core import naming
from harbor_async.engine.engine import Engine
from tests.engine_child import kill_mid_batch
from tests.requirements import needs_bwrap

REPO = Path(__file__).resolve().parents[1]



@pytest.fixture(autouse=True)
def private_local_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own local-backend root (inherited by the processes it starts),
    so that its reaps never touch sandboxes of other runs on this machine."""
    root = tmp_path / "local-root"
    monkeypatch.setenv(naming.LOCAL_ROOT_ENV, str(root))
    return root


def _harbor_async(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harbor_async", *args],
        capture_output=True, text=True, cwd=REPO, timeout=120, env=env,
    )  # fmt: skip


def _live_processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and text in argv:
            found.append(f"{entry.name}: {argv.replace(chr(0), ' ')[:120]}")
    return found


def _dead_pid() -> int:
    """A pid that no process has now."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _fake_local_sandbox(root: Path, owner_pid: int, created_at: datetime, pids: list[int] = ()) -> Path:
    """A local sandbox folder as the backend writes it (marker + fs/)."""
    session = f"ha{owner_pid}x00beef-{os.urandom(5).hex()}"
    folder = root / f"harbor-async-ha{owner_pid}x00beef-{session}"
    (folder / "fs" / "workdir").mkdir(parents=True)
    (folder / "fs" / "workdir" / "locked").mkdir(mode=0o000)  # rmtree must cope
    marker = {
        "run_label": f"ha{owner_pid}x00beef",
        "session_id": session,
        "environment_name": "t",
        "created_at": created_at.isoformat(),
        "owner_pid": owner_pid,
        "pids": list(pids),
    }
    (folder / naming.MARKER_NAME).write_text(json.dumps(marker))
    return folder


# ─── pure helpers ─────────────────────────────────────────────────────────────


def test_engine_sandbox_ids_carry_the_owner_pid():
    from harbor_async.core.naming import new_run_label

    label = new_run_label()
    match = naming.SESSION_RE.fullmatch(f"{label}-0123456789")
    assert match is not None and int(match["pid"]) == os.getpid() and match["label"] == label


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("10m", 600), ("2h", 7200), ("1d", 86400), ("1h30m", 5400), ("0.5m", 30)],
)
def test_parse_duration(text, seconds):
    assert reaper.parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "m", "10x", "ten minutes", "10m5", "-5m"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="not a duration"):
        reaper.parse_duration(text)


def test_format_age():
    assert [reaper.format_age(timedelta(seconds=s)) for s in (5, 125, 3 * 3600 + 720, 2 * 86400 + 4 * 3600)] == [
        "5s", "2m", "3h12m", "2d4h",
    ]  # fmt: skip
    assert reaper.format_age(None) == "?"


def test_owner_alive_rejects_a_reused_pid():
    now = datetime.now(UTC)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        # A process that started before the sandbox was created may own it ...
        assert leftovers.owner_alive(sleeper.pid, now + timedelta(seconds=5)) is True
        # ... one that started after it (the pid was reused) does not.
        assert leftovers.owner_alive(sleeper.pid, now - timedelta(days=1)) is False
    finally:
        sleeper.kill()
        sleeper.wait()
    assert leftovers.owner_alive(sleeper.pid, now) is False
    assert leftovers.owner_alive(None, now) is None
    assert leftovers.owner_alive(os.getpid(), now - timedelta(days=365)) is True


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare as root")
def test_an_owner_inside_a_nested_pid_namespace_counts_as_alive():
    """A run inside a container records its pid there; from here that pid is another process."""
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        sleeper = None
        while sleeper is None and time.monotonic() < deadline:
            sleeper = next((p for p in leftovers.nested_pids().get(1, []) if leftovers.parent_pid(p) == inner.pid), None)
            time.sleep(0.02)
        assert sleeper is not None, "the namespace's pid 1 is not listed"
        created = datetime.now(UTC)
        dead = _dead_pid()
        # As if the owner had recorded pid `dead` inside its namespace, where the sleeper has it.
        assert leftovers.owner_alive(dead, created, {dead: [sleeper]}) is True
        assert leftovers.owner_alive(dead, created - timedelta(days=1), {dead: [sleeper]}) is False
        assert leftovers.owner_alive(dead, created, {}) is False
    finally:
        inner.kill()
        inner.wait()


def test_compose_command_lines_name_their_project():
    argv = [
        "docker", "compose", "--project-name", "ha12x0abcde-0123456789",
        "-f", "/tmp/tmpabcdefgh/docker-compose-mounts.json", "up",
    ]  # fmt: skip
    assert docker_cleanup._compose_project_of(argv) == "ha12x0abcde-0123456789"
    plugin = ["/root/.docker/cli-plugins/docker-compose", "compose", "-p", "x", "down"]
    assert docker_cleanup._compose_project_of(plugin) == "x"
    assert docker_cleanup._compose_project_of(["python", "--project-name", "x"]) is None
    tmp = Path(tempfile.gettempdir()).resolve()
    mounts = tmp / "tmpabcdefgh" / "docker-compose-mounts.json"
    assert docker_cleanup._harbor_compose_dirs([str(mounts)]) == {mounts.parent}
    assert docker_cleanup._harbor_compose_dirs(["/work/task/docker-compose.yaml", str(tmp / "mine" / "compose.json")]) == set()


# ─── local sandboxes: real folders and processes ──────────────────────────────


def test_reap_keeps_live_owners_unless_forced_and_honours_older_than(tmp_path):
    now = datetime.now(UTC)
    live = _fake_local_sandbox(tmp_path, os.getpid(), now)
    dead = _fake_local_sandbox(tmp_path, _dead_pid(), now - timedelta(minutes=30))
    young_dead = _fake_local_sandbox(tmp_path, _dead_pid(), now)

    by_folder = {Path(reaper._folder_of(s)): s for s in reaper.list_sandboxes("local", roots=[tmp_path])}
    assert {live, dead, young_dead} <= set(by_folder)
    assert by_folder[live].owner_alive is True and by_folder[live].owner_pid == os.getpid()
    assert by_folder[dead].owner_alive is False
    assert by_folder[dead].age > timedelta(minutes=29)

    report = reaper.reap(timedelta(minutes=10), backend="local", roots=[tmp_path])
    assert report.ok, report.errors
    assert not dead.exists()
    assert live.exists() and young_dead.exists()
    reasons = {Path(reaper._folder_of(info)): why for info, why in report.skipped}
    assert "younger than" in reasons[young_dead]

    report = reaper.reap(backend="local", roots=[tmp_path])
    assert not young_dead.exists() and live.exists()
    assert "alive" in {Path(reaper._folder_of(i)): w for i, w in report.skipped}[live]

    report = reaper.reap(include_live_owners=True, backend="local", roots=[tmp_path])
    assert report.ok and not live.exists()


def _bwrap_argv(fs: Path) -> list[str]:
    return [
        "bwrap", "--unshare-pid", "--bind", str(fs), "/", "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
        "--proc", "/proc", "--dev", "/dev", "--", "/usr/bin/sleep", "600",
    ]  # fmt: skip


@pytest.mark.slow
@needs_bwrap
def test_reap_kills_the_orphaned_bwrap_processes_of_a_dead_owners_sandbox(tmp_path):
    folder = _fake_local_sandbox(tmp_path, _dead_pid(), datetime.now(UTC) - timedelta(seconds=5))
    fs = folder / "fs"
    # A bwrap that outlived its owner (no --die-with-parent): re-parented to init.
    spawner = subprocess.run(
        ["sh", "-c", 'setsid "$@" >/dev/null 2>&1 </dev/null & echo $!', "sh", *_bwrap_argv(fs)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    orphan = int(spawner.stdout.strip())
    try:
        deadline = time.monotonic() + 10
        while leftovers.parent_pid(orphan) not in (None, 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        [info] = reaper.list_sandboxes("local", roots=[tmp_path])
        assert info.owner_alive is False
        assert ("process", str(orphan)) in {(r.kind, r.ref) for r in info.resources}

        result = _harbor_async("sandboxes", "reap", "--backend", "local", "--local-root", str(tmp_path))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "reaped 1" in result.stdout
        assert leftovers.process_start_time(orphan) is None  # gone (or a zombie of init's)
        assert not folder.exists()
        assert _live_processes_mentioning(str(fs)) == []
    finally:
        if leftovers.process_start_time(orphan) is not None:
            os.kill(orphan, signal.SIGKILL)


@needs_bwrap
def test_a_sandbox_process_with_a_live_parent_means_a_live_owner(tmp_path):
    """The recorded pid may be of another pid namespace; the sandbox's processes tell the truth."""
    folder = _fake_local_sandbox(tmp_path, _dead_pid(), datetime.now(UTC) - timedelta(hours=1))
    bwrap = subprocess.Popen(_bwrap_argv(folder / "fs"), start_new_session=True)  # its parent: this process
    try:
        [info] = reaper.list_sandboxes("local", roots=[tmp_path])
        assert info.owner_alive is True
        report = reaper.reap(timedelta(minutes=10), backend="local", roots=[tmp_path])
        assert report.reaped == [] and folder.exists() and bwrap.poll() is None
        assert any(reaper._folder_of(i) == str(folder) and "alive" in why for i, why in report.skipped)
    finally:
        os.killpg(bwrap.pid, signal.SIGKILL)  # its pid namespace's init too
        bwrap.wait()
    # Its process gone, the recorded (dead) pid decides again.
    assert reaper.reap(backend="local", roots=[tmp_path]).reaped
    assert not folder.exists()


def test_an_owner_of_another_pid_namespace_is_unknown_and_needs_an_age_or_force(tmp_path):
    folder = _fake_local_sandbox(tmp_path, os.getpid(), datetime.now(UTC) - timedelta(minutes=5))
    marker = json.loads((folder / naming.MARKER_NAME).read_text())
    (folder / naming.MARKER_NAME).write_text(json.dumps({**marker, "pid_ns": "pid:[1]"}))
    [info] = reaper.list_sandboxes("local", roots=[tmp_path])
    assert info.owner_alive is None
    report = reaper.reap(backend="local", roots=[tmp_path])
    assert report.reaped == [] and folder.exists()
    assert any("unknown" in why for _, why in report.skipped)
    assert reaper.reap(timedelta(minutes=10), backend="local", roots=[tmp_path]).reaped == []
    assert folder.exists()
    assert reaper.reap(timedelta(minutes=1), backend="local", roots=[tmp_path]).reaped
    assert not folder.exists()


@pytest.mark.slow
@needs_bwrap
def test_reap_after_kill_9_in_the_middle_of_a_local_batch():
    child = kill_mid_batch("--backend", "local", "--count", "6", "--ready", "4", "--exec", "sleep 600", timeout=120)
    label = child.label
    assert child.returncode == -signal.SIGKILL
    root = Path(os.environ.get(naming.LOCAL_ROOT_ENV) or naming.DEFAULT_LOCAL_ROOT)
    assert len(list(root.glob(f"harbor-async-{label}-*"))) >= 4
    trial_dirs = list(Path(tempfile.gettempdir()).glob(f"harbor-async-{label}-*"))
    assert len(trial_dirs) >= 4

    listed = _harbor_async("sandboxes", "list", "--backend", "local", "--json", "--run-label", label)
    entries = [json.loads(line) for line in listed.stdout.splitlines() if line.startswith("{")]
    assert len(entries) >= 4
    assert {(e["owner_pid"], e["owner_alive"]) for e in entries} == {(child.pid, False)}
    # and the sandboxes its engine had made ahead (local.pool): reaped with the rest
    assert set(child.ids) >= {e["id"] for e in entries if not e["id"].startswith("pool-")}

    # Scoped to this run: a plain reap would also take what other runs' dead owners left.
    result = _harbor_async("sandboxes", "reap", "--run-label", label)
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(re.search(r"reaped (\d+)", result.stdout)[1]) >= len(entries)
    assert list(root.glob(f"harbor-async-{label}-*")) == []
    assert list(Path(tempfile.gettempdir()).glob(f"harbor-async-{label}-*")) == []
    assert _live_processes_mentioning(f"harbor-async-{label}-") == []
    assert reaper.list_sandboxes(run_label=label) == []


@pytest.mark.slow
@needs_bwrap
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_engine_reap_stale_removes_what_a_killed_run_left(tmp_path, monkeypatch):
    monkeypatch.delenv(naming.LOCAL_ROOT_ENV)  # the engine is told its root below
    env = {**os.environ, naming.LOCAL_ROOT_ENV: str(tmp_path)}
    label = kill_mid_batch("--backend", "local", "--count", "2", "--ready", "2", timeout=120, env=env).label
    left = list(tmp_path.glob(f"harbor-async-{label}-*"))  # with what its engine made ahead (local.pool)
    assert len([f for f in left if "-pool-" not in f.name]) == 2

    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path)}):
        pass  # opt-in: the default reaps nothing
    assert all(folder.exists() for folder in left)

    async with Engine(reap_stale=True, backend_kwargs={"sandbox_root": str(tmp_path)}) as engine:
        assert not any(folder.exists() for folder in left)
        assert engine.live_sandboxes() == []
    assert list(Path(tempfile.gettempdir()).glob(f"harbor-async-{label}-*")) == []


@pytest.mark.slow
@needs_bwrap
def test_the_next_run_removes_what_a_killed_run_left_and_says_so(tmp_path):
    env = {**os.environ, naming.LOCAL_ROOT_ENV: str(tmp_path / "sandboxes")}
    label = kill_mid_batch("--backend", "local", "--count", "2", "--ready", "2", "--exec", "sleep 600", timeout=120, env=env).label
    left = list((tmp_path / "sandboxes").glob(f"harbor-async-{label}-*"))  # with what its engine made ahead
    assert len([f for f in left if "-pool-" not in f.name]) == 2
    suite = tmp_path / "suite" / "tasks"
    shutil.copytree(Path(__file__).parent.parent / "harbor_async" / "suites" / "example" / "tasks" / "csv-column-sum", suite / "one")
    ran = _harbor_async("run", "-p", str(suite.parent), "-o", str(tmp_path / "jobs"), env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "reaped sandboxes left by dead runs" in ran.stderr and label in ran.stderr  # it says what it removed
    kept = {f.name: (sorted(p.name for p in f.iterdir()), read_marker(f)) for f in left if f.exists()}
    assert kept == {}, ran.stderr[-3000:]  # each with what it holds and its marker: which piece was left, and why
    assert list(Path(tempfile.gettempdir()).glob(f"harbor-async-{label}-*")) == []  # its trial folders too
    assert _live_processes_mentioning(f"harbor-async-{label}-") == []


@pytest.mark.slow
def test_cli_rejects_bad_options():
    bad_backend = _harbor_async("sandboxes", "reap", "--backend", "podman")
    assert bad_backend.returncode == 2 and "--env" in bad_backend.stderr
    bad_age = _harbor_async("sandboxes", "reap", "--older-than", "soon")
    assert bad_age.returncode == 2 and "not a duration" in bad_age.stderr


@pytest.mark.slow
def test_cli_lists_a_leaked_sandbox_in_a_table(tmp_path):
    pid = _dead_pid()
    _fake_local_sandbox(tmp_path, pid, datetime.now(UTC) - timedelta(minutes=12))
    result = _harbor_async("sandboxes", "list", "--backend", "local", "--local-root", str(tmp_path))
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if f"ha{pid}x00beef" in line)
    cells = [c.strip() for c in row.strip("│┃ ").split("│")]
    assert cells[0] == "local" and cells[3] == str(pid) and cells[4] == "no" and cells[5] == "12m"
    assert reaper.reap(backend="local", roots=[tmp_path]).ok
    assert list(tmp_path.iterdir()) == []
