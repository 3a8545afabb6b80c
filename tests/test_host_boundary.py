"""The host side of the local sandbox boundary, attacked as a sandbox would (issue 23, items 4 to 6).

Transfers must run nothing of the sandbox's and hand it no host descriptor;
exec joins must confine before anything the sandbox wrote is loaded; every
download must be bounded in bytes and time whatever the sandbox put there
(FIFOs, sparse files, deep trees).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import anyio
import pytest

from harbor_async.backends.local import LocalEnvironment
from harbor_async.backends.local.layout import CAP_NUMBERS, SANDBOX_CAPS
from harbor_async.core.errors import TransferLimitError
from tests.requirements import needs_bwrap
from tests.test_local_backend import make_env
from tests.test_local_escape import make_task

ATTACKS = Path(__file__).parent / "attacks"
SANDBOX_CAP_MASK = sum(1 << CAP_NUMBERS[name] for name in SANDBOX_CAPS)

pytestmark = needs_bwrap


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def env(tmp_path: Path):
    environment = make_env(tmp_path, make_task(tmp_path / "suite"), "boundary", transfer_limit_mb=8)
    await environment.start(force_build=False)
    yield environment
    await environment.stop(delete=True)


@pytest.fixture(scope="module")
def preload_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The planted library, compiled now (gcc is installed by .ci/setup)."""
    out = tmp_path_factory.mktemp("attack") / "planted.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-o", str(out), str(ATTACKS / "preload.c")], check=True, timeout=120
    )
    return out


@pytest.mark.anyio
async def test_a_planted_preload_never_runs_before_confinement_nor_in_a_transfer(
    env: LocalEnvironment, preload_library: Path, tmp_path: Path
) -> None:
    await env.upload_file(preload_library, "/opt/planted.so")
    await env.exec("echo /opt/planted.so > /etc/ld.so.preload && echo content > /tmp/data.txt && : > /tmp/preload.log")
    # Every kind of transfer, then one exec of a dynamically linked program.
    await env.download_file("/tmp/data.txt", tmp_path / "data.txt")
    await env.download_dir("/tmp", tmp_path / "tmp-copy")
    source = tmp_path / "up.txt"
    source.write_text("up")
    await env.upload_file(source, "/tmp/up.txt")
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "a.txt").write_text("a")
    await env.upload_dir(tmp_path / "tree", "/tmp/tree")
    transfers_log = (await env.exec("cat /tmp/preload.log")).stdout
    ran = await env.exec("id -u; cat /tmp/preload.log")
    # A transfer hands the sandbox nothing: the host file holds the sandbox file's bytes only.
    assert (tmp_path / "data.txt").read_text() == "content\n"
    assert (tmp_path / "tmp-copy" / "data.txt").read_text() == "content\n"
    # The only programs that loaded the library are the commands themselves (cat, id, bash),
    # with the sandbox's capabilities and no-new-privs: no join step ran it with more.
    assert "PLANTED" not in transfers_log and all("/cat " in line or "bash" in line for line in transfers_log.splitlines())
    lines = [line for line in ran.stdout.splitlines()[1:] if line]
    assert lines, ran
    for line in lines:
        program, caps, nnp = line.rsplit(" ", 2)
        assert nnp == "nnp=1", line
        assert int(caps.removeprefix("caps="), 16) == SANDBOX_CAP_MASK, line
        assert os.path.basename(program) in ("bash", "cat", "id", "dash", "sh"), line


@pytest.mark.anyio
async def test_a_fifo_never_blocks_a_download(env: LocalEnvironment, tmp_path: Path) -> None:
    await env.exec("mkfifo /logs/agent/pipe && echo ok > /logs/agent/real.txt && mkfifo /tmp/lone")
    with anyio.fail_after(30):  # a transfer that opened the FIFO would wait for ever
        await env.download_dir("/logs/agent", tmp_path / "agent")
        with pytest.raises(FileNotFoundError):
            await env.download_file("/tmp/lone", tmp_path / "lone")
    assert sorted(p.name for p in (tmp_path / "agent").iterdir()) == ["real.txt"]
    assert not (tmp_path / "lone").exists()


@pytest.mark.anyio
async def test_a_sparse_file_past_the_limit_is_refused_and_not_copied(env: LocalEnvironment, tmp_path: Path) -> None:
    # 1 GiB apparent, nothing on the sandbox's disk: the limit counts the apparent size.
    await env.exec("truncate -s 1G /logs/agent/huge && echo small > /logs/agent/small.txt")
    with pytest.raises(TransferLimitError) as info:
        await env.download_file("/logs/agent/huge", tmp_path / "huge")
    assert info.value.limit == 8 * 2**20 and "transfer_limit_mb" in str(info.value)
    assert not (tmp_path / "huge").exists()
    with pytest.raises(TransferLimitError):
        await env.download_dir("/logs/agent", tmp_path / "agent")
    copied = sum(p.stat().st_size for p in (tmp_path / "agent").rglob("*") if p.is_file())
    assert copied <= 8 * 2**20  # nothing past the cap reached the host


@pytest.mark.anyio
async def test_a_deep_or_wide_tree_is_bounded(env: LocalEnvironment, tmp_path: Path) -> None:
    await env.exec("cd /logs/agent && for i in $(seq 80); do mkdir d && cd d; done; echo x > leaf")
    with pytest.raises(TransferLimitError, match="deeper than"):
        await env.download_dir("/logs/agent", tmp_path / "deep")


@pytest.mark.anyio
async def test_symlinks_resolve_inside_the_sandbox_only(env: LocalEnvironment, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only")
    await env.exec(
        f"mkdir -p {secret.parent} && echo sandbox > {secret} && echo sandbox > /etc/hostname"
        f" && ln -s {secret} /logs/agent/abs"
        " && ln -s ../../../../../../../../etc/hostname /logs/agent/up && ln -s /proc/1/root /logs/agent/magic"
    )
    await env.download_dir("/logs/agent", tmp_path / "agent")
    assert list((tmp_path / "agent").iterdir()) == []  # links are not copied
    await env.download_file("/logs/agent/abs", tmp_path / "abs.txt")
    assert (tmp_path / "abs.txt").read_text() == "sandbox\n"  # the sandbox's file of that name
    await env.download_file("/logs/agent/up", tmp_path / "up.txt")
    assert (tmp_path / "up.txt").read_text() == "sandbox\n"  # .. stops at the sandbox's root
    with pytest.raises(FileNotFoundError):
        await env.download_file("/logs/agent/magic/etc/hostname", tmp_path / "magic.txt")
    assert secret.read_text() == "host only"


def test_a_transfer_checks_for_cancellation_between_chunks(tmp_path: Path) -> None:
    from harbor_async.backends.local import hostfs
    from harbor_async.verification.transfer_budget import Budget

    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "blob").write_bytes(os.urandom(5 * 2**20))
    calls = []

    class Cancelled(Exception):
        pass

    def cancelled() -> None:  # as anyio.from_thread.check_cancelled does once the caller is cancelled
        calls.append(1)
        if len(calls) > 1:
            raise Cancelled

    root = os.open(tmp_path / "root", os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(Cancelled):
            hostfs.read_file(root, "blob", tmp_path / "copy", Budget(None, "blob", cancelled))
    finally:
        os.close(root)
    assert (tmp_path / "copy").stat().st_size == 2**20  # one chunk, then it stopped


# -- docker: the same bounds on Harbor's docker environment (ConfinedDockerEnvironment) ----------


@pytest.fixture
async def docker_env(tmp_path: Path, docker_daemon):
    from harbor.models.task.task import Task

    from harbor_async.engine.engine import Engine

    async with Engine(backend_kwargs={"transfer_limit_mb": 8, "output_limit": 65536}) as engine:
        async with engine.sandbox(Task(make_task(tmp_path / "suite")), "docker") as sandbox:
            yield sandbox.environment


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.anyio
async def test_docker_downloads_take_no_links_no_fifos_and_stop_at_the_limit(docker_env, tmp_path: Path) -> None:
    from harbor_async.backends.docker.confined import ConfinedDockerEnvironment

    assert isinstance(docker_env, ConfinedDockerEnvironment)  # `-e docker` runs the bounded class
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only")
    await docker_env.exec(
        f"mkdir -p /logs/verifier && ln -s {secret} /logs/verifier/test-stdout.txt && mkfifo /logs/verifier/pipe"
        " && echo 1 > /logs/verifier/reward.txt && truncate -s 1G /logs/agent/huge && echo ok > /logs/agent/small"
    )
    with anyio.fail_after(60):
        await docker_env.download_dir("/logs/verifier", tmp_path / "verifier")
    assert sorted(p.name for p in (tmp_path / "verifier").iterdir()) == ["reward.txt"]  # no link, no FIFO
    with pytest.raises(FileNotFoundError):
        await docker_env.download_file("/logs/verifier/test-stdout.txt", tmp_path / "stdout.txt")
    assert not (tmp_path / "stdout.txt").exists()
    with pytest.raises(TransferLimitError):
        await docker_env.download_file("/logs/agent/huge", tmp_path / "huge")
    assert not (tmp_path / "huge").exists()
    with pytest.raises(TransferLimitError):
        await docker_env.download_dir("/logs/agent", tmp_path / "agent")
    assert sum(p.stat().st_size for p in (tmp_path / "agent").rglob("*") if p.is_file()) <= 8 * 2**20


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.anyio
async def test_docker_exec_output_is_bounded(docker_env) -> None:
    result = await docker_env.exec("head -c 50000000 /dev/zero | tr '\\0' x; echo; echo the-end")
    assert len(result.stdout) < 70_000  # 50 MB printed, 64 KiB kept
    assert result.stdout.startswith("xxxx") and result.stdout.rstrip().endswith("the-end")
    assert "bytes of output dropped" in result.stdout


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.anyio
async def test_docker_runs_a_task_asking_for_more_cpus_than_the_host_with_the_hosts(tmp_path: Path, docker_daemon) -> None:
    from harbor.models.task.task import Task

    from harbor_async.engine.engine import Engine
    from harbor_async.tasks.resources import host_cpus

    task = Task(make_task(tmp_path / "suite", toml_env="cpus = 1000\nmemory_mb = 10000000\n"))
    async with Engine() as engine:  # Docker itself refuses 1,000 CPUs on a 2-CPU host
        async with engine.sandbox(task, "docker") as sandbox:
            assert (await sandbox.exec("echo up")).output.strip() == "up"
            container = await sandbox.environment._find_main_container()
            inspected = subprocess.run(
                ["docker", "inspect", "-f", "{{.HostConfig.NanoCpus}}", container], capture_output=True, text=True
            )
            assert int(inspected.stdout) == host_cpus() * 10**9


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.anyio
async def test_docker_tasks_with_an_environment_env_keep_the_overlay_and_their_variables(tmp_path: Path, docker_daemon) -> None:
    from harbor.models.task.task import Task

    from harbor_async.core.naming import LABEL_RUN
    from harbor_async.engine.engine import Engine

    env = '\n[environment.env]\nGREETING = "hello world"\nPLAIN = "plain"\n'
    task = Task(make_task(tmp_path / "suite", toml_env=env))
    async with Engine() as engine:
        async with engine.sandbox(task, "docker") as sandbox:
            seen = await sandbox.exec('printf "%s|%s" "$GREETING" "$PLAIN"')
            container = await sandbox.environment._find_main_container()
            inspected = subprocess.run(
                ["docker", "inspect", "-f", '{{.HostConfig.Init}} {{.HostConfig.PidsLimit}} {{index .Config.Labels "' + LABEL_RUN + '"}}', container],
                capture_output=True, text=True,
            ).stdout.split()
    assert seen.stdout == "hello world|plain"  # every command sees the task's variables
    assert inspected == ["true", "1024", engine.run_label]  # the init (fast stop), the pids limit, the run's label
