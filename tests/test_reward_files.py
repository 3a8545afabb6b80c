"""Reward files are read with bounds: a verifier that writes junk fails as the verifier, never as infrastructure.

The parsing is checked on its own, then end to end: tasks whose test script
writes a hostile reward file run through the engine on the local backend.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from harbor_async.engine.engine import Engine
from harbor_async.episodes.runner import run_suite
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_task
from harbor_async.verification.reward_files import (
    MAX_REWARD_FILE_BYTES,
    InvalidRewardFileError,
    parse_reward_json,
    parse_reward_text,
    read_bounded,
)


@pytest.mark.parametrize("text, reward", [("1", 1.0), (" 0.5\n", 0.5), ("-2e-3", -0.002), ("+.25", 0.25)])
def test_a_decimal_number_is_a_reward(text, reward):
    assert parse_reward_text(text) == {"reward": reward}


@pytest.mark.parametrize("text", ["1_000_000", "inf", "nan", "true", "1e300", "2000000", "1 2", "", "0x10"])
def test_anything_else_in_reward_txt_is_refused(text):
    with pytest.raises(InvalidRewardFileError):
        parse_reward_text(text)


def test_a_reward_json_is_an_object_of_bounded_numbers():
    assert parse_reward_json('{"reward": 1, "format": 0.5}') == {"reward": 1, "format": 0.5}
    for text in (
        "[" * 100_000 + "]" * 100_000,  # RecursionError in json.loads
        '{"reward": ' + "9" * 4000 + "}",  # an integer no float holds
        '{"reward": true}', '{"reward": NaN}', '{"reward": Infinity}', '{"reward": "1"}', '{"reward": 1e7}',
        "1", "[1]", "{}", '{"reward": {"nested": 1}}', "{" + ",".join(f'"k{i}": 1' for i in range(65)) + "}",
    ):  # fmt: skip
        with pytest.raises(InvalidRewardFileError):
            parse_reward_json(text)


def test_a_reward_file_is_read_only_if_it_is_a_small_regular_file(tmp_path: Path):
    good = tmp_path / "reward.txt"
    good.write_text("1")
    assert read_bounded(good) == "1"
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as fh:
        fh.truncate(1 << 30)  # 1 GiB of nothing on disk: its apparent size counts
    link = tmp_path / "link.txt"
    link.symlink_to(good)
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)  # would block a plain read forever
    for path in (sparse, link, fifo, tmp_path):
        with pytest.raises(InvalidRewardFileError):
            read_bounded(path)
    big = tmp_path / "big.txt"
    big.write_text("1" * (MAX_REWARD_FILE_BYTES + 1))
    with pytest.raises(InvalidRewardFileError):
        read_bounded(big)


HOSTILE = {
    "deep-json": "python3 -c \"print('[' * 100000 + ']' * 100000)\" > /logs/verifier/reward.json",
    "huge-integer": "python3 -c \"print('{\\\"reward\\\": ' + '9' * 4000 + '}')\" > /logs/verifier/reward.json",
    "underscores": "echo 1_000_000 > /logs/verifier/reward.txt",
    "boolean": "echo '{\"reward\": true}' > /logs/verifier/reward.json",
    "too-large": "echo 1e300 > /logs/verifier/reward.txt",
    "symlink": "ln -s /etc/passwd /logs/verifier/reward.json",
}


@pytest.mark.range
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_hostile_reward_file_is_the_verifiers_failure(tmp_path: Path):
    template = example_suite_path() / "tasks" / "count-log-files"
    tasks = []
    for name, script in HOSTILE.items():
        task = tmp_path / name
        shutil.copytree(template, task)
        (task / "tests" / "test.sh").write_text(f"#!/bin/sh\nmkdir -p /logs/verifier\n{script}\n")
        tasks.append(load_task(task))
    async with Engine() as engine:
        records = await run_suite(engine, tasks, "local", agent="none", concurrency=3)
    outcomes = {r.task_path.rsplit("/", 1)[-1]: (r.error_class, r.reward, r.rerun) for r in records}
    assert outcomes == {name: ("verifier", 0.0, False) for name in HOSTILE}, [r.error for r in records]


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
async def test_a_verifier_output_swapped_for_a_symlink_reads_nothing_of_the_host(tmp_path: Path, backend: str):
    """The sandbox points its test-stdout.txt at a host file: the record keeps none of that file."""
    secret = tmp_path / "host-secret.txt"
    secret.write_text("HOST-ONLY-CONTENT\n")
    task = tmp_path / "swap"
    shutil.copytree(example_suite_path() / "tasks" / "count-log-files", task)
    (task / "tests" / "test.sh").write_text(
        "#!/bin/sh\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
        f"rm -f /logs/verifier/test-stdout.txt; ln -s {secret} /logs/verifier/test-stdout.txt\n"
    )
    async with Engine() as engine:
        (record,) = await run_suite(engine, [load_task(task)], backend, agent="none")
    assert record.reward == 1.0
    assert "HOST-ONLY-CONTENT" not in (record.verifier_output or "")


@pytest.mark.range
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("reset", [True, False])
async def test_a_verifier_that_resets_its_folder_removes_the_stale_rewards_without_a_round_trip(
    tmp_path: Path, reset: bool
):
    """The folder reset replaces Harbor's `rm -f` of the stale rewards there (one exec more per verdict).

    The trial folder's stale copies still go; without the flag, Harbor's own removal runs.
    """
    from types import SimpleNamespace

    from harbor.models.task.config import TaskOS
    from harbor.models.trial.paths import TrialPaths

    from harbor_async.verification.reward_files import BoundedVerifier

    commands: list[str] = []

    async def exec_(command: str, **_: object):
        commands.append(command)
        return SimpleNamespace(return_code=0, stdout="", stderr="")

    environment = SimpleNamespace(os=TaskOS.LINUX, exec=exec_, is_path_mounted=lambda *_: False)
    paths = TrialPaths(trial_dir=tmp_path)
    paths.verifier_dir.mkdir(parents=True)
    paths.reward_text_path.write_text("1\n")
    paths.reward_json_path.write_text('{"reward": 1}')
    task = load_task(example_suite_path() / "tasks" / "count-log-files")
    verifier = BoundedVerifier(
        task=task, trial_paths=paths, environment=environment, reset_verifier_dir=reset  # type: ignore[arg-type]
    )
    await verifier._remove_reward_files()
    assert not paths.reward_text_path.exists() and not paths.reward_json_path.exists()
    assert commands == ([] if reset else ["rm -f -- /logs/verifier/reward.txt /logs/verifier/reward.json"])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("strict", [False, True])
async def test_a_verdict_waits_on_no_exec_beyond_the_tests(monkeypatch, strict):
    """A batch's rewards wait for every verify: the folder reset and Harbor's chmod of the test script run in the
    tests' own exec (as root, the verifier's usual user). No stale-reward `rm`, no re-read of an empty output.
    A strict verify (the default) adds one exec before it: the end of the agent's processes."""
    from harbor_async.backends.simulated import SimulatedEnvironment

    calls: list[tuple[str, object]] = []
    real = SimulatedEnvironment.exec

    async def exec_(sandbox, command, *args, user=None, **kwargs):
        calls.append((command, user))
        return await real(sandbox, command, *args, user=user, **kwargs)

    monkeypatch.setattr(SimulatedEnvironment, "exec", exec_)
    async with Engine(strict_verify=strict) as engine:
        (record,) = await run_suite(
            engine, [load_task(example_suite_path() / "tasks" / "count-log-files")], "simulated", agent="none"
        )
    assert record.reward == 1.0 and record.error is None
    if strict:
        (kill, _), *calls = calls
        assert "end_agent_processes" in kill, kill
    assert len(calls) == 1, calls
    ((command, user),) = calls
    assert user is None  # the verifier's user, as Harbor runs the tests
    steps = ['[ "$(id -u)" = 0 ]', "mkdir -p /logs/verifier", "-exec rm -rf", "chmod 777 /logs/verifier"]
    steps += ["chmod +x /tests/test.sh", "(/tests/test.sh) > /logs/verifier/test-stdout.txt"]
    assert [command.index(step) for step in steps] == sorted(command.index(step) for step in steps), command


def _user_task(tmp_path: Path, name: str, verifier_user: str | None, runs_as: str = "", dockerfile: str = "") -> Path:
    """A task whose test writes 1 if it runs as ``runs_as`` (``verifier_user``, or root) and nothing was planted."""
    task = tmp_path / name
    shutil.copytree(example_suite_path() / "tasks" / "count-log-files", task)
    if verifier_user is not None:
        toml = (task / "task.toml").read_text().replace("[verifier]", f'[verifier]\nuser = "{verifier_user}"', 1)
        assert f'user = "{verifier_user}"' in toml
        (task / "task.toml").write_text(toml)
    if dockerfile:
        (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "tests" / "test.sh").write_text(
        "#!/bin/sh\ntouch /tmp/tests-ran 2>/dev/null\n"
        f'[ "$(id -un)" = {runs_as or verifier_user or "root"} ] && [ ! -e /logs/verifier/planted ] '
        "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    )
    return task


class _Spy:
    """The backend's execs, recorded (they still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
        self.calls: list[tuple[str, object]] = []
        real = cls.exec

        async def exec_(sandbox, command, *args, user=None, **kwargs):
            self.calls.append((command, user))
            return await real(sandbox, command, *args, user=user, **kwargs)

        monkeypatch.setattr(cls, "exec", exec_)


async def _plant_and_verify(engine: Engine, task: Path, backend: str, spy: _Spy, *, times: int = 1) -> list:
    """Plant a file and a reward in the verifier folder, as the agent could, then verify ``times`` times.

    Returns each verify's result and the execs it made.
    """
    sandbox = engine.launch(load_task(task), backend)
    try:
        await sandbox.wait_started()
        plant = "mkdir -p /logs/verifier && touch /logs/verifier/planted && echo 1 > /logs/verifier/reward.txt"
        planted = await sandbox.exec(plant)
        assert planted.exit_code == 0, planted.output
        verdicts = []
        for _ in range(times):
            spy.calls.clear()
            verdicts.append((await sandbox.verify(), list(spy.calls)))
        return verdicts
    finally:
        await sandbox.stop()


@pytest.mark.range
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_a_real_sandbox_the_reset_runs_in_the_tests_exec_as_root_and_apart_for_another_user(
    tmp_path: Path, monkeypatch
):
    """Local: the tests as root get the reset in their exec; for a `[verifier] user` of `nobody` (which the local
    backend runs as root, with a warning) the reset is one exec as root before the tests'. Docker runs as `nobody`
    below."""
    from harbor_async.backends.local import LocalEnvironment

    spy = _Spy(monkeypatch, LocalEnvironment)
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "sandboxes")}) as engine:
        ((as_root, calls),) = await _plant_and_verify(engine, _user_task(tmp_path, "as-root", None), "local", spy)
        assert as_root.reward == 1.0, as_root.output
        assert len(calls) == 1 and "mkdir -p /logs/verifier" in calls[0][0], calls
        nobody = _user_task(tmp_path, "nobody", "nobody", runs_as="root")  # local runs every command as root
        ((as_nobody, calls),) = await _plant_and_verify(engine, nobody, "local", spy)
        assert as_nobody.reward == 1.0, as_nobody.output
        (reset, reset_user), (test, test_user) = calls
        assert reset_user == "root" and "mkdir -p /logs/verifier" in reset and "chmod +x /tests/test.sh" in reset
        assert test_user is None and test.startswith("(/tests/test.sh)") and "id -u" not in test


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.usefixtures("docker_daemon")
async def test_on_docker_an_image_user_that_is_not_root_is_found_once_and_gets_the_reset_apart(
    tmp_path: Path, monkeypatch
):
    """An image whose USER is `nobody`: the first verify finds out in the tests' exec (nothing runs there), resets
    as root, then runs the tests as `nobody`; the next verify of that sandbox goes straight to the reset."""
    from harbor_async.backends.docker.confined import ConfinedDockerEnvironment

    spy = _Spy(monkeypatch, ConfinedDockerEnvironment)
    dockerfile = "FROM debian:bookworm-slim\nUSER nobody\n"  # no RUN: the test daemon builds without a network
    task = _user_task(tmp_path, "image-user", None, runs_as="nobody", dockerfile=dockerfile + "WORKDIR /workdir\n")
    async with Engine() as engine:
        (first, probed), (second, known) = await _plant_and_verify(engine, task, "docker", spy, times=2)
    assert first.reward == 1.0 and second.reward == 1.0, (first.output, second.output)
    assert [user for _, user in probed] == [None, "root", None], probed
    assert "id -u" in probed[0][0] and "mkdir -p /logs/verifier" in probed[1][0], probed
    assert [user for _, user in known] == ["root", None], known  # no second probe
    assert "mkdir -p /logs/verifier" in known[0][0] and known[1][0].startswith("(/tests/test.sh)"), known


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("verifier_user", [None, "nobody"])
@pytest.mark.parametrize(
    "fault, says",
    [("echo no room for the verifier >&2; false", "no room for the verifier"), ("kill -9 $$", "exit code 137")],
    ids=["fails", "shell-killed"],
)
async def test_a_reset_that_did_not_finish_is_the_verifiers_failure_and_runs_no_test(
    tmp_path: Path, monkeypatch, verifier_user: str | None, fault: str, says: str
):
    """A verifier folder that was not emptied may hold the agent's reward: graded 0, the tests never run.

    Also when the shell died before the reset (killed, out of memory): nothing said it finished."""
    from harbor_async.backends.local import LocalEnvironment
    from harbor_async.core.errors import VerifierFailure

    monkeypatch.setattr(LocalEnvironment, "_empty_dirs_command", lambda self, dirs, *, chmod=True: fault)
    spy = _Spy(monkeypatch, LocalEnvironment)
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "sandboxes")}) as engine:
        sandbox = engine.launch(load_task(_user_task(tmp_path, "task", verifier_user)), "local")
        try:
            await sandbox.wait_started()
            with pytest.raises(VerifierFailure, match=f"VerifierFolderResetError.*{says}"):
                await sandbox.verify()
            assert (await sandbox.exec("ls /tmp/tests-ran")).exit_code != 0  # the tests did not run
        finally:
            await sandbox.stop()
    assert spy.calls and not any(command.startswith("(/tests/") for command, _ in spy.calls), spy.calls


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_failed_chmod_of_an_executable_test_script_is_ignored_as_harbor_ignores_it(tmp_path: Path, monkeypatch):
    """Tests that are already executable where they cannot be changed (a read-only image) still run."""
    from harbor_async.backends.local import LocalEnvironment

    real = LocalEnvironment.exec

    async def chmod_fails(sandbox, command, *args, **kwargs):  # fault injection: Harbor's chmod fails
        command = command.replace("chmod +x /tests/test.sh", "chmod +x /tests/none.sh")
        return await real(sandbox, command, *args, **kwargs)

    monkeypatch.setattr(LocalEnvironment, "exec", chmod_fails)
    task = _user_task(tmp_path, "task", None)
    (task / "tests" / "test.sh").chmod(0o755)
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "sandboxes")}) as engine:
        ((verdict, _),) = await _plant_and_verify(engine, task, "local", _Spy(monkeypatch, LocalEnvironment))
    assert verdict.reward == 1.0, verdict.output


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_test_script_without_chmod_gets_the_reset_before_its_first_exec():
    """Where Harbor makes no `chmod` (a script that needs none) the reset still comes first: for a user other
    than root as an exec of its own, as root."""
    from types import SimpleNamespace

    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import TaskOS

    from harbor_async.verification.reward_files import RESET_DONE, _ResettingEnvironment

    calls: list[tuple[str, object]] = []

    async def exec_(command: str, user: object = None, **_: object):
        calls.append((command, user))
        printed = re.findall(rf"{RESET_DONE}-[0-9a-f]+", command)  # what the shell would echo
        return SimpleNamespace(return_code=0, stdout="\n".join(printed), stderr="")

    fake = SimpleNamespace(os=TaskOS.LINUX, exec=exec_, _reset_dirs_user=lambda: "root", default_user="verifier")
    fake._empty_dirs_command = lambda dirs, chmod: BaseEnvironment._empty_dirs_command(fake, dirs, chmod=chmod)
    environment = _ResettingEnvironment(fake)  # type: ignore[arg-type]
    await environment.exec("python3 /tests/test.py")
    await environment.exec("true")
    assert [user for _, user in calls] == ["root", None, None]
    assert "mkdir -p /logs/verifier" in calls[0][0] and "chmod +x" not in calls[0][0]
    assert [command for command, _ in calls[1:]] == ["python3 /tests/test.py", "true"]
    assert environment.os is TaskOS.LINUX  # everything else is the sandbox's
