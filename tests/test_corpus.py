"""The compatibility corpus (``tests/corpus/``): each task under ``harbor-async run`` and Harbor's ``harbor run``.

Same tasks, same backend, the oracle: the rewards of every task and of every
step agree. Where harbor-async deliberately differs, the difference itself is
asserted (see ``docs/backends.md``, "Harbor's task model").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harbor_async.tasks.suite import load_task
from tests.cli_helpers import harbor_async, records
from tests.test_task_model import harbor_cli, harbor_cli_rewards

# On every version the ranges allow for local; docker's (Harbor's 10 s stops) in the main suite only: CI's time.
pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parent / "corpus"
STEPS = ["steps-mean", "steps-min-reward", "steps-final", "steps-mean-half"]
COMMON = [*STEPS, "separate-verifier", "env-and-workdir", "healthcheck"]
#: What each backend runs of the corpus under both CLIs (the rest it refuses up front: test_task_model.py).
ON = {
    "local": [*COMMON, "heredoc", "no-network"],
    "docker": [*COMMON, "separate-tests-image", "agent-user", "compose"],
}


def suite_of(names: list[str], root: Path) -> Path:
    for name in names:
        shutil.copytree(CORPUS / name, root / name)
    return root


def ours(suite: Path, tmp_path: Path, backend: str) -> dict[str, tuple[float | None, list]]:
    where = ["-e", backend] + (["--ek", f"sandbox_root={tmp_path / 'sb'}"] if backend == "local" else [])
    done = harbor_async("run", "-p", str(suite), *where, "-a", "oracle", "-n", "10", "-o", str(tmp_path / "jobs"), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    found = records(next((tmp_path / "jobs").iterdir()))
    return {r["task"]: (r["reward"], [(s["name"], s["reward"]) for s in r["steps"]]) for r in found}


@pytest.mark.parametrize("backend", [pytest.param("local", marks=pytest.mark.range), pytest.param("docker", marks=pytest.mark.docker)])
def test_the_corpus_scores_as_harbor_scores_it(tmp_path: Path, backend: str, request) -> None:
    if backend == "docker":
        request.getfixturevalue("docker_daemon")
    suite = suite_of(ON[backend], tmp_path / "suite")
    mine = ours(suite, tmp_path, backend)
    theirs = harbor_cli_rewards(suite, tmp_path, backend)
    assert mine == theirs
    assert set(mine) == set(ON[backend])
    # the corpus means something: a task the oracle solves, one it fails, and steps the gate skipped
    assert mine["steps-mean"][0] == 1.0 and mine["steps-mean-half"][0] == 0.5
    assert [name for name, _ in mine["steps-min-reward"][1]] == ["write"]


@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_an_offline_task_on_docker_runs_here_where_harbor_needs_its_egress_sidecar(tmp_path: Path) -> None:
    """A deliberate difference: Harbor's docker enforces ``no-network`` only with its egress sidecar (images from
    Docker Hub); harbor-async enforces a task offline in every phase with Compose's ``network_mode: none``."""
    from harbor.environments.docker.docker import DockerEnvironment

    suite = suite_of(["no-network"], tmp_path / "suite")
    assert ours(suite, tmp_path, "docker") == {"no-network": (1.0, [])}
    if not DockerEnvironment._egress_control_kernel_support():  # Harbor refuses the whole job
        done = harbor_cli(suite, tmp_path, "docker")
        assert done.returncode != 0 and "network_mode='no-network' is not supported" in " ".join((done.stdout + done.stderr).split())
    assert load_task(suite / "no-network").config.environment.network_mode.value == "no-network"
