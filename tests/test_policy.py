"""Retry classification, output truncation, latency specs and percentiles."""

from __future__ import annotations

import pytest
from harbor.environments.base import SandboxBuildFailedError

from harbor_async.backends import resolve_backend
from harbor_async.backends.simulated import Latency, SimulatedTransientError
from harbor_async.errors import BackendError, Phase, StartError
from harbor_async.policy import is_transient
from harbor_async.results import scalar_reward, truncate_output
from harbor_async.stats import percentile


@pytest.mark.parametrize(
    "exc, transient",
    [
        (SimulatedTransientError("503"), True),
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError(), True),
        (RuntimeError("docker daemon hiccup"), True),
        (SandboxBuildFailedError("empty Dockerfile"), False),
        (FileNotFoundError("environment/Dockerfile"), False),
        (RuntimeError("Error: No such image: foo"), False),
        (RuntimeError("sandbox quota exceeded"), False),
        (StartError(Phase.START, "t", "s"), False),
    ],
)
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


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

    from harbor_async.logs import configure_logging, get_logger

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
