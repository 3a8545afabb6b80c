"""Harbor's ``--mounts`` in ``harbor-async run``: read-only unless ``--mounts-writable``, on local and docker (issue 46).

Real sandboxes, no mocks: the task's oracle solution (what a model could run)
reads a host file through the mount and tries to overwrite it; its test reads
the file too. Without ``--mounts-writable`` the write fails inside the sandbox
and the host file stays as it was; with it the write goes through. Every
refusal is one line and exit 2 before anything starts.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_async.tasks.mounts import MountError, check_backend, parse_mounts
from tests.cli_helpers import TASK_TOML, harbor_async, records
from tests.requirements import needs_bwrap

CONTENT = "hello-from-host"

TOML = TASK_TOML
# What a model could run: read the mounted files, then try to overwrite the folder's one: after remounting it
# writable (in place, from a user namespace of its own) or unmounting it, then plainly.
SOLVE = """#!/bin/bash
mkdir -p /app
cat /data/secret.txt > /app/seen.txt
cat /opt/hint.txt > /app/hint.txt
mount -o remount,rw,bind /data && echo changed-by-remount > /data/secret.txt
unshare -Urm sh -c 'mount -o remount,rw,bind /data && echo changed-by-remount > /data/secret.txt'
umount /data && echo planted > /data/secret.txt
if echo changed-by-sandbox > /data/secret.txt; then echo wrote > /app/write.txt; else echo refused > /app/write.txt; fi
"""
# The verifier reads the mount too; it prints what the agent saw (the test reads test-stdout.txt).
TEST = """#!/bin/bash
echo "write: $(cat /app/write.txt) hint: $(cat /app/hint.txt) now: $(cat /data/secret.txt)"
if [ "$(cat /app/seen.txt)" = "{content}" ] && [ "$(cat /app/hint.txt)" = hint ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def make_suite(root: Path) -> Path:
    task = root / "tasks" / "reader"
    for folder in ("environment", "solution", "tests"):
        (task / folder).mkdir(parents=True)
    (task / "task.toml").write_text(TOML)
    (task / "instruction.md").write_text("Read /data/secret.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text(SOLVE)
    (task / "tests" / "test.sh").write_text(TEST.replace("{content}", CONTENT))
    return root


@pytest.fixture
def host_folder() -> Iterator[Path]:
    """A host folder any uid may reach (a local sandbox run as root is a uid of its own), its file writable by all:
    a refused write is the mount's doing, not the file's permissions."""
    folder = Path(tempfile.mkdtemp(prefix="harbor-async-mounts-", dir="/tmp"))
    folder.chmod(0o755)
    (folder / "data").mkdir(mode=0o755)  # apart from hint.txt: nothing mounted lies below a writable mount
    (folder / "data" / "secret.txt").write_text(CONTENT + "\n")
    (folder / "data" / "secret.txt").chmod(0o666)
    (folder / "hint.txt").write_text("hint\n")
    (folder / "hint.txt").chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def mounts_json(folder: Path) -> str:
    """Both of Compose's forms: a short string for the folder, an object for one file."""
    return json.dumps([f"{folder / 'data'}:/data", {"type": "bind", "source": str(folder / "hint.txt"), "target": "/opt/hint.txt"}])


def run_with_mounts(suite: Path, jobs: Path, name: str, *flags: str) -> tuple[dict, str]:
    """A run of the suite; its one record and what its verifier printed."""
    done = harbor_async("run", "-p", str(suite), "-o", str(jobs), "--job-name", name, "-q", *flags, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = records(jobs / name)
    (stdout,) = (jobs / name).glob("reader__*/verifier/test-stdout.txt")
    return record, stdout.read_text()


def check_read_only(tmp_path: Path, folder: Path, *backend: str) -> None:
    """A run with the mounts: both read, no write reached the host; the job keeps them read-only."""
    jobs = tmp_path / "jobs"
    record, said = run_with_mounts(make_suite(tmp_path / "suite"), jobs, "ro", *backend, "--mounts", mounts_json(folder))
    assert record["reward"] == 1.0, record  # the agent and the verifier read the host's files
    assert "write: refused" in said and f"now: {CONTENT}" in said, said
    assert (folder / "data" / "secret.txt").read_text() == CONTENT + "\n"  # the host file is unchanged
    stored = json.loads((jobs / "ro" / "harbor-async.json").read_text())
    assert all(m["read_only"] is True for m in stored["mounts"]) and stored["mounts_writable"] is False


def check_writable(tmp_path: Path, folder: Path, *backend: str) -> None:
    """The same run with --mounts-writable: the sandbox's write reaches the host file."""
    suite, jobs = make_suite(tmp_path / "suite-rw"), tmp_path / "jobs"
    record, said = run_with_mounts(suite, jobs, "rw", *backend, "--mounts", mounts_json(folder), "--mounts-writable")
    assert record["reward"] == 1.0, record
    assert "write: wrote" in said and "now: changed-by-sandbox" in said, said
    assert (folder / "data" / "secret.txt").read_text() == "changed-by-sandbox\n"  # only with the flag


@pytest.mark.slow
@needs_bwrap
def test_local_mounts_are_read_only(tmp_path: Path, host_folder: Path) -> None:
    check_read_only(tmp_path, host_folder, "-e", "local")


@pytest.mark.slow
@needs_bwrap
def test_local_mounts_are_writable_only_with_the_flag_and_a_resume_keeps_them(tmp_path: Path, host_folder: Path) -> None:
    check_read_only(tmp_path, host_folder, "-e", "local")
    # a resume runs the job's mounts: given anew, they must be the same
    resumed = harbor_async("run", "--resume", str(tmp_path / "jobs" / "ro"), "--mounts-writable")
    assert resumed.returncode == 2 and "--mounts-writable" in resumed.stderr, resumed.stderr
    other = harbor_async("run", "--resume", str(tmp_path / "jobs" / "ro"), "--mounts", f'["{host_folder}:/elsewhere"]')
    assert other.returncode == 2 and "--mounts" in other.stderr, other.stderr
    same = harbor_async("run", "--resume", str(tmp_path / "jobs" / "ro"), "--mounts", mounts_json(host_folder), "-q")
    assert same.returncode == 0, same.stderr
    check_writable(tmp_path, host_folder, "-e", "local")


@pytest.mark.slow
@needs_bwrap
def test_a_local_source_the_sandbox_uid_cannot_reach_is_refused_before_anything_starts(tmp_path: Path) -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("as root only: a sandbox then is a uid of its own")
    closed = tmp_path / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    done = harbor_async("run", "-p", str(make_suite(tmp_path / "suite")), "-o", str(tmp_path / "jobs"),
                        "--mounts", f'["{closed / "inner"}:/data"]')  # fmt: skip
    assert done.returncode == 2 and f"{closed} gives other users no search" in done.stderr, done.stderr
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_docker_mounts_are_read_only_unless_the_writable_flag_is_given(tmp_path: Path, host_folder: Path) -> None:
    check_read_only(tmp_path, host_folder, "-e", "docker")
    check_writable(tmp_path, host_folder, "-e", "docker")


# ── refusals: one line, exit 2, before anything starts ──────────────────────────


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "not JSON"),
        ('{"source": "SRC"}', "expected a JSON array"),
        ('["relative/path:/data"]', "is relative"),
        ('["/no/such/host/path:/data"]', "does not exist"),
        ('["SRC:data"]', "not an absolute sandbox path"),
        ('["SRC"]', "SOURCE:TARGET"),
        ('["SRC:/data:z"]', "mode 'z'"),
        ('["SRC:/tests"]', "reserved"),
        ('["SRC:/logs/verifier"]', "reserved"),
        ('["SRC:/"]', "reserved"),
        ('["SRC:/data", "/usr:/data/"]', "a second mount on /data"),
        ('["SRC:/data:rw"]', "--mounts-writable"),
        ('[{"type": "bind", "source": "SRC", "target": "/data", "read_only": false}]', "--mounts-writable"),
        ('[{"type": "volume", "source": "cache", "target": "/data"}]', 'only "bind"'),
        ('[{"type": "bind", "source": "SRC", "target": "/data", "bind": {"selinux": "z"}}]', "bind options"),
        ('[{"type": "bind", "source": "SRC", "target": "/data", "mode": "rw"}]', "'mode' not taken"),
        ('[7]', "got int"),
    ],
)
def test_what_cannot_be_mounted_is_refused_with_the_reason(text: str, says: str, tmp_path: Path) -> None:
    with pytest.raises(MountError) as caught:
        parse_mounts(text.replace("SRC", str(tmp_path)))
    assert says in str(caught.value) and "\n" not in str(caught.value), caught.value


def test_mounts_are_read_only_whatever_the_json_says_unless_writable(tmp_path: Path) -> None:
    given = f'["{tmp_path}:/data", "{tmp_path}:/ro:ro", {{"type": "bind", "source": "{tmp_path}/", "target": "/x/../obj"}}]'
    assert parse_mounts(given) == [
        {"type": "bind", "source": str(tmp_path), "target": target, "read_only": True} for target in ("/data", "/ro", "/obj")
    ]
    # with --mounts-writable each is as Harbor reads it: writable unless it says read-only
    writable = parse_mounts(given, writable=True)
    assert [m.get("read_only", False) for m in writable] == [False, True, False]
    assert parse_mounts(f'["{tmp_path}:/data:rw"]', writable=True) == [{"type": "bind", "source": str(tmp_path), "target": "/data"}]
    assert parse_mounts(None) == [] and parse_mounts("[]") == []


def test_only_local_and_docker_honour_mounts() -> None:
    from harbor.environments.docker.docker import DockerEnvironment

    from harbor_async.backends.local import LocalEnvironment
    from harbor_async.backends.simulated import SimulatedEnvironment

    mounts = [{"type": "bind", "source": "/tmp", "target": "/data", "read_only": True}]
    check_backend(DockerEnvironment, "docker", mounts)
    check_backend(LocalEnvironment, "local", mounts)
    check_backend(SimulatedEnvironment, "simulated", [])  # nothing to honour
    with pytest.raises(MountError, match="backend 'simulated' cannot honour host mounts"):
        check_backend(SimulatedEnvironment, "simulated", mounts)
    with pytest.raises(MountError, match="cannot mount onto /usr/lib/x"):  # the host's read-only /usr, on local
        check_backend(LocalEnvironment, "local", [{**mounts[0], "target": "/usr/lib/x"}])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--mounts", "[oops"], "--mounts: not JSON"),
        (["--mounts", '["data:/data"]'], "is relative"),
        (["--mounts", '["SRC:/data:rw"]'], "unless --mounts-writable is given"),
        (["--mounts", '["SRC:/data"]', "-e", "simulated"], "backend 'simulated' cannot honour host mounts"),
        (["--ek", 'mounts=[{"type":"bind","source":"SRC","target":"/data"}]'], "--ek mounts: host paths are mounted with --mounts"),
        (["--ek", 'auto_mounts=[{"type":"bind","source":"SRC","target":"/x"}]'], "--ek auto_mounts: host paths are mounted with --mounts"),
        (["--mounts", '["SUITE:/data"]'], "overlaps the suite"),
        (["--mounts", '["JOBS:/data"]'], "overlaps the jobs folder"),
    ],
    ids=["malformed", "relative", "writable", "backend", "ek", "ek-auto", "suite", "jobs"],
)
def test_the_command_refuses_in_one_line_before_anything_starts(tmp_path: Path, flags: list[str], says: str) -> None:
    suite = make_suite(tmp_path / "suite")
    source = tmp_path / "src"
    source.mkdir()
    flags = [f.replace("SRC", str(source)).replace("SUITE", str(suite)).replace("JOBS", str(tmp_path)) for f in flags]
    done = harbor_async("run", "-p", str(suite), "-o", str(tmp_path / "jobs"), *flags)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and says in line, line
    assert not (tmp_path / "jobs").exists()


def test_what_would_open_the_host_is_refused_as_a_source(tmp_path: Path) -> None:
    """A read-only bind of a socket still connects (docker.sock), a device still reads; the kernel's and the runtime's
    folders are refused whole; a source is resolved once (a link swapped later moves nothing)."""
    import socket

    holder = Path(tempfile.mkdtemp(prefix="ha-sock-", dir="/tmp"))  # a short path: AF_UNIX's limit
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(holder / "api.sock"))
    try:
        for text, says in [
            (f'["{holder / "api.sock"}:/s"]', "not a file or folder"),
            (f'["{holder}:/d"]', "is a socket, FIFO or device"),
            ('["/proc/self:/p"]', "reserved"),
            ('["/var/run:/r"]', "reserved"),
            ('["/:/host"]', "reserved"),
            ('["/dev/null:/n"]', "reserved"),
        ]:
            with pytest.raises(MountError, match=says):
                parse_mounts(text)
    finally:
        server.close()
        shutil.rmtree(holder, ignore_errors=True)
    data, link = tmp_path / "data", tmp_path / "link"
    (data / "inner").mkdir(parents=True)
    link.symlink_to(data)
    assert parse_mounts(f'["{link}:/d"]')[0]["source"] == str(data)  # the folder the link named, not the link
    with pytest.raises(MountError, match="overlaps the writable"):  # the sandbox could swap what the inner one binds
        parse_mounts(f'["{data}:/w:rw", "{data / "inner"}:/r:ro"]', writable=True)


def test_the_engine_mounts_read_only_what_does_not_say_and_refuses_reserved_targets(tmp_path: Path) -> None:
    from harbor_async.engine.engine import Engine

    mount = {"type": "bind", "source": str(tmp_path), "target": "/data"}
    assert Engine(mounts=[mount]).mounts == [{**mount, "read_only": True}]
    assert Engine(mounts=[mount], mounts_writable=True).mounts == [mount]  # as --mounts-writable: Harbor's reading
    with pytest.raises(MountError, match="mounts-writable"):
        Engine(mounts=[{**mount, "read_only": False}])
    with pytest.raises(MountError, match="reserved"):  # a Python caller's too: the reward's folder is never a mount
        Engine(mounts=[{**mount, "target": "/logs/verifier"}], mounts_writable=True)


@pytest.mark.slow
@needs_bwrap
def test_a_separate_verifier_gets_no_host_mount(tmp_path: Path, host_folder: Path) -> None:
    """What the agent wrote (or still writes) through a writable mount is not the judge's to read."""
    shared = host_folder / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # the sandbox's own uid may write there: only the mount decides
    task = tmp_path / "suite" / "sep"
    for folder in ("environment", "solution", "tests"):
        (task / folder).mkdir(parents=True)
    (task / "task.toml").write_text('schema_version = "1.4"\n[verifier]\nenvironment_mode = "separate"\n')
    (task / "instruction.md").write_text("Forge.\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho 1 > /data/forged\n")
    (task / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif [ -e /data/forged ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
    )
    done = harbor_async(
        "run", "-p", str(tmp_path / "suite"), "-e", "local", "-o", str(tmp_path / "jobs"), "--job-name", "j",
        "--mounts", f'["{shared}:/data:rw"]', "--mounts-writable",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (record,) = records(tmp_path / "jobs" / "j")
    assert (shared / "forged").exists()  # the agent's sandbox had the writable mount
    assert record["reward"] == 0.0, record  # the judge's sandbox had none


# ── Harbor's job configs: environment.mounts ────────────────────────────────────


@pytest.mark.slow
def test_a_job_configs_mounts_run_read_only_and_print_back(tmp_path: Path, host_folder: Path) -> None:
    import yaml

    suite = make_suite(tmp_path / "suite")
    config = tmp_path / "job.yaml"
    mount = {"type": "bind", "source": str(host_folder), "target": "/data"}
    config.write_text(yaml.safe_dump({"datasets": [{"path": str(suite)}], "environment": {"type": "docker", "mounts": [mount]}}))
    printed = harbor_async("run", "-c", str(config), "--print-config")
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout)["environment"]["mounts"] == [{**mount, "read_only": True}]  # ours: read-only
    # what Harbor's model takes, a writable mount among it, is refused naming the file's field, unless the flag is given
    config.write_text(yaml.safe_dump({"datasets": [{"path": str(suite)}], "environment": {"mounts": [{**mount, "source": "rel"}]}}))
    refused = harbor_async("run", "-c", str(config), "-o", str(tmp_path / "jobs"))
    assert refused.returncode == 2 and "environment.mounts[0]: source 'rel' is relative" in refused.stderr, refused.stderr
    assert not (tmp_path / "jobs").exists()
    config.write_text(yaml.safe_dump({"datasets": [{"path": str(suite)}], "environment": {"type": "docker", "mounts": [mount]}}))
    writable = harbor_async("run", "-c", str(config), "--mounts-writable", "--print-config")
    assert json.loads(writable.stdout)["environment"]["mounts"] == [mount]  # Harbor's meaning: writable


@pytest.mark.slow
@pytest.mark.range  # the JobConfig Harbor prints with --mounts reads back to the same job
def test_harbors_printed_mounts_read_back(tmp_path: Path, host_folder: Path) -> None:
    from tests.test_job_config import printed_config, same_job

    mounts = json.dumps([{"type": "bind", "source": str(host_folder), "target": "/data", "read_only": True}])
    config = printed_config(tmp_path, "-e", "harbor_async.backends.local:LocalEnvironment", "-a", "nop", "--mounts", mounts)
    ours = harbor_async("run", "-c", str(config), "--print-config")
    assert ours.returncode == 0, ours.stderr
    assert same_job(json.loads(ours.stdout), json.loads(config.read_text()))
    assert json.loads(ours.stdout)["environment"]["mounts"] == json.loads(mounts)
