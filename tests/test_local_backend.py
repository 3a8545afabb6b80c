"""Tests of the bubblewrap backend (harbor_async.backends.local).

They run real sandboxes: they need `bwrap` on PATH and are skipped without it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from harbor.agents.oracle import OracleAgent
from harbor.environments.base import SandboxBuildFailedError
from harbor.environments.factory import EnvironmentFactory
from harbor.models.agent.context import AgentContext
from harbor.models.task.task import Task
from harbor.models.trial.config import EnvironmentConfig as TrialEnvironmentConfig
from harbor.models.trial.paths import EnvironmentPaths, TrialPaths
from harbor.verifier.verifier import Verifier

from harbor_async.backends.local import (
    ExecTimeoutError,
    LocalEnvironment,
    SandboxPathError,
    parse_dockerfile,
)
from tests.requirements import needs_bwrap

IMPORT_PATH = "harbor_async.backends.local:LocalEnvironment"
REPO = Path(__file__).resolve().parents[1]

pytestmark = [needs_bwrap]

DOCKERFILE = """\
FROM debian:bookworm-slim
# comments and continuations are handled
WORKDIR /app
ENV GREETING=hi \\
    PATH=/app/bin:$PATH
COPY data.txt /app/data.txt
COPY tools/ /opt/tools/
RUN apt-get update && \\
    apt-get install -y curl
"""
TEST_SH = """\
#!/bin/bash
if [ "$(cat /app/answer.txt)" = "$GREETING" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_task(root: Path, name: str = "hello", solve: str = 'echo "$GREETING" > /app/answer.txt') -> Path:
    """A minimal valid Harbor task that exercises WORKDIR, ENV, COPY and RUN."""
    task = root / name
    (task / "environment" / "tools").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("Write the greeting to /app/answer.txt.\n")
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n\n[verifier]\ntimeout_sec = 60.0\n\n'
        "[agent]\ntimeout_sec = 60.0\n\n[environment]\nbuild_timeout_sec = 60.0\n"
    )
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (task / "environment" / "data.txt").write_text("some data\n")
    (task / "environment" / "tools" / "tool.sh").write_text("echo tool\n")
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{solve}\n")
    (task / "tests" / "test.sh").write_text(TEST_SH)
    return task


def make_env(tmp_path: Path, task_dir: Path, session: str = "s1", **kwargs) -> LocalEnvironment:
    task = Task(task_dir)
    trial_paths = TrialPaths(tmp_path / f"trial-{session}")
    trial_paths.mkdir()
    return LocalEnvironment(
        environment_dir=task.paths.environment_dir,
        environment_name=task.short_name,
        session_id=session,
        trial_paths=trial_paths,
        task_env_config=task.config.environment,
        sandbox_root=tmp_path / "sandboxes",
        **kwargs,
    )


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    return make_task(tmp_path / "suite")


@pytest.fixture
async def env(tmp_path: Path, task_dir: Path):
    environment = make_env(tmp_path, task_dir)
    await environment.start(force_build=False)
    yield environment
    await environment.stop(delete=True)


def host_processes(pattern: str) -> list[str]:
    """Command lines of host processes matching ``pattern`` (pgrep -f), minus pgrep."""
    result = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if "pgrep" not in line]


async def processes_become(pattern: str, count: int, within: float = 10.0, besides: str | None = None) -> list[str]:
    """The host processes matching ``pattern`` (less those naming ``besides``) once there are ``count``.

    Fails past ``within`` s. A SIGKILLed process is gone a moment after the kill returns, not at once: poll
    for the state the test means instead of sleeping a guessed time and hoping it was long enough.
    """
    deadline = time.monotonic() + within
    while len(found := [p for p in host_processes(pattern) if besides is None or besides not in p]) != count:
        assert time.monotonic() < deadline, f"{pattern!r}: {len(found)} process(es) after {within} s, not {count}: {found}"
        await anyio.sleep(0.02)
    return found


# -- Dockerfile parsing ----------------------------------------------------------


def test_parse_dockerfile_honours_workdir_env_copy_and_names_the_rest() -> None:
    spec = parse_dockerfile(
        """\
FROM python:3.12 AS builder
RUN make build
FROM debian:bookworm-slim
ARG VERSION=1.2
LABEL x=y
WORKDIR /srv
WORKDIR app
ENV A=1 B="two words" C=${VERSION}
ENV LEGACY value with spaces
ENV D=$A-${MISSING:-dflt}
COPY --chown=1000:1000 a.txt b.txt ./
COPY ["src dir", "/dst"]
COPY --from=builder /out /out
ADD https://example.com/x.tgz /x
RUN <<EOF
echo from heredoc
EOF
USER nobody
CMD ["bash"]
""",
        {"PATH": "/bin"},
    )
    assert spec.workdir == "/srv/app"
    assert spec.env == {"A": "1", "B": "two words", "C": "1.2", "LEGACY": "value with spaces", "D": "1-dflt"}
    assert [(c.sources, c.dest, c.dest_is_dir) for c in spec.copies] == [
        (("a.txt", "b.txt"), "/srv/app", True),
        (("src dir",), "/dst", False),
    ]
    ignored = " | ".join(spec.ignored)
    # only the final stage counts; heredoc bodies are not instructions
    assert "make build" not in ignored and "from heredoc" not in ignored
    for name in ("ADD https://", "RUN <<EOF", "USER nobody", "CMD"):
        assert name in ignored
    assert len(spec.ignored) == 4
    assert spec.unsupported == ["line 13: COPY --from=builder /out /out"]  # refused by the run's task check


# -- construction through Harbor ---------------------------------------------------


@pytest.mark.range
def test_harbor_factory_builds_it_from_import_path(tmp_path: Path, task_dir: Path) -> None:
    task = Task(task_dir)
    trial_paths = TrialPaths(tmp_path / "trial")
    config = TrialEnvironmentConfig(
        import_path=IMPORT_PATH,
        kwargs={"sandbox_root": str(tmp_path / "sb"), "run_label": "run/42"},
    )
    env = EnvironmentFactory.create_environment_from_config(
        config=config,
        environment_dir=task.paths.environment_dir,
        environment_name=task.short_name,
        session_id="hello__abc__env",
        trial_paths=trial_paths,
        task_env_config=task.config.environment,
    )
    assert isinstance(env, LocalEnvironment)
    assert env.type() == "local"
    assert env.capabilities.disable_internet and not env.capabilities.mounted
    assert env.root == tmp_path / "sb" / "harbor-async-run_42-hello__abc__env"
    assert env.workdir == "/app"


def test_warning_names_the_ignored_instructions(tmp_path: Path, task_dir: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        env = make_env(tmp_path, task_dir)
    warnings = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert len(warnings) == 1, warnings  # one warning, listing everything
    assert "RUN apt-get update && apt-get install -y curl" in warnings[0]
    assert env.ignored == ["line 8: RUN apt-get update && apt-get install -y curl"]


def test_run_label_and_root_default_from_environment(tmp_path: Path, task_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("HARBOR_ASYNC_RUN_LABEL", "nightly")
    monkeypatch.setenv("HARBOR_ASYNC_LOCAL_ROOT", str(tmp_path / "from-env"))
    task = Task(task_dir)
    env = LocalEnvironment(
        environment_dir=task.paths.environment_dir,
        environment_name="hello",
        session_id="s9",
        trial_paths=TrialPaths(tmp_path / "t"),
        task_env_config=task.config.environment,
    )
    assert env.root == tmp_path / "from-env" / "harbor-async-nightly-s9"


# -- the sandbox -------------------------------------------------------------------------


@pytest.mark.range
@pytest.mark.anyio
async def test_start_exec_stop_honours_dockerfile(env: LocalEnvironment) -> None:
    result = await env.exec('pwd; echo "$GREETING"; echo "$PATH"; cat data.txt; cat /opt/tools/tool.sh')
    assert result.return_code == 0, result.stderr
    assert result.stdout.splitlines() == [
        "/app",
        "hi",
        "/app/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "some data",
        "echo tool",
    ]
    failed = await env.exec("echo oops >&2; exit 3", cwd="/tmp", env={"X": "y"}, user="agent")
    assert (failed.return_code, failed.stderr) == (3, "oops\n")
    given = await env.exec('echo "$X $GREETING"; pwd', cwd="/tmp", env={"X": "y", "GREETING": "override"})
    assert given.stdout == "y override\n/tmp\n"


@pytest.mark.slow
@pytest.mark.anyio
async def test_start_writes_a_marker(tmp_path: Path, task_dir: Path) -> None:
    """(How fast a start is, `harbor-async bench throughput -e local` measures.)"""
    env = make_env(tmp_path, task_dir, run_label="bench")
    await env.start(force_build=False)
    try:
        marker = json.loads((env.root / ".harbor-async.json").read_text())
        assert (marker["run_label"], marker["session_id"], marker["pids"]) == ("bench", "s1", [])
        assert marker["owner_pid"] == os.getpid()
        # the keeper: the sandbox's long-lived bwrap and its PID 1 (the init shell)
        assert Path(f"/proc/{marker['keeper_pid']}/comm").read_text().strip() == "bwrap"
        assert Path(f"/proc/{marker['keeper_init_pid']}/comm").read_text().strip() == "sh"
        seen: list[int] = []
        async with anyio.create_task_group() as group:
            group.start_soon(env.exec, "sleep 1")
            with anyio.fail_after(5):
                while not seen:
                    await anyio.sleep(0.05)
                    seen = json.loads((env.root / ".harbor-async.json").read_text())["pids"]
            # the recorded pid is the enter.py helper (or the enter server's child) that joined that exec
            assert "helpers/enter" in Path(f"/proc/{seen[0]}/cmdline").read_text()
            assert Path(f"/proc/{seen[0]}/comm").read_text().strip() == "ha-enter"
        assert json.loads((env.root / ".harbor-async.json").read_text())["pids"] == []
    finally:
        await env.stop(delete=True)


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_whole_base_tree_is_there_when_start_returns(env: LocalEnvironment) -> None:
    """Most of the base tree is written while bubblewrap starts: all of it, links included, is in place at start."""
    from harbor_async.backends.local.template import base_entries, split_entries

    early, late = split_entries(base_entries())
    assert late and sorted(early + late) == sorted(base_entries())
    places = {entry[1] for entry in early}
    assert all(os.path.dirname(entry[1]) in places for entry in late)  # each late link's folder comes first
    links = [entry for entry in base_entries() if entry[0] == 2]
    script = "".join(f"[ \"$(readlink /{path})\" = '{target}' ] || echo missing /{path}\n" for _k, path, _m, target in links)
    result = await env.exec(script)
    assert (result.return_code, result.stdout or "") == (0, ""), (result.stdout or "")[:2000]


@pytest.mark.anyio
async def test_writes_persist_between_execs(env: LocalEnvironment) -> None:
    await env.exec("echo kept > /app/state.txt && mkdir -p /opt/new && touch /opt/new/f /root/r /tmp/t")
    result = await env.exec("cat /app/state.txt && ls /opt/new/f /root/r /tmp/t")
    assert result.stdout.split() == ["kept", "/opt/new/f", "/root/r", "/tmp/t"]
    assert (env.root / "fs" / "app" / "state.txt").read_text() == "kept\n"


@pytest.mark.anyio
async def test_host_system_folders_are_read_only(env: LocalEnvironment) -> None:
    result = await env.exec("touch /usr/zz-local-backend; touch /etc/zz-local-backend")
    # /usr is the host's, read-only; /etc is the sandbox's own (writable, as in Docker)
    assert result.stderr.count("Read-only file system") == 1 and "/usr/zz-local-backend" in result.stderr
    assert not Path("/usr/zz-local-backend").exists() and not Path("/etc/zz-local-backend").exists()
    # Root keeping CAP_SYS_ADMIN could remount the host's /usr writable.
    # (A remount alone changes only this sandbox's mount namespace: harmless to try.)
    remount = await env.exec("mount -o remount,rw,bind /usr")
    assert remount.return_code != 0
    status = await env.exec("grep CapEff /proc/self/status")
    cap_sys_admin = 1 << 21
    assert int(status.stdout.split()[1], 16) & cap_sys_admin == 0


@pytest.mark.anyio
async def test_no_network(env: LocalEnvironment) -> None:
    interfaces = await env.exec("tail -n +3 /proc/net/dev | cut -d: -f1")
    assert interfaces.stdout.split() == ["lo"]
    with socket.socket() as server:  # a service the host itself can reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        result = await env.exec(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected")
    assert result.return_code != 0
    assert "connected" not in (result.stdout or "")


@pytest.mark.anyio
async def test_own_pid_namespace(env: LocalEnvironment) -> None:
    result = await env.exec("echo $$; cat /proc/1/comm; grep -h '^Name:' /proc/[0-9]*/status | cut -f2")
    shell_pid, init, *names = result.stdout.split()
    assert int(shell_pid) < 100  # pids of the sandbox's own namespace, not the host's
    assert init == "sh"  # PID 1 is the keeper's init
    # besides the init and its sleep: this shell, grep and cut (maybe still a forked bash); none of the host's
    assert {"bash", "grep"} <= set(names) <= {"sh", "sleep", "bash", "grep", "cut"}, names
    # this pytest is invisible, by pid and by command line
    assert (await env.exec(f"test -e /proc/{os.getpid()}/status")).return_code == 1
    assert (await env.exec("grep -l 'py[t]est' /proc/[0-9]*/cmdline")).return_code == 1


@pytest.mark.slow
@pytest.mark.anyio
async def test_exec_timeout_kills_the_process_tree(env: LocalEnvironment) -> None:
    started = time.monotonic()
    with pytest.raises(ExecTimeoutError, match="timed out after 1 seconds") as caught:
        await env.exec("echo before; sleep 1717 & setsid sleep 1718 & sleep 1719", timeout_sec=1)
    assert time.monotonic() - started < 5
    assert isinstance(caught.value, RuntimeError)  # what Harbor's docker backend raises
    assert caught.value.stdout == "before\n"
    await processes_become("sleep 171[789]", 0)
    assert (await env.exec("echo alive")).stdout == "alive\n"  # the sandbox survives


@pytest.mark.slow
@pytest.mark.anyio
async def test_an_exec_tree_is_walked_and_killed_off_the_loop_thread(
    env: LocalEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk of the sandbox's processes (long under a fork bomb; every host process without cgroups) must not
    stall the other sandboxes' loop. (Where the exec has a cgroup of its own, its kill is tried first and walks
    nothing: made to fail here, so that the walk, the fallback, runs.)"""
    import threading

    from harbor_async.backends.local import proctree

    monkeypatch.setattr(proctree, "kill_cgroup", lambda folder: False)
    threads = []
    real = proctree.kill_exec_tree

    def recording(leader: int, procs_files=()) -> None:
        threads.append(threading.current_thread())
        real(leader, procs_files)

    monkeypatch.setattr(proctree, "kill_exec_tree", recording)
    with pytest.raises(ExecTimeoutError):
        await env.exec("sleep 1737 & sleep 1738", timeout_sec=1)
    assert threads and threading.current_thread() not in threads
    await processes_become("sleep 173[78]", 0)


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_timed_out_exec_is_found_in_its_sandboxs_cgroup_not_the_hosts_table(
    env: LocalEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the sandbox has cgroups (as root), a kill's walk reads only them: a fork bomb elsewhere costs it nothing.
    (The walk is the fallback of an exec's own cgroup's kill, made to fail here.)"""
    from harbor_async.backends.local import proctree
    from tests.requirements import IN_CI

    if not env._procs_files():
        if IN_CI:
            pytest.fail("CI runs as root: the sandbox must have cgroups")
        pytest.skip("no cgroups for this process (not root)")
    monkeypatch.setattr(proctree, "kill_cgroup", lambda folder: False)
    walked: list[object] = []
    real = proctree.process_table

    def recording(pids=None):
        walked.append(pids)
        return real(pids)

    monkeypatch.setattr(proctree, "process_table", recording)
    with pytest.raises(ExecTimeoutError):
        await env.exec("sleep 1747 & setsid sleep 1748 & sleep 1749", timeout_sec=1)
    await processes_become("sleep 174[789]", 0)
    assert walked and all(pids is not None and len(pids) < 50 for pids in walked), walked  # never the host's table


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_timed_out_exec_is_ended_by_its_own_cgroup_with_no_walk(
    env: LocalEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a cgroup2 hierarchy has ``cgroup.kill`` (the unified root, or v1's ``unified`` companion), each exec
    has a cgroup of its own and one write ends it: no process table is read, a daemon that left the exec's tree
    (double fork) dies too, an earlier exec's daemon does not, and the exec's cgroup is gone afterwards."""
    from harbor_async.backends.local import proctree
    from tests.requirements import IN_CI

    cgroups = env._confinement.cgroups if env._confinement is not None else None
    if cgroups is None or cgroups.kill_parent is None:
        if IN_CI:
            pytest.fail("CI runs as root on a kernel with cgroup.kill: each exec must have a cgroup of its own")
        pytest.skip("no cgroup2 hierarchy with cgroup.kill here")
    walked: list[object] = []
    real = proctree.process_table
    monkeypatch.setattr(proctree, "process_table", lambda pids=None: walked.append(pids) or real(pids))
    await env.exec("(setsid sleep 1756 &) ; true")  # an earlier exec's daemon: not this kill's
    with pytest.raises(ExecTimeoutError):
        await env.exec("(setsid sleep 1757 &) ; sleep 1758 & sleep 1759", timeout_sec=1)
    await processes_become("sleep 175[789]", 0)
    assert len(host_processes("sleep 1756")) == 1
    assert walked == []
    # the killed exec's cgroup was removed; the earlier one, holding its daemon, stays until the stop
    assert [p.name for p in cgroups.kill_parent.iterdir() if p.is_dir()] == ["exec-1"]


@pytest.mark.slow
@pytest.mark.anyio
async def test_cancelled_exec_kills_the_process_tree(env: LocalEnvironment) -> None:
    with anyio.move_on_after(0.5) as scope:
        await env.exec("sleep 1727 & sleep 1728")
    assert scope.cancelled_caught
    await processes_become("sleep 172[78]", 0)


# -- a persistent sandbox: background processes live between execs -----------------


def joined_execs() -> list[int]:
    """This test process's enter.py helpers (each joins one exec to a sandbox)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == "ha-enter":
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.slow
@pytest.mark.anyio
async def test_background_processes_survive_between_execs(env: LocalEnvironment) -> None:
    started = time.monotonic()
    first = await env.exec(
        "nohup sleep 1801 > /tmp/nohup.log 2>&1 & echo $!;"
        "setsid sleep 1802 &"  # keeps the exec's stdout open: the exec must not wait for it
        "sh -c 'while :; do echo tick-1803; sleep 0.02; done' &"  # writes to stdout for ever
        "echo started"
    )
    assert time.monotonic() - started < 30  # returned: it did not wait for processes that never end
    pid, *lines = first.stdout.splitlines()
    assert "started" in lines and set(lines) <= {"started", "tick-1803"}  # the writer's first ticks
    await anyio.sleep(0.5)  # the writer keeps writing after its exec returned
    later = await env.exec(
        f"kill -0 {pid} && echo alive; cat /proc/{pid}/cmdline | tr '\\0' ' '; echo;"
        "pgrep -f 'sleep 1802' >/dev/null && echo setsid-alive;"
        "pgrep -f 'tick-1803' >/dev/null && echo writer-alive;"
        "ps -eo args | grep -c '^sleep 180[12]'"
    )
    assert later.stdout.splitlines() == ["alive", "sleep 1801 ", "setsid-alive", "writer-alive", "2"]
    # the host sees them too: they are real processes of the sandbox
    assert len(host_processes("sleep 180[12]")) == 2
    killed = await env.exec(f"kill {pid}; sleep 0.2; kill -0 {pid} 2>/dev/null || echo gone")
    assert killed.stdout == "gone\n"
    assert host_processes("sleep 1801") == []


@pytest.mark.anyio
async def test_finished_background_processes_are_reaped(env: LocalEnvironment) -> None:
    await env.exec("(sleep 0.1 &); (setsid sleep 0.1 &); sleep 0.05 & true")
    await anyio.sleep(0.5)
    zombies = await env.exec("grep -l '^State:.*Z' /proc/[0-9]*/status")
    assert (zombies.return_code, zombies.stdout) == (1, None)  # the keeper's init reaped the orphans


@pytest.mark.anyio
async def test_commands_cannot_kill_the_sandboxs_init(env: LocalEnvironment) -> None:
    for signal_name in ("KILL", "STOP", "TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "ALRM", "PIPE"):
        await env.exec(f"kill -{signal_name} 1")
    await env.exec("kill -9 -1")  # every process but init and the caller
    result = await env.exec("echo alive; cat /proc/1/comm")
    assert result.stdout == "alive\nsh\n"


@pytest.mark.anyio
async def test_background_server_is_reachable_inside_only(env: LocalEnvironment) -> None:
    with socket.socket() as probe:  # a port that is free on the host now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    await env.exec(f"nohup python3 -m http.server {port} --bind 127.0.0.1 > /tmp/http.log 2>&1 &")
    fetch = (
        f"for i in $(seq 50); do exec 3<>/dev/tcp/127.0.0.1/{port} && break; sleep 0.1; done 2>/dev/null;"
        "printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3; head -1 <&3"
    )
    response = await env.exec(fetch, timeout_sec=20)
    assert response.stdout.startswith("HTTP/1.0 200"), response
    # the sandbox's loopback is its own: the host cannot reach the server
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.anyio
async def test_exec_has_the_keepers_privileges(env: LocalEnvironment) -> None:
    fields = "^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Uid|Gid):"
    mine = await env.exec(f"grep -E '{fields}' /proc/self/status")
    init = await env.exec(f"grep -E '{fields}' /proc/1/status")
    assert mine.stdout == init.stdout  # what bwrap gave the keeper, nothing more
    assert "NoNewPrivs:\t1" in mine.stdout
    # and a clean environment: only what the sandbox defines
    environment = await env.exec("env | cut -d= -f1 | sort")
    assert environment.stdout.split() == sorted(["GREETING", "HOME", "HOSTNAME", "PATH", "PWD", "SHLVL", "_"])


@pytest.mark.slow
@pytest.mark.anyio
async def test_timeout_kills_only_the_execs_own_tree(env: LocalEnvironment) -> None:
    await env.exec("nohup sleep 1811 > /dev/null 2>&1 &")
    with pytest.raises(ExecTimeoutError):
        await env.exec("sleep 1812 & setsid sleep 1813 & (setsid sleep 1814 > /dev/null &); sleep 1815", timeout_sec=1)
    # its group, its session and its descendants died; the earlier exec's process lives
    await processes_become("sleep 181[235]", 0)
    assert len(host_processes("sleep 1811")) == 1
    survivors = await env.exec("ps -eo args | grep '^sleep 181' | sort")
    # A double fork leaves the tree at once: the exec's own cgroup still holds it (killed with the exec); a tree
    # walk, where there is no such cgroup, cannot find it (as Docker does not).
    own_cgroup = env._confinement is not None and env._confinement.cgroups is not None and env._confinement.cgroups.kill_parent
    assert survivors.stdout.splitlines() == (["sleep 1811"] if own_cgroup else ["sleep 1811", "sleep 1814"])
    assert joined_execs() == []  # no join helper left behind


@pytest.mark.slow
@pytest.mark.anyio
async def test_cancel_kills_only_the_execs_own_tree(env: LocalEnvironment) -> None:
    await env.exec("nohup sleep 1841 > /dev/null 2>&1 &")
    with anyio.move_on_after(0.5) as scope:  # how the engine times execs out
        await env.exec("sleep 1842 & setsid sleep 1843 & sleep 1844")
    assert scope.cancelled_caught
    await processes_become("sleep 184[234]", 0)
    assert len(host_processes("sleep 1841")) == 1
    assert joined_execs() == []
    assert (await env.exec("pgrep -c -f 'sleep 184'")).stdout == "1\n"


@pytest.mark.anyio
async def test_stop_kills_background_processes(tmp_path: Path, task_dir: Path) -> None:
    env = make_env(tmp_path, task_dir, session="bg-stop")
    await env.start(force_build=False)
    root = env.root
    marker = json.loads((root / ".harbor-async.json").read_text())
    await env.exec(
        "nohup sleep 1821 > /dev/null 2>&1 & setsid sleep 1822 & (setsid sleep 1823 > /dev/null 2>&1 &);"
        "sh -c 'while :; do echo tick-1824; sleep 0.02; done' &"
    )
    running: list[object] = []

    async def busy_exec() -> None:
        running.append(await env.exec("sleep 1825"))

    async with anyio.create_task_group() as group:
        group.start_soon(busy_exec)
        # the sandbox's five (an enter.py helper's own command line names its command too)
        await processes_become("sleep 182[1-5]|tick-1824", 5, besides="helpers/enter")
        with anyio.fail_after(5):
            await env.stop(delete=True)
    assert running[0].return_code == 137
    # nothing left: no process of the sandbox, no bwrap, no join helper, no folder
    assert host_processes("sleep 182[1-5]|tick-1824") == []
    assert host_processes(str(root)) == []
    assert joined_execs() == []
    for pid in (marker["keeper_pid"], marker["keeper_init_pid"]):
        assert not Path(f"/proc/{pid}").exists()
    assert not root.exists()


def zombie_children() -> list[int]:
    """This process's children that are zombies (exited, never reaped)."""
    zombies = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(stat_file.parent.name))
    return zombies


@pytest.mark.slow
@pytest.mark.anyio
async def test_killed_execs_leave_no_zombie_and_stop_is_prompt(tmp_path: Path, task_dir: Path) -> None:
    # As a child subreaper, this process adopts what a killed exec hands out of the
    # sandbox; a sandbox process adopted (and never reaped) out here would keep the
    # PID namespace from ending, as under a container init that does not reap.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_child_subreaper = 36
    assert libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0
    try:
        env = make_env(tmp_path, task_dir, session="zombies")
        await env.start(force_build=False)
        marker = json.loads((env.root / ".harbor-async.json").read_text())
        with pytest.raises(ExecTimeoutError):
            await env.exec("sleep 1861 & setsid sleep 1862 & sleep 1863", timeout_sec=1)
        with anyio.move_on_after(0.3):
            await env.exec("sleep 1864 & sleep 1865")
        assert (await env.exec("echo alive")).stdout == "alive\n"
        started = time.monotonic()
        await env.stop(delete=True)
        assert time.monotonic() - started < 30  # it did not wait for the sleeps (1861 s and on)
        assert zombie_children() == []
        assert not Path(f"/proc/{marker['keeper_init_pid']}").exists()
        assert host_processes("sleep 186[1-5]") == []
    finally:
        libc.prctl(pr_set_child_subreaper, 0, 0, 0, 0)


@pytest.mark.anyio
async def test_start_fails_clearly_without_util_linux(tmp_path: Path, task_dir: Path, monkeypatch) -> None:
    from harbor_async.backends.local.keeper import find_tools, tools_on

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "setpriv" else real_which(name, *a, **k))
    tools_on.cache_clear()  # found once per PATH: this test's machine has no setpriv
    env = make_env(tmp_path, task_dir, session="no-setpriv")
    with pytest.raises(SandboxBuildFailedError, match="setpriv and prlimit from util-linux.*setpriv"):
        await env.start(force_build=False)
    await env.stop(delete=True)  # what the engine does after a failed start
    assert not env.root.exists()
    with pytest.raises(RuntimeError, match="not started"):
        await env.exec("true")
    monkeypatch.undo()
    assert find_tools().setpriv  # the failure was not kept: with setpriv back, the tools are found


@pytest.mark.range
@pytest.mark.anyio
async def test_upload_download_round_trip(env: LocalEnvironment, tmp_path: Path) -> None:
    source = tmp_path / "up"
    (source / "nested").mkdir(parents=True)
    (source / "a.txt").write_text("A")
    (source / "nested" / "b.txt").write_text("B")
    single = tmp_path / "single.txt"
    single.write_text("single")

    await env.upload_dir(source, "/data/in")
    await env.upload_file(single, "/tests/single.txt")
    listing = await env.exec("cat /data/in/a.txt /data/in/nested/b.txt /tests/single.txt")
    assert listing.stdout == "ABsingle"

    await env.exec("mkdir -p /data/out/deep && echo C > /data/out/deep/c.txt && echo D > /data/out/d.txt")
    await env.download_dir("/data/out", tmp_path / "down")
    assert (tmp_path / "down" / "deep" / "c.txt").read_text() == "C\n"
    assert (tmp_path / "down" / "d.txt").read_text() == "D\n"
    await env.download_file("/data/in/nested/b.txt", tmp_path / "b-copy.txt")
    assert (tmp_path / "b-copy.txt").read_text() == "B"

    with pytest.raises(SandboxPathError, match="read-only"):
        await env.upload_file(single, "/usr/local/bin/single.txt")
    with pytest.raises(SandboxPathError, match="read-only"):
        await env.upload_file(single, "/bin/single.txt")  # /bin -> usr/bin
    with pytest.raises(FileNotFoundError):
        await env.download_file("/data/missing.txt", tmp_path / "missing.txt")


@pytest.mark.anyio
async def test_sandbox_symlinks_cannot_reach_host_files(env: LocalEnvironment, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("host secret")
    await env.exec(f"ln -s {victim} /app/link && ln -s {victim} /logs/agent/leak")
    payload = tmp_path / "payload.txt"
    payload.write_text("overwritten")

    await env.upload_file(payload, "/app/link")
    assert victim.read_text() == "host secret"  # the link means the sandbox's path
    inside = await env.exec(f"cat {victim}")
    assert inside.stdout == "overwritten"

    await env.exec(f"rm {victim}")
    await env.download_dir("/logs/agent", tmp_path / "agent-logs")
    assert not (tmp_path / "agent-logs" / "leak").exists()


@pytest.mark.anyio
async def test_stop_removes_folder_and_processes(tmp_path: Path, task_dir: Path) -> None:
    env = make_env(tmp_path, task_dir, session="stopme")
    await env.start(force_build=False)
    root = env.root
    results = []

    async def long_exec() -> None:
        results.append(await env.exec("sleep 1737 & sleep 1738"))

    async with anyio.create_task_group() as group:
        group.start_soon(long_exec)
        await processes_become("^sleep 173[78]", 2)  # the exec runs
        assert host_processes(str(root)), "bwrap should be running in this sandbox"
        with anyio.fail_after(5):
            await env.stop(delete=True)
    assert results[0].return_code == 137  # SIGKILL, reported like a shell
    assert not root.exists()
    assert host_processes(str(root)) == []
    assert host_processes("sleep 173[78]") == []
    await env.stop(delete=True)  # idempotent
    with pytest.raises(RuntimeError, match="not started"):
        await env.exec("true")


@pytest.mark.anyio
async def test_stop_while_an_exec_is_launching(tmp_path: Path, task_dir: Path) -> None:
    for attempt in range(5):  # a race: several tries make a regression show
        env = make_env(tmp_path, task_dir, session=f"race{attempt}")
        await env.start(force_build=False)
        outcomes: list[object] = []

        async def exec_soon() -> None:
            try:
                outcomes.append((await env.exec("sleep 1757")).return_code)
            except RuntimeError as exc:  # "not started" if stop won the race outright
                outcomes.append(exc)

        async with anyio.create_task_group() as group:
            group.start_soon(exec_soon)
            await anyio.sleep(0)  # the exec is now inside its bwrap launch
            with anyio.fail_after(5):
                await env.stop(delete=True)
        assert outcomes and outcomes[0] != 0
        assert not env.root.exists()
    assert host_processes("sleep 1757") == []


@pytest.mark.range
@pytest.mark.anyio
async def test_healthcheck_uses_the_sandbox(tmp_path: Path, task_dir: Path) -> None:
    from harbor.environments.base import HealthcheckError
    from harbor.models.task.config import HealthcheckConfig

    env = make_env(tmp_path, task_dir)
    await env.start(force_build=False)
    try:
        await env.run_healthcheck(HealthcheckConfig(command="test -f /app/data.txt"))
        with pytest.raises(HealthcheckError):
            await env.run_healthcheck(
                HealthcheckConfig(command="test -f /nope", retries=2, interval_sec=0.01)
            )
    finally:
        await env.stop(delete=True)


@pytest.mark.slow
@pytest.mark.range
def test_works_under_trio(tmp_path: Path, task_dir: Path) -> None:
    async def scenario() -> str:
        env = make_env(tmp_path, task_dir, session="trio")
        await env.start(force_build=False)
        try:
            with pytest.raises(ExecTimeoutError):
                await env.exec("sleep 1747", timeout_sec=1)
            return (await env.exec("cat /app/data.txt")).stdout
        finally:
            await env.stop(delete=True)

    assert anyio.run(scenario, backend="trio") == "some data\n"
    assert host_processes("sleep 1747") == []


@pytest.mark.slow
def test_sandbox_outlives_the_thread_that_started_it(tmp_path: Path, task_dir: Path, monkeypatch) -> None:
    # trio forks in worker threads that retire when idle; bwrap's --die-with-parent
    # is tied to the forking thread, so a keeper forked there would die with it.
    import trio._core._thread_cache as thread_cache

    monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 0.1)  # retire idle workers at once

    async def scenario() -> tuple[str, str]:
        env = make_env(tmp_path, task_dir, session="trio-idle")
        await env.start(force_build=False)
        try:
            await env.exec("nohup sleep 1871 > /dev/null 2>&1 &")
            await anyio.sleep(1.5)  # every worker thread of the start has retired
            alive = await env.exec("pgrep -c -f 'sleep 1871'")
            return alive.stdout, (await env.exec("echo still here")).stdout
        finally:
            await env.stop(delete=True)

    assert anyio.run(scenario, backend="trio") == ("1\n", "still here\n")
    assert host_processes("sleep 1871") == []


@pytest.mark.anyio
async def test_exec_after_the_keeper_died_is_a_clear_error(tmp_path: Path, task_dir: Path) -> None:
    env = make_env(tmp_path, task_dir, session="keeper-died")
    await env.start(force_build=False)
    marker = json.loads((env.root / ".harbor-async.json").read_text())
    os.kill(marker["keeper_init_pid"], signal.SIGKILL)  # as the OOM killer might
    with anyio.fail_after(10):
        while env._keeper is not None and env._keeper.alive():  # dead a moment after the kill
            await anyio.sleep(0.01)
    with pytest.raises(RuntimeError, match="is gone: its init process"):
        await env.exec("true")
    await env.stop(delete=True)
    assert not env.root.exists() and host_processes(str(env.root)) == []


@pytest.fixture
def earlier_garbage_collected() -> None:
    """Collect what earlier tests of this process left (an unclosed httpx client whose loop is gone) before this
    test's loop runs: its own ``gc.collect()`` would otherwise report their failed closes as its errors."""
    import gc

    gc.collect()


@pytest.mark.anyio
@pytest.mark.usefixtures("earlier_garbage_collected")
async def test_an_environment_dropped_without_stop_ends_its_sandbox(tmp_path: Path, task_dir: Path) -> None:
    import gc

    env = make_env(tmp_path, task_dir, session="dropped")
    await env.start(force_build=False)
    await env.exec("nohup sleep 1881 > /dev/null 2>&1 &")
    root, init_pid = env.root, json.loads((env.root / ".harbor-async.json").read_text())["keeper_init_pid"]
    del env
    gc.collect()
    with anyio.fail_after(5):
        while Path(f"/proc/{init_pid}").exists() or host_processes("sleep 1881"):
            await anyio.sleep(0.05)
    shutil.rmtree(root)  # only stop() removes the folder


# -- Harbor's own agent and verifier --------------------------------------------------


async def run_oracle_and_verify(tmp_path: Path, task_dir: Path, session: str) -> float:
    env = make_env(tmp_path, task_dir, session=session)
    trial_paths = env.trial_paths
    task = Task(task_dir)
    await env.start(force_build=False)
    try:
        agent = OracleAgent(logs_dir=trial_paths.agent_dir, task_dir=task_dir, trial_paths=trial_paths)
        await agent.run(task.instruction, env, AgentContext())
        # as trl does: a clean verifier folder, then Harbor's verifier
        await env.empty_dirs([EnvironmentPaths().verifier_dir])
        result = await Verifier(task=task, trial_paths=trial_paths, environment=env).verify()
        assert trial_paths.test_stdout_path.exists()  # the verifier's log came back
        return result.rewards["reward"]
    finally:
        await env.stop(delete=True)


@pytest.mark.range
@pytest.mark.anyio
async def test_harbor_verifier_rewards_the_oracle(tmp_path: Path, task_dir: Path) -> None:
    assert await run_oracle_and_verify(tmp_path, task_dir, "right") == 1.0


@pytest.mark.range
@pytest.mark.anyio
async def test_harbor_verifier_rejects_a_wrong_answer(tmp_path: Path) -> None:
    wrong = make_task(tmp_path / "suite-wrong", solve="echo bye > /app/answer.txt")
    assert await run_oracle_and_verify(tmp_path, wrong, "wrong") == 0.0


@pytest.mark.range
@pytest.mark.slow
def test_harbor_cli_runs_the_oracle(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    make_task(suite, "hello")
    sandboxes = tmp_path / "sandboxes"
    harbor = Path(sys.executable).with_name("harbor")
    command = [
        str(harbor), "run", "-p", str(suite), "-e", IMPORT_PATH, "-a", "oracle",
        "-o", str(tmp_path / "jobs"), "-y", "--ek", f"sandbox_root={sandboxes}",
    ]  # fmt: skip
    # no network here: keep litellm from retrying its model price download
    environment = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials = list((tmp_path / "jobs").glob("*/hello__*/result.json"))
    assert len(trials) == 1, done.stdout[-3000:]
    trial = json.loads(trials[0].read_text())
    assert trial["exception_info"] is None
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}
    assert list(sandboxes.iterdir()) == []  # stop(delete=True) left nothing behind


@pytest.mark.slow
def test_reaper_removes_a_killed_owners_mount_and_cgroups(tmp_path: Path, task_dir: Path) -> None:
    """A run killed with SIGKILL leaves its folder, its tmpfs and its cgroups; the reaper removes them all."""
    from harbor_async.backends import reaper

    script = f"""
import anyio, json, os, signal, sys
sys.path.insert(0, {str(REPO / "tests")!r})
from pathlib import Path
from test_local_backend import make_env
async def main():
    env = make_env(Path({str(tmp_path)!r}), Path({str(task_dir)!r}), session="killed")
    await env.start(force_build=False)
    await env.exec("sleep 600 &")
    print(json.dumps(json.loads((env.root / ".harbor-async.json").read_text())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
anyio.run(main)
"""
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    marker = json.loads(child.stdout.strip().splitlines()[-1])
    label = os.environ.get("HARBOR_ASYNC_RUN_LABEL", "adhoc")  # a pytest -n worker's own (tests/conftest.py)
    folder = tmp_path / "sandboxes" / f"harbor-async-{label}-killed"
    assert folder.exists()
    if os.geteuid() == 0:
        assert marker["mount"] and Path(marker["mount"]).exists() and marker["cgroups"]
    report = reaper.reap(include_live_owners=False, older_than=None, backend="local", roots=[tmp_path / "sandboxes"])
    assert report.ok, report.errors
    assert not folder.exists()
    if os.geteuid() == 0:
        assert not Path(marker["mount"]).exists()
        assert f" {marker['mount']} " not in Path("/proc/self/mountinfo").read_text()
        assert not any(Path(c).exists() for c in marker["cgroups"])
    assert host_processes("sleep 600") == []
