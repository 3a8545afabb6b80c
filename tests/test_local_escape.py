"""The local backend's escape suite: attacks from inside real sandboxes, each one asserted to fail
with host state unchanged (issue 9's "Checks").

Every case runs real bubblewrap sandboxes. Without bwrap they are skipped,
except under CI=true, where they fail. The limit cases need root (cgroups,
per-sandbox uids, sized tmpfs): without it they are skipped, except under CI.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import anyio
import psutil
import pytest
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from harbor_async.backends.local import LocalEnvironment
from harbor_async.backends.local.errors import TaskPathEscapeError
from tests.requirements import IN_CI, needs_bwrap
from tests.test_local_backend import make_env

ROOT = os.geteuid() == 0

pytestmark = needs_bwrap
needs_root = pytest.mark.skipif(not ROOT and not IN_CI, reason="limits need root (cgroups, per-sandbox uids)")

TEST_SH = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_task(root: Path, name: str = "task", toml_env: str = "") -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("Do nothing.\n")
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 60.0\n\n'
        f"[environment]\nbuild_timeout_sec = 60.0\n{toml_env}"
    )
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    (task / "tests" / "test.sh").write_text(TEST_SH)
    return task


@pytest.fixture
async def env(tmp_path: Path):
    environment = make_env(tmp_path, make_task(tmp_path / "suite"), "victim")
    await environment.start(force_build=False)
    yield environment
    await environment.stop(delete=True)


@pytest.fixture
async def neighbour(tmp_path: Path):
    environment = make_env(tmp_path, make_task(tmp_path / "suite-n", "neighbour"), "neighbour")
    await environment.start(force_build=False)
    yield environment
    await environment.stop(delete=True)


async def verifies(env: LocalEnvironment, tmp_path: Path) -> bool:
    """A neighbour's check: it starts 20 processes, takes an upload, writes 1 MB, and its verifier reports 1."""
    tests = tmp_path / "neighbour-tests"
    tests.mkdir(exist_ok=True)
    (tests / "test.sh").write_text(TEST_SH)
    await env.upload_dir(tests, "/tests")
    result = await env.exec(
        "for i in $(seq 20); do sleep 0.2 & done; wait; "
        "dd if=/dev/zero of=/tmp/neighbour bs=1M count=1 status=none && bash /tests/test.sh",
        timeout_sec=60,
    )
    reward = tmp_path / "neighbour-reward.txt"
    await env.download_file("/logs/verifier/reward.txt", reward)
    return result.return_code == 0 and reward.read_text().strip() == "1"


# -- kernel interfaces, identity, host secrets ------------------------------------------


@pytest.mark.anyio
async def test_proc_sys_is_read_only(env: LocalEnvironment) -> None:
    before = {name: Path(f"/proc/sys/{name}").read_text() for name in ("vm/swappiness", "kernel/core_pattern")}
    result = await env.exec(
        "echo 17 > /proc/sys/vm/swappiness; echo '|/tmp/evil' > /proc/sys/kernel/core_pattern; "
        "echo $? ; echo b > /proc/sysrq-trigger"
    )
    assert result.stderr.count("Read-only file system") >= 2, result.stderr
    assert {name: Path(f"/proc/sys/{name}").read_text() for name in before} == before
    masked = await env.exec(
        "cat /proc/timer_list /proc/keys 2>/dev/null | wc -c; ls /sys/firmware | wc -l; touch /sys/x"
    )
    lines = (masked.stdout or "").split()
    assert lines[:2] == ["0", "0"], masked.stdout  # masked: nothing readable
    assert "Read-only file system" in (masked.stderr or "")
    host = set(os.listdir("/sys/class/net")) | set(os.listdir("/sys/devices/virtual/net"))
    listed = await env.exec("ls /sys/class/net /sys/devices/virtual/net; ls /sys/class/net/*/address 2>/dev/null")
    assert host - {"lo"} and not (set(listed.stdout.split()) & host), listed.stdout  # none of the host's interfaces


@pytest.mark.anyio
async def test_root_inside_is_not_root_outside(env: LocalEnvironment) -> None:
    result = await env.exec("id -u; cat /proc/self/uid_map; touch /tmp/mine; sleep 30 & echo $!")
    uid, inside, outside, _count, *_ = (result.stdout or "").split()
    assert (uid, inside) == ("0", "0")
    assert outside != "0" and int(outside) == env.host_uid  # root inside = an unprivileged host uid
    keeper = psutil.Process(env._keeper.init_pid)  # the sandbox's PID 1 on the host
    assert keeper.uids().real != 0 and keeper.uids().effective != 0
    assert all(p.uids().effective != 0 for p in keeper.children(recursive=True))
    if ROOT:  # its files on the host belong to that uid too
        assert (Path(os.path.realpath(env.root / "fs")) / "tmp" / "mine").stat().st_uid == env.host_uid


@pytest.mark.anyio
async def test_uploads_and_logs_belong_to_the_sandboxs_root(env: LocalEnvironment, tmp_path: Path) -> None:
    source = tmp_path / "up"
    (source / "deep").mkdir(parents=True)
    (source / "deep" / "f.txt").write_text("f")
    await env.upload_dir(source, "/data")
    await env.upload_file(source / "deep" / "f.txt", "/data/single.txt")
    owners = await env.exec("stat -c '%u:%g %n' /data /data/deep /data/deep/f.txt /data/single.txt /logs/verifier /app")
    assert [line.split()[0] for line in owners.stdout.splitlines()] == ["0:0"] * 6, owners.stdout
    # so the sandbox's root can change them without any capability over foreign files
    assert (await env.exec("echo x >> /data/deep/f.txt && chmod 600 /data/single.txt")).return_code == 0


@pytest.mark.anyio
async def test_no_host_secrets_and_no_host_folders(env: LocalEnvironment, tmp_path: Path) -> None:
    canary = tmp_path / "host-canary.txt"
    canary.write_text("host only")
    result = await env.exec(
        f"cat /etc/shadow /etc/gshadow /etc/machine-id; ls /etc/ssh; ls /root /work; cat {canary}; "
        "ls /var/run/docker.sock /run/docker.sock; echo; awk 'BEGIN{print \"awk-ok\"}'; ls /etc/ssl/certs | wc -l"
    )
    assert "host only" not in (result.stdout or "")
    assert not re.search(r"^root:.", result.stdout or "", re.M)  # no shadow entry (an empty /root is the sandbox's)
    assert "awk-ok" in (result.stdout or "")  # /etc/alternatives works
    assert int((result.stdout or "0").split()[-1]) > 0  # CA certificates
    for path in ("/etc/shadow", "/etc/gshadow", "/etc/machine-id", "/etc/ssh", "/work", str(canary), "docker.sock"):
        assert path in (result.stderr or ""), (path, result.stderr)
    passwd = await env.exec("cat /etc/passwd")
    assert {line.split(":")[0] for line in passwd.stdout.splitlines()} == {"root", "nobody"}


@pytest.mark.anyio
async def test_host_processes_are_invisible_and_unkillable(env: LocalEnvironment) -> None:
    host = subprocess.Popen(["sleep", "300"])
    try:
        result = await env.exec(f"ls /proc | grep -c '^[0-9]'; kill -9 {host.pid}; kill -9 1; echo done")
        assert int(result.stdout.split()[0]) < 10  # the sandbox's own processes only
        assert host.poll() is None  # still running
        assert (await env.exec("echo alive")).stdout == "alive\n"  # PID 1 survived too
    finally:
        host.kill()
        host.wait()


@pytest.mark.anyio
async def test_host_loopback_listener_is_unreachable(env: LocalEnvironment) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        result = await env.exec(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected", timeout_sec=20)
        assert "connected" not in (result.stdout or "")
        with pytest.raises(TimeoutError):
            server.accept()  # nobody ever came
    finally:
        server.close()


# -- transfers racing with symlink swaps ---------------------------------------------------


@pytest.mark.anyio
async def test_symlink_swaps_during_transfers_never_reach_the_host(env: LocalEnvironment, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("HOST-SECRET")
    tests = tmp_path / "tests-src"
    (tests / "sub").mkdir(parents=True)
    (tests / "test.sh").write_text(TEST_SH)
    (tests / "sub" / "data.txt").write_text("x" * 10000)
    # Swap /tests, a file under it, and download paths for symlinks to the host's canary and secret, without end.
    await env.exec(
        "mkdir -p /logs/verifier; (while :; do "
        f"rm -rf /tests; ln -sfn {canary} /tests; rm -f /tests 2>/dev/null; mkdir -p /tests; "
        f"ln -sfn {canary} /tests/sub; ln -sfn {canary}/test.sh /tests/test.sh; "
        f"ln -sfn {secret} /logs/verifier/reward.txt; ln -sfn {canary} /logs/verifier/dir; "
        "echo 1 > /logs/verifier/reward.txt.real; rm -f /logs/verifier/reward.txt; "
        "echo 1 > /logs/verifier/reward.txt; done) > /dev/null 2>&1 &"
    )
    downloads = tmp_path / "downloads"
    for attempt in range(25):
        for call in (
            env.upload_dir(tests, "/tests"),
            env.upload_file(tests / "test.sh", "/tests/test.sh"),
            env.upload_dir(tests, "/tests/sub"),
            env.download_dir("/logs/verifier", downloads / str(attempt)),
            env.download_file("/logs/verifier/reward.txt", downloads / f"reward-{attempt}.txt"),
        ):
            try:
                await call
            except (OSError, ValueError):
                pass  # a transfer may fail mid-swap; it must never leave the sandbox
    assert list(canary.iterdir()) == []
    assert secret.read_text() == "HOST-SECRET"
    leaked = [p for p in downloads.rglob("*") if p.is_file() and "HOST-SECRET" in p.read_text(errors="replace")]
    assert leaked == []
    assert all(not p.is_symlink() for p in downloads.rglob("*"))


# -- task files that lead out of the task -------------------------------------------------


@pytest.mark.anyio
async def test_copy_source_symlink_out_of_the_task_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("HOST-SECRET")
    task = make_task(tmp_path / "suite")
    (task / "environment" / "data.txt").symlink_to(secret)
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nCOPY data.txt /app/data.txt\n")
    env = make_env(tmp_path, task, "copyleak")
    with pytest.raises(TaskPathEscapeError, match="data.txt") as caught:
        await env.start(force_build=False)
    await env.stop(delete=True)
    assert caught.value.path.name == "data.txt"
    assert not env.root.exists()


@pytest.mark.anyio
@pytest.mark.parametrize("entry", ["instruction.md", "tests", "solution"])
async def test_task_entries_symlinked_out_of_the_task_are_refused(tmp_path: Path, entry: str) -> None:
    task = make_task(tmp_path / "suite")
    outside = tmp_path / f"outside-{entry}"
    shutil.move(task / entry, outside)
    (task / entry).symlink_to(outside)
    trial_paths = TrialPaths(tmp_path / "trial")
    trial_paths.mkdir()
    with pytest.raises(TaskPathEscapeError, match=entry) as caught:
        # Harbor's Task refuses tests/ and solution/ symlinks itself; the backend refuses them without it too.
        LocalEnvironment(
            environment_dir=task / "environment", environment_name="t", session_id="entry",
            trial_paths=trial_paths, task_env_config=EnvironmentConfig(), sandbox_root=tmp_path / "sandboxes",
        )  # fmt: skip
    assert caught.value.path == task / entry


# -- limits: processes, memory, storage, output ------------------------------------------


@pytest.mark.slow
@needs_root
@pytest.mark.anyio
async def test_fork_bomb_stops_at_the_process_limit(env: LocalEnvironment, neighbour, tmp_path: Path) -> None:
    host_before = len(psutil.pids())
    bomb = "for i in $(seq 750); do sleep 60 & done 2>/dev/null; wait"
    async with anyio.create_task_group() as group:
        for _ in range(4):  # 3,000 processes asked for, by four at once
            group.start_soon(lambda: env.exec(bomb, timeout_sec=40))
        await anyio.sleep(3)
        count = await env.exec("ls /proc | grep -c '^[0-9]'")
        inside = len([p for p in psutil.process_iter(["uids"]) if p.info["uids"].real == env.host_uid])
        assert await verifies(neighbour, tmp_path)  # the neighbour still forks and verifies
        group.cancel_scope.cancel()
    assert 900 <= inside <= 1024, inside  # the bomb went off, and stopped at the limit
    if count.return_code == 0:  # the count itself may not fork at the limit
        assert int(count.stdout) <= 1024
    assert len(psutil.pids()) < host_before + 1100


@needs_root
@pytest.mark.anyio
async def test_memory_past_the_limit_is_killed_or_refused(tmp_path: Path, neighbour) -> None:
    task = make_task(tmp_path / "suite", "memory", toml_env="memory_mb = 128\n")
    env = make_env(tmp_path, task, "memory")
    await env.start(force_build=False)
    try:
        hog = "python3 -c 'b = bytearray(200 * 1024 * 1024); print(len(b))'"
        async with anyio.create_task_group() as group:
            results = []

            async def one() -> None:
                results.append(await env.exec(hog, timeout_sec=60))

            for _ in range(3):
                group.start_soon(one)
            assert await verifies(neighbour, tmp_path)
        for result in results:  # each one killed by the OOM killer, or refused with MemoryError
            assert result.return_code == 137 or "MemoryError" in (result.stderr or ""), result
            assert str(200 * 1024 * 1024) not in (result.stdout or "")
        assert (await env.exec("echo still-here")).stdout == "still-here\n"
    finally:
        await env.stop(delete=True)


@needs_root
@pytest.mark.anyio
async def test_disk_past_storage_mb_is_enospc_and_neighbours_verify(tmp_path: Path, neighbour) -> None:
    task = make_task(tmp_path / "suite", "storage", toml_env="storage_mb = 32\nmemory_mb = 512\n")
    env = make_env(tmp_path, task, "storage")
    await env.start(force_build=False)
    try:
        fill = await env.exec(
            "dd if=/dev/zero of=/tmp/a bs=1M count=40 & dd if=/dev/zero of=/app/b bs=1M count=40 & wait; "
            "df -m / | tail -1"
        )
        assert "No space left on device" in (fill.stderr or ""), fill.stderr
        assert await verifies(neighbour, tmp_path)
        host_free = shutil.disk_usage(tmp_path).free
        assert host_free > 64 * 1024 * 1024  # the host's disk was never touched by the fill
    finally:
        await env.stop(delete=True)


@pytest.mark.slow
@pytest.mark.anyio
async def test_printing_at_full_speed_keeps_the_callers_memory_flat(env: LocalEnvironment) -> None:
    me = psutil.Process()
    gc.collect()
    peak = [me.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak.append(me.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = await env.exec("timeout 10 yes; echo end >&2", timeout_sec=60)
    finally:
        stop.set()
        sampler.join()
    # Measured as growth: the test process may already hold torch and the rest of the suite.
    assert max(peak) - peak[0] < 100 * 1024 * 1024, (peak[0], max(peak))
    assert len(result.stdout) <= 1024 * 1024 + 100
    assert "bytes of output dropped" in result.stdout
    assert result.stdout.startswith("y\ny\n") and result.stdout.endswith("y\n")
    assert result.stderr == "end\n"


# -- limits come from task.toml, else from the backend's keywords ------------------------------


def test_limits_from_task_toml_else_backend_keywords(tmp_path: Path) -> None:
    stated = make_env(tmp_path, make_task(tmp_path / "a", toml_env="cpus = 0.5\nmemory_mb = 300\n"), "a")
    assert (stated.limits.cpus, stated.limits.memory_mb, stated.limits.pids) == (0.5, 300, 1024)
    # keywords arrive as text from Harbor's CLI (--ek memory_mb=512)
    default = make_env(tmp_path, make_task(tmp_path / "b"), "b", memory_mb="512", storage_mb="64", pids_limit="100")
    assert (default.limits.memory_mb, default.limits.storage_mb, default.limits.pids) == (512, 64, 100)
    assert default.limits.cpus is None


@needs_root
@pytest.mark.anyio
async def test_cgroups_carry_the_tasks_limits(tmp_path: Path) -> None:
    env = make_env(tmp_path, make_task(tmp_path / "s", toml_env="cpus = 0.5\nmemory_mb = 300\n"), "cg")
    await env.start(force_build=False)
    try:
        cgroups = env._confinement.cgroups
        assert cgroups is not None
        names = ("pids.max", "memory.limit_in_bytes", "cpu.cfs_quota_us", "cpu.cfs_period_us", "memory.max", "cpu.max")
        values = {
            p.name: p.read_text().strip() for folder in cgroups.folders for p in folder.iterdir() if p.name in names
        }
        if cgroups.version == "v1":
            assert values["pids.max"] == "1024"
            assert values["memory.limit_in_bytes"] == str(300 * 1024 * 1024)
            assert values["cpu.cfs_quota_us"] == "50000" and values["cpu.cfs_period_us"] == "100000"
        else:
            assert values["pids.max"] == "1024" and values["memory.max"] == str(300 * 1024 * 1024)
            assert values["cpu.max"] == "50000 100000"
        # every process of the sandbox is in them, execs included
        pid = int((await env.exec("sleep 30 & echo $!")).stdout)
        assert pid and env._keeper.init_pid in cgroups.pids()
        assert len(cgroups.pids()) >= 3  # init, its sleep, the exec's sleep
    finally:
        await env.stop(delete=True)
    assert not any(folder.exists() for folder in cgroups.folders)


@needs_root
@pytest.mark.anyio
async def test_resources_above_the_hosts_are_lowered_to_it(tmp_path: Path) -> None:
    from harbor_async.tasks.resources import host_cpus, host_memory_mb

    huge = "cpus = 100000\nmemory_mb = 10000000\nstorage_mb = 10000000\n"  # 100k CPUs, 10 TB
    env = make_env(tmp_path, make_task(tmp_path / "s", toml_env=huge), "huge")
    assert (env.limits.cpus, env.limits.memory_mb, env.limits.storage_mb) == (host_cpus(), host_memory_mb(), host_memory_mb())
    await env.start(force_build=False)
    try:
        cgroups = env._confinement.cgroups
        memory = next(p for f in cgroups.folders for p in f.iterdir() if p.name in ("memory.max", "memory.limit_in_bytes"))
        assert int(memory.read_text()) == host_memory_mb() * 2**20  # a limit, the host's, not 10 TB
        assert (await env.exec("echo up")).stdout == "up\n"
    finally:
        await env.stop(delete=True)


@needs_root
@pytest.mark.anyio
async def test_a_sandbox_whose_limits_cannot_apply_does_not_start(tmp_path: Path, monkeypatch) -> None:
    from harbor_async.backends.local import limits
    from harbor_async.backends.local.errors import LimitUnavailableError

    monkeypatch.setattr(limits, "cgroup_version", lambda: None)  # a read-only cgroupfs, as in a container
    refused = make_env(tmp_path, make_task(tmp_path / "a"), "nolimits")
    with pytest.raises(LimitUnavailableError, match="require_limits=false"):
        await refused.start(force_build=False)
    assert not refused.root.exists()  # nothing left of it
    allowed = make_env(tmp_path, make_task(tmp_path / "b"), "besteffort", require_limits="false")
    await allowed.start(force_build=False)
    try:
        assert allowed._confinement.cgroups is None and (await allowed.exec("echo up")).stdout == "up\n"
    finally:
        await allowed.stop(delete=True)


@needs_root
@pytest.mark.anyio
async def test_other_host_users_cannot_read_a_sandbox(env: LocalEnvironment) -> None:
    await env.exec("echo private > /tmp/note && chmod 644 /tmp/note")  # world-readable inside
    fs = env.root / "fs"
    assert os.stat(fs).st_mode & 0o077 == 0
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    for command in (["ls", str(fs)], ["cat", str(fs / "tmp" / "note")]):
        denied = subprocess.run([*nobody, *command], capture_output=True, text=True)
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    assert (await env.exec("ls -ld / | cut -c1-10; cat /tmp/note")).stdout.splitlines() == ["drwx------", "private"]


@pytest.mark.anyio
async def test_a_sandbox_sees_no_other_cgroup_than_its_own(env: LocalEnvironment, neighbour) -> None:
    seen = (await env.exec("find /sys/fs/cgroup -maxdepth 3 2>/dev/null; cat /proc/self/cgroup")).stdout
    assert "harbor-async" not in seen and neighbour.root.name not in seen and env.root.name not in seen
    cgroups = env._confinement.cgroups if env._confinement is not None else None
    if cgroups is not None and cgroups.version == "v2":  # its own limits, as a container reads them
        limit = (await env.exec("cat /sys/fs/cgroup/memory.max")).stdout.strip()
        assert limit == (cgroups.folders[0] / "memory.max").read_text().strip()


@pytest.mark.slow
@pytest.mark.anyio
async def test_background_writers_of_many_execs_hold_a_bounded_number_of_host_descriptors(env: LocalEnvironment) -> None:
    from harbor_async.backends.local.output import MAX_ADOPTED

    before = len(os.listdir("/proc/self/fd"))
    for i in range(80):  # each leaves a process holding its exec's stdout and stderr
        await env.exec(f"sh -c 'while :; do echo tick-{i}; sleep 0.2; done' &")
    await anyio.sleep(0.5)
    grown = len(os.listdir("/proc/self/fd")) - before
    assert grown <= MAX_ADOPTED + 8, grown  # not 2 per exec (160)
    alive = (await env.exec("ps -eo args | grep -c '[t]ick-'")).stdout.strip()
    assert int(alive) >= MAX_ADOPTED // 2  # the newest writers run on, read and discarded


def test_image_warning_names_images_that_are_not_the_host_userland() -> None:
    from harbor_async.backends.local.images import host_os_release, image_mismatch

    host = host_os_release()
    same = f"{host['ID']}:{host.get('VERSION_CODENAME') or host['VERSION_ID']}"
    assert image_mismatch(f"FROM {same}\nRUN true\n") is None
    for image in ("python:3.12-slim", "ubuntu:10.04" if host["ID"] != "ubuntu" else "debian:10", f"{host['ID']}:1"):
        warning = image_mismatch(f"FROM builder AS x\nFROM {image}\n")
        assert warning is not None and image in warning and "host" in warning
