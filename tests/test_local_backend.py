"""Tests of the bubblewrap backend (harbor_async.backends.local).

They run real sandboxes: they need `bwrap` on PATH and are skipped without it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from harbor.agents.oracle import OracleAgent
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

IMPORT_PATH = "harbor_async.backends.local:LocalEnvironment"
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

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
    for name in ("COPY --from=builder", "ADD https://", "RUN <<EOF", "USER nobody", "CMD"):
        assert name in ignored
    assert len(spec.ignored) == 5


# -- construction through Harbor ---------------------------------------------------


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


@pytest.mark.anyio
async def test_start_is_fast_and_writes_a_marker(tmp_path: Path, task_dir: Path) -> None:
    env = make_env(tmp_path, task_dir, run_label="bench")
    started = time.perf_counter()
    await env.start(force_build=False)
    assert time.perf_counter() - started < 0.5
    try:
        marker = json.loads((env.root / ".harbor-async.json").read_text())
        assert (marker["run_label"], marker["session_id"], marker["pids"]) == ("bench", "s1", [])
        assert marker["owner_pid"] == os.getpid()
        seen: list[int] = []
        async with anyio.create_task_group() as group:
            group.start_soon(env.exec, "sleep 1")
            with anyio.fail_after(5):
                while not seen:
                    await anyio.sleep(0.05)
                    seen = json.loads((env.root / ".harbor-async.json").read_text())["pids"]
            # the recorded pid is the running bwrap of that exec
            assert Path(f"/proc/{seen[0]}/comm").read_text().strip() == "bwrap"
        assert json.loads((env.root / ".harbor-async.json").read_text())["pids"] == []
    finally:
        await env.stop(delete=True)


@pytest.mark.anyio
async def test_writes_persist_between_execs(env: LocalEnvironment) -> None:
    await env.exec("echo kept > /app/state.txt && mkdir -p /opt/new && touch /opt/new/f /root/r /tmp/t")
    result = await env.exec("cat /app/state.txt && ls /opt/new/f /root/r /tmp/t")
    assert result.stdout.split() == ["kept", "/opt/new/f", "/root/r", "/tmp/t"]
    assert (env.root / "fs" / "app" / "state.txt").read_text() == "kept\n"


@pytest.mark.anyio
async def test_host_system_folders_are_read_only(env: LocalEnvironment) -> None:
    result = await env.exec("touch /usr/zz-local-backend; touch /etc/zz-local-backend")
    assert result.stderr.count("Read-only file system") == 2
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
    result = await env.exec("echo $$; ls /proc | grep -c '^[0-9]'")
    shell_pid, n_processes = map(int, result.stdout.split())
    assert shell_pid <= 3  # bwrap's init is pid 1
    assert n_processes <= 4  # init, bash, ls, grep: none of the host's


@pytest.mark.anyio
async def test_exec_timeout_kills_the_process_tree(env: LocalEnvironment) -> None:
    started = time.monotonic()
    with pytest.raises(ExecTimeoutError, match="timed out after 1 seconds") as caught:
        await env.exec("echo before; sleep 1717 & setsid sleep 1718 & sleep 1719", timeout_sec=1)
    assert time.monotonic() - started < 5
    assert isinstance(caught.value, RuntimeError)  # what Harbor's docker backend raises
    assert caught.value.stdout == "before\n"
    await anyio.sleep(0.2)
    assert host_processes("sleep 171[789]") == []
    assert (await env.exec("echo alive")).stdout == "alive\n"  # the sandbox survives


@pytest.mark.anyio
async def test_cancelled_exec_kills_the_process_tree(env: LocalEnvironment) -> None:
    with anyio.move_on_after(0.5) as scope:
        await env.exec("sleep 1727 & sleep 1728")
    assert scope.cancelled_caught
    await anyio.sleep(0.2)
    assert host_processes("sleep 172[78]") == []


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
        await anyio.sleep(0.3)
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


@pytest.mark.anyio
async def test_harbor_verifier_rewards_the_oracle(tmp_path: Path, task_dir: Path) -> None:
    assert await run_oracle_and_verify(tmp_path, task_dir, "right") == 1.0


@pytest.mark.anyio
async def test_harbor_verifier_rejects_a_wrong_answer(tmp_path: Path) -> None:
    wrong = make_task(tmp_path / "suite-wrong", solve="echo bye > /app/answer.txt")
    assert await run_oracle_and_verify(tmp_path, wrong, "wrong") == 0.0


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
