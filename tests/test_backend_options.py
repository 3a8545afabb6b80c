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
from pydantic import BaseModel, ConfigDict, model_validator

from harbor_async.backends import resolve_backend
from harbor_async.backends.options import _reads_kwargs
from harbor_async.core.errors import BackendOptionsError
from harbor_async.engine.engine import Engine
from tests.cli_helpers import harbor_async

#: Whether the installed Harbor validates docker's options with a schema (0.26 on).
DOCKER_SCHEMA = getattr(DockerEnvironment, "options_model", None) is not None


def test_local_refuses_a_misspelled_option_and_names_the_right_one():
    spec = resolve_backend("local")
    with pytest.raises(BackendOptionsError) as caught:
        spec.check_options({"memroy_mb": 64, "sandbox_root": "/tmp/x"})
    error = caught.value
    assert error.backend == "local" and error.unknown == ["memroy_mb"]
    assert error.suggestions == {"memroy_mb": "memory_mb"}
    own = [
        "allow_offline", "cpus", "memory_mb", "output_limit", "pids_limit", "require_limits", "run_label",
        "sandbox_root", "storage_mb", "transfer_limit_mb",
    ]  # fmt: skip
    assert error.valid[: len(own)] == own  # the backend's own options first, then Harbor's common ones
    assert "did you mean 'memory_mb'?" in str(error) and "\n" not in str(error)
    spec.check_options({"memory_mb": 64, "sandbox_root": "/tmp/x", "pids_limit": 50})  # the real names pass


@pytest.mark.range
def test_docker_refuses_an_unknown_option_on_the_installed_harbor():
    spec = resolve_backend("docker")
    assert spec.options().source == ("schema" if DOCKER_SCHEMA else "signature")
    with pytest.raises(BackendOptionsError) as caught:
        spec.check_options({"memory_mb": 64})
    assert caught.value.unknown == ["memory_mb"] and "keep_containers" in caught.value.valid
    spec.check_options({"keep_containers": True})


@pytest.mark.range
def test_docker_takes_this_projects_own_options_beside_harbors_schema():
    """The confined docker class's own keywords are accepted on every Harbor (0.26's schema does not list them)."""
    spec = resolve_backend("docker")
    spec.check_options({"transfer_limit_mb": 5, "output_limit": 1000, "fast_start": False, "keep_containers": True})
    assert {"transfer_limit_mb", "output_limit", "fast_start", "keep_containers"} <= spec.options().names
    with pytest.raises(BackendOptionsError) as caught:
        spec.check_options({"fast_startt": False})
    assert caught.value.unknown == ["fast_startt"] and "fast_start" in str(caught.value)


@pytest.mark.range
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


@pytest.mark.range
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


@pytest.mark.slow
def test_run_refuses_a_misspelled_local_option_in_one_line(tmp_path: Path):
    done = harbor_async("run", "-e", "local", "--ek", "memroy_mb=64", "-o", str(tmp_path / "jobs"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no option 'memroy_mb' (did you mean 'memory_mb'?)" in lines[0], done.stderr
    assert not (tmp_path / "jobs").exists()  # no job folder, no sandbox


@pytest.mark.slow
def test_run_refuses_an_unknown_docker_option_in_one_line(tmp_path: Path):
    done = harbor_async("run", "-e", "docker", "--ek", "no_such_key=1", "-o", str(tmp_path / "jobs"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend 'docker' has no option 'no_such_key'" in lines[0], done.stderr
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_eval_refuses_before_reaching_the_model_server(tmp_path: Path):
    # Port 9 (discard) answers nothing: the refusal comes before any request.
    done = harbor_async(
        "eval", "-m", "m", "--base-url", "http://127.0.0.1:9/v1", "-e", "local", "--ek", "memroy_mb=1",
        "-o", str(tmp_path / "jobs"),
    )  # fmt: skip
    assert done.returncode == 2
    assert "did you mean 'memory_mb'?" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "jobs").exists()


def test_the_evaluate_api_refuses_before_any_server_or_job_folder(tmp_path: Path):
    import anyio

    from harbor_async.evaluation import evaluate

    async def main():
        await evaluate(
            "m", None, base_url="http://127.0.0.1:9/v1", environment_type="local", environment_kwargs={"memroy_mb": 1},
            jobs_dir=tmp_path / "jobs",
        )  # fmt: skip

    with pytest.raises(BackendOptionsError, match="memory_mb"):
        anyio.run(main)
    assert not (tmp_path / "jobs").exists()


def test_the_shim_refuses_at_construction():
    from harbor_async.suites import example_suite_path
    from shim import HarborEnv, HarborSpec

    with pytest.raises(BackendOptionsError, match="memory_mb"):
        HarborEnv(environment_type="local", environment_kwargs={"memroy_mb": 64})
    with pytest.raises(BackendOptionsError, match="memory_mb"):
        HarborSpec(example_suite_path(), environment_type="local", environment_kwargs={"memroy_mb": 64}, preflight=False)


@pytest.mark.range
def test_a_harbor_class_that_reads_its_own_kwargs_is_not_refused_what_it_reads():
    # Harbor 0.25's GKE backend takes options out of **kwargs by name (no signature lists
    # them); 0.26 declares a schema. Either way nothing it takes is refused.
    spec = resolve_backend("gke")
    options = spec.options()
    if getattr(spec.environment_class(), "options_model", None) is None:
        assert options.source == "unchecked"
        spec.check_options({"dind_image": "docker:dind"})  # read from kwargs in 0.25's body
    else:
        assert options.source == "schema"
    assert _reads_kwargs(spec.environment_class()) == (options.source == "unchecked")
    assert not _reads_kwargs(resolve_backend("docker").environment_class())
    assert not _reads_kwargs(resolve_backend("local").environment_class())


class _OldNameOptions(BaseModel):
    """A schema in Harbor 0.26's manner: extra keys forbidden, an old name mapped before validation."""

    model_config = ConfigDict(extra="forbid")
    timeout_sec: int = 60

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data):
        if isinstance(data, dict) and "sandbox_timeout_secs" in data:
            data = dict(data)
            data["timeout_sec"] = data.pop("sandbox_timeout_secs")
        return data


class _SchemaBackend(BaseEnvironment):
    """Beside the real docker schema (on 0.26): one the lock's Harbor can run too."""

    options_model = _OldNameOptions


@pytest.mark.range
def test_a_schema_decides_names_as_harbor_validation_does():
    options = resolve_backend(f"{__name__}:_SchemaBackend").options()
    assert options.source == "schema" and options.names == {"timeout_sec"}
    options.check({"timeout_sec": 5})
    options.check({"sandbox_timeout_secs": 5})  # an old name the schema maps: accepted, as Harbor accepts it
    with pytest.raises(BackendOptionsError) as caught:
        options.check({"timeout_secc": 5})
    assert caught.value.unknown == ["timeout_secc"] and caught.value.suggestions == {"timeout_secc": "timeout_sec"}
    with pytest.raises(BackendOptionsError) as caught:
        options.check({"timeout_sec": "soon"})
    assert caught.value.unknown == [] and caught.value.detail.startswith("timeout_sec:")
    assert options.engine_options("ha1x", {"timeout_sec": 5}) == {"timeout_sec": 5}  # no run_label: it would be refused
