"""The error policy (retry and blame by type), docker's typed errors, output truncation, latency specs, percentiles."""

from __future__ import annotations

import ast
import inspect

import pytest
from harbor.environments.base import SandboxBuildFailedError

from harbor_async.agents.tool_loop import ModelServerError
from harbor_async.backends import resolve_backend
from harbor_async.backends.docker.errors import (
    DockerBuildError,
    DockerfileError,
    DockerImageError,
    DockerRefusedError,
    DockerStartError,
)
from harbor_async.backends.simulated import Latency, SimulatedTransientError
from harbor_async.core import policy
from harbor_async.core.errors import (
    BackendError,
    EpisodeDeadlineError,
    ExecError,
    FailureClass,
    Phase,
    SandboxCancelledError,
    SandboxTimeout,
    StartError,
    VerifierFailure,
)
from harbor_async.core.policy import failure_class, is_transient, rule_for
from harbor_async.core.results import scalar_reward, truncate_output
from harbor_async.core.stats import percentile


@pytest.mark.parametrize(
    "exc, transient",
    [
        (SimulatedTransientError("503"), True),
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError(), True),
        (RuntimeError("docker daemon hiccup"), True),
        (RuntimeError("invalid sandbox: not found"), True),  # words decide nothing: the type does
        (SandboxBuildFailedError("empty Dockerfile"), False),
        (FileNotFoundError("environment/Dockerfile"), False),
        (OSError(28, "No space left on device"), False),
        (DockerImageError("x"), False),
        (DockerBuildError("x"), False),
        (DockerStartError("x"), True),
        (DockerRefusedError("x"), False),
        (type("QuotaError", (Exception,), {"transient": False})("over quota"), False),  # typed by its backend
        (StartError(Phase.START, "t", "s"), False),
    ],
)
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


@pytest.mark.parametrize(
    "exc, failure, graded",
    [
        (VerifierFailure(Phase.VERIFY, "t", "s"), FailureClass.VERIFIER, True),
        (SandboxTimeout(Phase.AGENT, "t", "s"), FailureClass.AGENT, True),
        (EpisodeDeadlineError(Phase.EXEC, "t", "s"), FailureClass.AGENT, True),
        (EpisodeDeadlineError(Phase.START, "t", "s"), FailureClass.INFRASTRUCTURE, False),
        (ExecError(Phase.EXEC, "t", "s"), FailureClass.INFRASTRUCTURE, False),
        (SandboxCancelledError(Phase.START, "t", "s"), FailureClass.CANCELLED, False),
        (ModelServerError("502"), FailureClass.MODEL_SERVER, False),
        (KeyboardInterrupt(), FailureClass.CANCELLED, False),
        (RuntimeError("boom"), FailureClass.INFRASTRUCTURE, False),
    ],
)
def test_the_table_blames_by_type_and_phase(exc, failure, graded):
    assert failure_class(exc) is failure and rule_for(exc).graded is graded


def _compose_failure(command: str, stderr: str) -> RuntimeError:
    # Harbor's own text (environments/docker/docker.py, _run_docker_compose_command).
    return RuntimeError(
        f"Docker compose command failed for environment e. Command: docker compose -p x {command}. "
        f"Return code: 1. Stdout: . Stderr: {stderr}. "
    )


@pytest.mark.parametrize(
    "backend", ["docker", "docker-fast"],
)
def test_docker_types_its_untyped_start_errors(backend):
    spec = resolve_backend(backend)
    build = spec.typed_error(_compose_failure("build", "failed to solve: process did not complete"))
    assert type(build) is DockerBuildError and not is_transient(build) and isinstance(build.__cause__, RuntimeError)
    assert failure_class(build) is FailureClass.INFRASTRUCTURE
    for said in ("dockerfile parse error line 2: unknown instruction: BOGUS", 'failed to compute cache key: "/x.txt": not found'):
        wrong = spec.typed_error(_compose_failure("build", said))  # the Dockerfile's fault: an invalid task
        assert type(wrong) is DockerfileError and not is_transient(wrong) and failure_class(wrong) is FailureClass.INVALID_TASK
    missing = spec.typed_error(_compose_failure("up -d", "Error response from daemon: pull access denied for nope"))
    assert type(missing) is DockerImageError and not is_transient(missing)
    refused = spec.typed_error(_compose_failure("up -d", "unauthorized: authentication required"))
    assert type(refused) is DockerRefusedError and not is_transient(refused)
    hiccup = spec.typed_error(_compose_failure("up -d", "Error response from daemon: i/o timeout"))
    assert type(hiccup) is DockerStartError and is_transient(hiccup)
    other = RuntimeError("something else")
    assert spec.typed_error(other) is other
    assert resolve_backend("local").typed_error(_compose_failure("build", "x")).__class__ is RuntimeError


def test_the_policy_decides_by_type_never_by_message():
    tree = ast.parse(inspect.getsource(policy))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in node.names} | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "re" not in imported and "fnmatch" not in imported
    # no error is turned into text: no str(...), repr(...), .args or .message anywhere in the module
    calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not calls & {"str", "repr", "format"}
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not attributes & {"args", "message", "search", "match", "fullmatch", "findall", "lower", "casefold"}


def test_truncation_keeps_the_limit_and_adds_the_marker():
    assert truncate_output("abcdef", 10) == ("abcdef", False)
    assert truncate_output("abcdefghijkl", 4, "[cut]") == ("abcd[cut]", True)
    assert truncate_output("x" * 100, None) == ("x" * 100, False)


def test_scalar_reward_prefers_the_reward_key():
    assert scalar_reward({"format": 0.5, "reward": 1}) == 1.0
    assert scalar_reward({"accuracy": 0.25, "format": 1}) == 0.25
    assert scalar_reward({}) == 0.0


def test_latency_specs():
    import random

    rng = random.Random(1)
    assert Latency.parse(0.5).sample(rng) == 0.5
    assert 0.1 <= Latency.parse("uniform:0.1:0.3").sample(rng) <= 0.3
    assert Latency.parse("lognormal:0.5:0.0").sample(rng) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="uniform:LOW:HIGH"):
        Latency.parse("gamma:1")
    with pytest.raises(ValueError, match="non-negative"):
        Latency.parse("uniform:1")


def test_percentiles():
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 95) == 3.0


def test_backend_names():
    assert resolve_backend("docker").type == "docker"
    assert resolve_backend("local").import_path == "harbor_async.backends.local:LocalEnvironment"
    assert resolve_backend("pkg.mod:Env").import_path == "pkg.mod:Env"
    with pytest.raises(BackendError, match="unknown backend"):
        resolve_backend("nope")
    with pytest.raises(BackendError, match="not a Harbor BaseEnvironment"):
        resolve_backend("pathlib:Path").environment_class()


def test_logs_follow_the_current_stderr(capsys):

    from harbor_async.core.logs import configure_logging, get_logger

    configure_logging("info", "json", force=True)
    try:
        get_logger().info("phase", phase="exec", seconds=0.1)
        first = capsys.readouterr().err
        get_logger().warning("phase", phase="stop", outcome="timeout")
        second = capsys.readouterr().err
    finally:
        configure_logging(force=True)
    assert '"phase": "exec"' in first and '"level": "info"' in first
    assert '"outcome": "timeout"' in second
