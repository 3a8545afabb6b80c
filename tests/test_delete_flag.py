"""``--delete/--no-delete`` as Harbor spells it (issue 46): the images a run's docker sandboxes kept.

Harbor's ``--delete`` (its default) removes a trial's built image at its stop;
``--no-delete`` keeps it. Here every container and volume goes at each stop
either way, and the docker fast start keeps each task's image (``hb__<id>``)
for the run's other sandboxes and later runs: ``--delete`` removes those at the
run's end, ``--no-delete`` (our default) keeps them.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import ClassVar

import pytest

from harbor_async.backends.simulated import SimulatedEnvironment
from harbor_async.engine.engine import Engine
from harbor_async.jobs.settings import JobSettings
from tests.cli_helpers import harbor_async, make_suite, records


@pytest.mark.slow
def test_delete_is_a_setting_that_reaches_the_engine_and_harbors_config() -> None:
    assert JobSettings(delete=True).engine_kwargs()["delete"] is True and JobSettings().engine_kwargs()["delete"] is False
    kept = json.loads(harbor_async("run", "-e", "simulated", "--print-config").stdout)
    assert kept["environment"]["delete"] is False  # ours keeps the images; Harbor's default (true) is left out below
    deleted = json.loads(harbor_async("run", "-e", "simulated", "--delete", "--print-config").stdout)
    assert "delete" not in deleted.get("environment", {})
    assert JobSettings().resumed({"delete": True}).delete is True  # a resume may ask for it (the results don't change)


def test_a_job_configs_environment_delete_is_the_flag_and_harbors_default_comes_with_it() -> None:
    from harbor.models.job.config import JobConfig

    from harbor_async.jobs.harbor_config import run_options

    def delete(config: dict) -> bool:
        return run_options(JobConfig.model_validate({"datasets": [{"path": "tasks"}], **config}))["delete"]

    assert delete({"environment": {"delete": False}}) is False
    assert delete({"environment": {"delete": True}}) is True
    assert delete({}) is True  # a file is run as Harbor runs it: Harbor deletes by default


class KeepingEnvironment(SimulatedEnvironment):
    """A simulated sandbox whose stop keeps a build named after its task, as the docker fast start keeps its image."""

    deleted: ClassVar[list[list[str]]] = []

    @property
    def kept_build(self) -> str:
        return f"build-of-{self.environment_name}"

    @classmethod
    def delete_kept_builds(cls, builds: list[str]) -> list[str]:
        cls.deleted.append(builds)
        return []


@pytest.mark.anyio
@pytest.mark.parametrize("delete", [True, False])
async def test_the_engine_deletes_what_its_sandboxes_kept_once_at_its_close_and_only_when_asked(example_tasks, delete) -> None:
    KeepingEnvironment.deleted.clear()
    backend = f"{__name__}:KeepingEnvironment"
    async with Engine(delete=delete) as engine:
        for task in [example_tasks[0], example_tasks[0], example_tasks[1]]:
            async with engine.sandbox(task, backend):
                pass
        assert KeepingEnvironment.deleted == []  # not at a stop: the run's other sandboxes start from it
    expected = [sorted(f"build-of-{t.short_name}" for t in example_tasks[:2])]
    assert KeepingEnvironment.deleted == (expected if delete else [])


def _task_image(task: Path) -> str:
    """The fast start's content-addressed image of a task (Harbor's ``hb__<environment id>``)."""
    from harbor.environments.definition import environment_content_hash
    from harbor.environments.docker.docker import _sanitize_docker_image_name

    return _sanitize_docker_image_name(f"hb__{environment_content_hash(task / 'environment')}")


def _image_exists(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_delete_removes_the_runs_task_image_at_its_end_and_no_delete_keeps_it(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "suite", ["t1"])
    task = suite / "tasks" / "t1"
    with (task / "environment" / "Dockerfile").open("a") as dockerfile:
        dockerfile.write(f"\n# {uuid.uuid4()}\n")  # an image of this test's own: no other run shares it
    image = _task_image(task)
    jobs = tmp_path / "jobs"

    def run(name: str, *flags: str) -> None:
        done = harbor_async("run", "-p", str(suite), "-e", "docker", "-k", "2", "-o", str(jobs), "--job-name", name, *flags, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["reward"] for r in records(jobs / name)] == [1.0, 1.0]

    try:
        run("default")
        assert _image_exists(image)  # kept for the next run (our default)
        run("deleted", "--delete")  # reuses the kept image, then removes it at the end
        assert not _image_exists(image)
        assert json.loads((jobs / "deleted" / "harbor-async.json").read_text())["delete"] is True
        run("kept", "--no-delete")
        assert _image_exists(image)
        leftovers = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"ancestor={image}"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert leftovers == []  # containers never kept, whichever flag
    finally:
        subprocess.run(["docker", "rmi", "-f", image], capture_output=True)
