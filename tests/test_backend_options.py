"""Backend options are checked in one place, against what the installed Harbor accepts, before any sandbox starts.

Runs on the lock's Harbor and, through ``.ci/range``, on the lowest and highest
releases the ranges allow (Harbor 0.25 reads options off constructor
signatures; 0.26 has a pydantic schema per environment and refuses unknown keys).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harbor.environments.base import BaseEnvironment
from harbor.environments.docker.docker import DockerEnvironment
from harbor.models.trial.paths import TrialPaths

from harbor_async.backends import resolve_backend
from harbor_async.engine import Engine
from harbor_async.errors import BackendOptionsError
from tests.cli_helpers import harbor_async

pytestmark = pytest.mark.range

#: Whether the installed Harbor validates docker's options with a schema (0.26 on).
DOCKER_SCHEMA = getattr(DockerEnvironment, "options_model", None) is not None


def test_local_refuses_a_misspelled_option_and_names_the_right_one():
    spec = resolve_backend("local")
    with pytest.raises(BackendOptionsError) as caught:
        spec.check_options({"memroy_mb": 64, "sandbox_root": "/tmp/x"})
    error = caught.value
    assert error.backend == "local" and error.unknown == ["memroy_mb"]
    assert error.suggestions == {"memroy_mb": "memory_mb"}
    own = ["cpus", "memory_mb", "output_limit", "pids_limit", "run_label", "sandbox_root", "storage_mb"]
    assert error.valid[: len(own)] == own  # the backend's own options first, then Harbor's common ones
    assert "did you mean 'memory_mb'?" in str(error) and "\n" not in str(error)
    spec.check_options({"memory_mb": 64, "sandbox_root": "/tmp/x", "pids_limit": 50})  # the real names pass


def test_docker_refuses_an_unknown_option_on_the_installed_harbor():
    spec = resolve_backend("docker")
    assert spec.options().source == ("schema" if DOCKER_SCHEMA else "signature")
    with pytest.raises(BackendOptionsError) as caught:
        spec.check_options({"memory_mb": 64})
    assert caught.value.unknown == ["memory_mb"] and "keep_containers" in caught.value.valid
    spec.check_options({"keep_containers": True})


def test_a_value_harbor_schema_refuses_is_refused_with_harbor_reason():
    spec = resolve_backend("docker")
    if DOCKER_SCHEMA:
        with pytest.raises(BackendOptionsError) as caught:
            spec.check_options({"keep_containers": "maybe"})
        assert caught.value.unknown == [] and "keep_containers" in caught.value.detail
    else:  # Harbor 0.25 declares no types: the name is all there is to check
        spec.check_options({"keep_containers": "maybe"})


class _ThirdParty(BaseEnvironment):
    """An import-path backend of someone else's, declaring no options schema."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def test_a_third_party_class_without_schema_goes_unchecked():
    spec = resolve_backend(f"{__name__}:_ThirdParty")
    assert spec.options().source == "unchecked" and not spec.options().checked
    spec.check_options({"anything": 1})  # nothing to check against
    assert spec.options().engine_options("ha1x", {"anything": 1}) == {"anything": 1}


@pytest.mark.parametrize(("backend", "gets_label"), [("local", True), ("simulated", True), ("docker", False), ("docker-fast", False)])
def test_the_run_label_goes_only_to_backends_that_take_it(backend: str, gets_label: bool):
    options = resolve_backend(backend).options()
    assert options.engine_options("ha1x000000", {"keep": 1}) == (
        {"run_label": "ha1x000000", "keep": 1} if gets_label else {"keep": 1}
    )


@pytest.mark.parametrize("backend", ["docker", "docker-fast", "local", "simulated"])
def test_each_backend_environment_is_built_as_a_start_builds_it(backend: str, example_tasks, tmp_path: Path):
    paths = TrialPaths(trial_dir=tmp_path)
    paths.mkdir()
    spec = resolve_backend(backend)
    environment = spec.create_environment(
        example_tasks[0], paths, session_id="ha1x000000-0123456789", run_label="ha1x000000",
        backend_kwargs={}, options={"docker_overlay": True},
    )  # fmt: skip
    assert isinstance(environment, spec.environment_class())
    assert environment.session_id == "ha1x000000-0123456789"
    if backend == "local":
        assert environment.run_label == "ha1x000000"


@pytest.mark.anyio
async def test_the_engine_refuses_before_any_sandbox_starts(example_tasks, anyio_backend):
    async with Engine(backend_kwargs={"memroy_mb": 64}) as engine:
        with pytest.raises(BackendOptionsError):
            engine.launch(example_tasks[0], "local")
        assert engine.live_sandboxes() == [] and engine.stats().launched == 0


def test_run_refuses_a_misspelled_local_option_in_one_line(tmp_path: Path):
    done = harbor_async("run", "-e", "local", "--ek", "memroy_mb=64", "-o", str(tmp_path / "jobs"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no option 'memroy_mb' (did you mean 'memory_mb'?)" in lines[0], done.stderr
    assert not (tmp_path / "jobs").exists()  # no job folder, no sandbox


def test_run_refuses_an_unknown_docker_option_in_one_line(tmp_path: Path):
    done = harbor_async("run", "-e", "docker", "--ek", "no_such_key=1", "-o", str(tmp_path / "jobs"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend 'docker' has no option 'no_such_key'" in lines[0], done.stderr
    assert not (tmp_path / "jobs").exists()


def test_eval_refuses_before_reaching_the_model_server(tmp_path: Path):
    # Port 9 (discard) answers nothing: the refusal comes before any request.
    done = harbor_async(
        "eval", "-m", "m", "--base-url", "http://127.0.0.1:9/v1", "-e", "local", "--ek", "memroy_mb=1",
        "-o", str(tmp_path / "jobs"),
    )  # fmt: skip
    assert done.returncode == 2
    assert "did you mean 'memory_mb'?" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "jobs").exists()


def test_the_shim_refuses_at_construction():
    from shim import HarborEnv, HarborSpec
    from harbor_async.suites import example_suite_path

    with pytest.raises(BackendOptionsError, match="memory_mb"):
        HarborEnv(environment_type="local", backend_kwargs={"memroy_mb": 64})
    with pytest.raises(BackendOptionsError, match="memory_mb"):
        HarborSpec(example_suite_path(), environment_type="local", backend_kwargs={"memroy_mb": 64}, preflight=False)
