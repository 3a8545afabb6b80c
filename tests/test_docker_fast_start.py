"""Cheaper docker starts (harbor_async/backends/docker/fast_start.py) on a real Docker daemon.

Three sandboxes of one task in one run: the image is built by the first start
only, no start runs the pointless ``compose down``, commands run inside the
containers through ``docker exec`` with Harbor's semantics, the engine's overlay still applies, every Compose
call is in the per-call profile, and nothing is left behind.
"""

from __future__ import annotations

import subprocess

import anyio
import pytest

from harbor_async.backends.docker.fast_start import (
    PROFILES,
    FastStartDockerEnvironment,
    summarize_profiles,
)
from harbor_async.engine.engine import Engine
from tests.test_docker import OUR_PREFIX, docker_leftovers

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.usefixtures("docker_daemon")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Harbor's docker backend runs on asyncio only


@pytest.mark.range
@pytest.mark.anyio
async def test_one_build_per_image_and_no_down_before_up(example_tasks, tmp_path):
    task = next(t for t in example_tasks if t.name.endswith("env-inventory-lookup"))
    FastStartDockerEnvironment.forget_images()
    PROFILES.clear()
    outputs: dict[int, str] = {}
    sandboxes = []
    async with Engine() as engine:

        async def one(index: int) -> None:
            async with engine.sandbox(task, "docker-fast") as sandbox:
                sandboxes.append(sandbox.environment)
                outputs[index] = (await sandbox.exec("cat /proc/1/comm; pwd")).stdout
                # Harbor's exec semantics through docker exec: cwd, env, user, merged stderr, exit code
                result = await sandbox.exec("echo out; echo err >&2; echo $INVENTORY_FILE; id -un; exit 3")
                lines = sorted(result.output.splitlines())  # the two streams interleave freely, as with Compose
                assert (lines, result.exit_code) == (["/workdir/data/inventory.csv", "err", "out", "root"], 3)
                # Harbor's uploads (compose cp to main) as docker cp on the container: same copy
                (tmp_path / f"up-{index}").mkdir()
                (tmp_path / f"up-{index}" / "note.txt").write_text(f"sandbox {index}\n")
                await sandbox.upload(tmp_path / f"up-{index}", "/tmp/uploaded")
                assert (await sandbox.exec("cat /tmp/uploaded/note.txt")).stdout == f"sandbox {index}\n"

        await one(0)  # the first start builds (or finds) the image
        async with anyio.create_task_group() as tg:  # then two at once, both from the cache
            tg.start_soon(one, 1)
            tg.start_soon(one, 2)

    assert outputs == {i: "docker-init\n/workdir\n" for i in range(3)}  # the overlay's init; the task's WORKDIR
    profiles = [environment.call_profile for environment in sandboxes]
    for profile in profiles:
        calls = [(t.call, t.skipped) for t in profile if t.phase == "start"]
        assert ("compose down", True) in calls and ("compose down", False) not in calls
        assert ("compose up", False) in calls
        assert calls[-1] == ("start (total)", False)
        stop_calls = [(t.call, t.skipped) for t in profile if t.phase == "run"]
        # stop() still takes the project down: by its label (no Compose process), and nothing is left (below)
        assert ("docker rm (down)", False) in stop_calls and ("compose down", False) not in stop_calls
        assert ("docker cp", False) in stop_calls and ("compose cp", False) not in stop_calls
        # commands in the main container go through docker exec, not a Compose process each
        assert ("docker exec", False) in stop_calls and ("compose exec", False) not in stop_calls
    first, *later = profiles
    # built by the first start, or found on the daemon under its content-addressed tag (an earlier run's build)
    assert [t.skipped for t in first if t.call == "compose build"] in ([False], [True])
    for profile in later:
        assert [t.skipped for t in profile if t.call == "compose build"] == [True]
        assert [t.skipped for t in profile if t.call.startswith("docker inspect")] == [True]
    # One named image for the task, kept in the daemon's cache; no per-project image left behind.
    (image,) = {environment._main_image_name for environment in sandboxes}
    assert image.startswith("hb__")
    inspect = await anyio.run_process(["docker", "image", "inspect", image], check=False)
    assert inspect.returncode == 0
    summary = summarize_profiles(PROFILES)
    assert summary["start: compose build"]["count"] == 3 and summary["start: compose build"]["skipped"] >= 2
    assert summary["start: compose up"]["mean_seconds"] > 0.0
    assert docker_leftovers(OUR_PREFIX) == {}


@pytest.mark.range
@pytest.mark.anyio
async def test_plain_docker_is_the_fast_start_and_harbors_start_is_one_option_away(example_tasks, tmp_path):
    """``-e docker`` takes the fast start by default (``docker-fast`` is its older name); ``--ek fast_start=false``,
    and any task with its own docker-compose.yaml, get Harbor's start call for call (a build every start)."""
    import shutil

    from harbor_async.backends import resolve_backend
    from harbor_async.tasks.suite import load_task

    assert resolve_backend("docker").environment_class() is FastStartDockerEnvironment
    assert resolve_backend("docker-fast").environment_class() is FastStartDockerEnvironment
    task = next(t for t in example_tasks if t.name.endswith("csv-column-sum"))
    compose = tmp_path / "compose-task"
    shutil.copytree(task.paths.task_dir, compose)
    (compose / "environment" / "docker-compose.yaml").write_text("services:\n  main:\n    init: true\n")
    FastStartDockerEnvironment.forget_images()
    builds: dict[str, list[bool]] = {}
    async with Engine() as engine:
        for label, one, kwargs in (
            ("fast", task, {}), ("fast", task, {}),
            ("harbor", task, {"fast_start": False}), ("harbor", task, {"fast_start": False}),
            ("compose", load_task(compose), {}),
        ):  # fmt: skip
            async with engine.sandbox(one, "docker", backend_kwargs=kwargs) as sandbox:
                environment = sandbox.environment
                assert environment.fast_start is (label == "fast")
                assert (await sandbox.exec("echo ok")).output.strip() == "ok"
            builds.setdefault(label, []).extend(t.skipped for t in environment.call_profile if t.call == "compose build")
    assert builds["fast"][1:] == [True]  # built once (or found built), then reused
    assert builds["harbor"] == [] and builds["compose"] == []  # Harbor's start: its own calls, none skipped or profiled
    assert docker_leftovers(OUR_PREFIX) == {}


@pytest.mark.anyio
async def test_an_image_already_on_the_daemon_is_not_built_again(example_tasks, tmp_path):
    """The tag hashes the environment folder: a new folder is built (once); a new process finds it and skips the build;
    with force_build (run's --force-build) it is built again."""
    import shutil
    import uuid

    from harbor_async.tasks.suite import load_task

    task = next(t for t in example_tasks if t.name.endswith("csv-column-sum"))
    copy = tmp_path / "fresh-task"
    shutil.copytree(task.paths.task_dir, copy)
    with (copy / "environment" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"\n# {uuid.uuid4()}\n")  # a folder no image was built from
    fresh = load_task(copy)
    builds: list[list[tuple[str, bool]]] = []
    image = None
    try:
        for force_build in (False, False, True):  # the third: --force-build builds what is there
            FastStartDockerEnvironment.forget_images()  # as a new process would
            async with Engine(force_build=force_build) as engine, engine.sandbox(fresh, "docker") as sandbox:
                environment = sandbox.environment
                image = environment._main_image_name
                assert (await sandbox.exec("echo ok")).output.strip() == "ok"
            calls = environment.call_profile
            builds.append([(t.call, t.skipped) for t in calls if t.call.startswith(("compose build", "docker image"))])
    finally:
        if image is not None:
            await anyio.run_process(["docker", "rmi", "-f", image], check=False)
    assert builds[0] == [("docker image inspect (built?)", False), ("compose build", False)]
    assert builds[1] == [("docker image inspect (built?)", False), ("compose build", True)]
    assert builds[2] == [("compose build", False)]  # forced: not even asked whether it is there
    assert docker_leftovers(OUR_PREFIX) == {}


def test_sandboxes_prune_removes_the_task_images_runs_kept(example_tasks, tmp_path):
    """The fast start keeps each task's image (``hb__*``) for the run and later ones; ``sandboxes prune`` removes them."""
    import shutil
    import uuid

    from harbor_async.backends.docker.cleanup import task_images
    from harbor_async.tasks.suite import load_task
    from tests.cli_helpers import harbor_async

    # An environment folder of this test's own: its image is no other test's, whose sandbox may still be using it.
    copy = tmp_path / "own-image"
    shutil.copytree(next(t for t in example_tasks if t.name.endswith("csv-column-sum")).paths.task_dir, copy)
    with (copy / "environment" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"\n# {uuid.uuid4()}\n")
    task = load_task(copy)
    kept: list[str] = []

    async def one() -> None:
        async with Engine() as engine, engine.sandbox(task, "docker") as sandbox:
            await sandbox.exec("true")
            kept.append(sandbox._env.kept_build)  # this task's image, by its content-addressed name

    FastStartDockerEnvironment.forget_images()
    anyio.run(one)
    ours = kept[0] if ":" in kept[0] else f"{kept[0]}:latest"
    assert ours in task_images()
    pruned = harbor_async("sandboxes", "prune")
    assert pruned.returncode == 0, pruned.stderr
    # Every idle task image goes (a container still using one, another test's, keeps it): ours among them.
    assert f"removed {ours}" in pruned.stdout and ours not in task_images()
    # this process still believes it built the image: its next start finds it gone and builds it again
    anyio.run(one)
    assert ours in task_images()
    subprocess.run(["docker", "rmi", ours], capture_output=True)  # this test's own image: not left behind



@pytest.mark.anyio
async def test_the_daemons_os_is_asked_once_off_the_loop_and_still_checked(example_tasks, monkeypatch):
    """Harbor asks ``docker info`` synchronously at every start, on the loop (every other sandbox's command waited):
    here it is asked once per process, in a worker thread, and Harbor's OS check still uses the answer."""
    import threading

    from harbor.environments.docker.docker import DockerEnvironment

    from harbor_async.backends.docker import confined
    from harbor_async.core.errors import StartError
    from harbor_async.core.policy import RetryPolicy

    asked: list[int] = []
    harbors = DockerEnvironment._detect_daemon_os.__func__

    def recording(cls):
        asked.append(threading.get_ident())
        return harbors(cls)

    monkeypatch.setattr(DockerEnvironment, "_detect_daemon_os", classmethod(recording))
    monkeypatch.setattr(confined, "_DAEMON_OS", {})
    task = next(t for t in example_tasks if t.name.endswith("csv-column-sum"))
    async with Engine() as engine:
        loop_thread = threading.get_ident()

        async def one() -> None:
            async with engine.sandbox(task, "docker") as sandbox:
                assert (await sandbox.exec("echo ok")).output.strip() == "ok"

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one)
        await one()
    assert 1 <= len(asked) <= 3 and loop_thread not in asked  # three at once may each ask before the first answer
    assert list(confined._DAEMON_OS.values())[0][1] == "linux"

    # The cached answer is the one Harbor's check reads: a daemon said to run Windows containers refuses the task.
    (endpoint,) = confined._DAEMON_OS
    confined._DAEMON_OS[endpoint] = (0.0, "windows")
    async with Engine(retry=RetryPolicy(attempts=1)) as engine:
        with pytest.raises(StartError) as info:
            async with engine.sandbox(task, "docker"):
                pass
    assert "'windows' container mode" in str(info.value)
    assert docker_leftovers(OUR_PREFIX) == {}


@pytest.mark.anyio
async def test_up_waits_only_for_an_image_with_a_healthcheck(tmp_path):
    """Compose's ``up --wait`` polls on a half-second tick: it is dropped for an image with no HEALTHCHECK (the
    container runs when ``up`` returns) and kept for one with a HEALTHCHECK, whose start returns healthy only."""
    import json

    from harbor.models.task.task import Task

    from tests.test_local_escape import make_task

    healthy_after_two = (
        "FROM debian:bookworm-slim\nWORKDIR /app\n"  # the first check fails (and marks), the second passes
        "HEALTHCHECK --interval=1s --retries=5 CMD test -f /tmp/checked || { touch /tmp/checked; exit 1; }\n"
    )
    plain = Task(make_task(tmp_path / "suite", "plain-image"))
    checked_dir = make_task(tmp_path / "suite", "checked-image")
    (checked_dir / "environment" / "Dockerfile").write_text(healthy_after_two)
    checked = Task(checked_dir)
    FastStartDockerEnvironment.forget_images()
    seen: dict[str, tuple[list[tuple[str, bool]], str]] = {}
    images = []
    try:
        async with Engine() as engine:
            for task in (plain, checked):
                async with engine.sandbox(task, "docker") as sandbox:
                    environment = sandbox.environment
                    images.append(environment._main_image_name)
                    container = await environment._find_main_container()
                    state = await anyio.run_process(["docker", "inspect", "--format", "{{json .State}}", container])
                    health = (json.loads(state.stdout).get("Health") or {}).get("Status", "none")
                    calls = [(t.call, t.skipped) for t in environment.call_profile if t.call.startswith("compose up")]
                    seen[task.name] = (calls, health)
    finally:
        for image in images:
            await anyio.run_process(["docker", "rmi", "-f", image], check=False)
    assert seen["plain-image"] == ([("compose up --wait", True), ("compose up", False)], "none")
    assert seen["checked-image"] == ([("compose up", False)], "healthy")  # waited for it, as Harbor's start does
    assert docker_leftovers(OUR_PREFIX) == {}
