"""The warm enter server (``helpers/enter_server.py``): execs are its children, confined as ``enter.py``'s were.

Real bubblewrap sandboxes; skipped without bwrap except under CI=true.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from harbor_async.backends.local import LocalEnvironment
from harbor_async.backends.local.enter_server import SERVER, ServedProcess, open_join
from harbor_async.backends.local.errors import ExecTimeoutError
from harbor_async.backends.local.sandboxing import join_spec
from tests.requirements import needs_bwrap
from tests.test_local_backend import make_env, make_task

pytestmark = needs_bwrap
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def env(tmp_path: Path):
    environment = make_env(tmp_path, make_task(tmp_path / "suite"), session=f"enter-server-{os.getpid()}")
    await environment.start(force_build=False)
    yield environment
    await environment.stop(delete=True)


def _fds(pid: int) -> dict[int, str]:
    folder = Path(f"/proc/{pid}/fd")
    return {int(name): os.readlink(folder / name) for name in os.listdir(folder)}


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.anyio
async def test_an_exec_is_the_servers_child_and_holds_no_host_descriptor(env: LocalEnvironment) -> None:
    # the shell's own descriptors ([ -e ] opens none; readlink is a child of its own)
    listing = await env.exec("for n in $(seq 0 1023); do [ -e /proc/$$/fd/$n ] && echo $n; done; readlink /proc/$$/fd/[012]")
    assert listing.return_code == 0, listing.stderr
    lines = (listing.stdout or "").split()
    assert lines[:3] == ["0", "1", "2"] and len(lines) == 6, lines  # no socket, pidfd or namespace file of the host's
    assert lines[3] == "/dev/null" and all(target.startswith("pipe:") for target in lines[4:]), lines
    server = SERVER.pid
    assert server is not None  # the exec went through the server
    async with anyio.create_task_group() as group:
        group.start_soon(env.exec, "sleep 2")
        with anyio.fail_after(5):
            while not (pids := json.loads((env.root / ".harbor-async.json").read_text())["pids"]):
                await anyio.sleep(0.02)
        helper = pids[0]
        assert _ppid(helper) == server
        assert Path(f"/proc/{helper}/comm").read_text().strip() == "ha-enter"
        assert os.getsid(helper) == helper  # its own session: the tree is killed by it
        with anyio.fail_after(5):  # entered and waiting for its command: stdio only (namespace files closed)
            while set(_fds(helper)) != {0, 1, 2}:
                await anyio.sleep(0.02)
        group.cancel_scope.cancel()
    # the server never joins a namespace of a sandbox's, and runs as the host's root
    for name in ("mnt", "pid", "user", "net", "ipc", "uts", "cgroup"):
        assert os.readlink(f"/proc/{server}/ns/{name}") == os.readlink(f"/proc/self/ns/{name}")
    assert os.stat(f"/proc/{server}").st_uid == os.getuid()
    assert _ppid(server) == os.getpid()


@pytest.mark.slow
@pytest.mark.anyio
async def test_timeouts_and_cancellation_kill_a_served_exec(env: LocalEnvironment) -> None:
    started = time.monotonic()
    with pytest.raises(ExecTimeoutError):
        await env.exec("sleep 60", timeout_sec=1)
    with anyio.move_on_after(0.5):
        await env.exec("sleep 60")
    assert time.monotonic() - started < 10
    assert json.loads((env.root / ".harbor-async.json").read_text())["pids"] == []
    found = await env.exec("ps -eo args= | grep -c '^sleep 60' || true")  # the init sleeps 86400
    assert found.stdout.strip() == "0"  # the commands died with their exec


@pytest.mark.anyio
async def test_enter_exit_codes_are_kept(env: LocalEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = {("/no/such/program",): 127, ("/etc",): 126, ("sh", "-c", "exit 7"): 7, ("sh", "-c", "kill -9 $$"): 137}
    for served in (True, False):
        monkeypatch.setenv("HARBOR_ASYNC_LOCAL_ENTER_SERVER", "1" if served else "0")
        for command, code in [*cases.items(), ((("true",), 125))]:
            cwd = "/no/such/folder" if code == 125 else "/"
            spec = join_spec(env._keeper, env._confinement, {"PATH": "/usr/bin:/bin"}, cwd, list(command))
            process = await open_join(spec, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            assert isinstance(process, ServedProcess) is served
            returned = await process.wait()
            await process.aclose()
            assert (128 - returned if returned < 0 else returned) == code, (served, command)


CHILD = """
import asyncio, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.test_local_backend import make_env, make_task
from harbor_async.backends.local.enter_server import SERVER

async def main():
    env = make_env(Path({tmp!r}), make_task(Path({tmp!r}) / "suite"), session="enter-server-dies")
    await env.start(force_build=False)
    print((await env.exec("echo up")).stdout.strip(), SERVER.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.slow
def test_the_server_dies_with_its_host_process(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(repo=str(REPO), tmp=str(tmp_path))],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        word, server = child.stdout.readline().split()
        assert word == "up"
        server_pid = int(server)
        assert _ppid(server_pid) == child.pid
        assert "enter_server.py" in Path(f"/proc/{server_pid}/cmdline").read_text()
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{server_pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{server_pid}")
    from harbor_async.backends import (
        reaper,  # what the killed host left: its folder, tmpfs and cgroups
    )

    report = reaper.reap(include_live_owners=False, older_than=None, backend="local", roots=[tmp_path / "sandboxes"])
    assert report.ok, report.errors


@pytest.mark.slow
def test_execs_do_without_the_server_when_it_is_off(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import anyio, sys
        sys.path.insert(0, {repo!r})
        from pathlib import Path
        from tests.test_local_backend import make_env, make_task
        from harbor_async.backends.local.enter_server import SERVER

        async def main():
            env = make_env(Path({tmp!r}), make_task(Path({tmp!r}) / "suite"), session="enter-server-off")
            await env.start(force_build=False)
            try:
                print((await env.exec("echo ok")).stdout.strip(), SERVER.pid)
            finally:
                await env.stop(delete=True)

        anyio.run(main)
        """
    ).format(repo=str(REPO), tmp=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, "HARBOR_ASYNC_LOCAL_ENTER_SERVER": "0"},
    )  # fmt: skip
    assert done.stdout.split() == ["ok", "None"], done.stderr
