"""``${VAR}`` in task.toml reads only host variables the user allows; a secret never reaches a sandbox by default."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harbor_async.suites import example_suite_path
from harbor_async.tasks.host_variables import (
    TaskEnvError,
    missing_variables,
    with_allowed_env,
)
from harbor_async.tasks.suite import load_task
from tests.cli_helpers import harbor_async, records

pytestmark = pytest.mark.range

SECRET = "hunter2-very-secret"


def _task(root: Path, name: str, template: str) -> Path:
    task = root / "tasks" / name
    shutil.copytree(example_suite_path() / "tasks" / "count-log-files", task)
    toml = task / "task.toml"
    toml.write_text(toml.read_text() + f'\n[environment.env]\nLEAK = "{template}"\n')
    # The verifier scores what the sandbox saw: 1 when LEAK is the default, 0 when it is the secret.
    (task / "tests" / "test.sh").write_text(
        '#!/bin/sh\nmkdir -p /logs/verifier\necho "LEAK=$LEAK"\n'
        'if [ "$LEAK" = "fallback" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
    )
    return task


def test_only_allowed_variables_are_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HARBOR_TEST_SECRET", SECRET)
    with_default = load_task(_task(tmp_path, "d", "${HARBOR_TEST_SECRET:-fallback}"))
    assert with_allowed_env(with_default, ()).config.environment.env == {"LEAK": "fallback"}
    assert with_allowed_env(with_default, {"HARBOR_TEST_SECRET"}).config.environment.env == {"LEAK": SECRET}
    assert with_default.config.environment.env == {"LEAK": "${HARBOR_TEST_SECRET:-fallback}"}  # a copy was filled
    bare = load_task(_task(tmp_path, "b", "${HARBOR_TEST_SECRET}"))
    assert missing_variables(bare, ()) == ["[environment.env] LEAK = ${HARBOR_TEST_SECRET}"]
    with pytest.raises(TaskEnvError, match="HARBOR_TEST_SECRET"):
        with_allowed_env(bare, ())
    assert missing_variables(bare, {"HARBOR_TEST_SECRET"}) == []


@pytest.mark.slow
def test_run_refuses_a_task_needing_a_variable_not_allowed_and_keeps_secrets_out(tmp_path):
    env = {"HARBOR_TEST_SECRET": SECRET, "HARBOR_ASYNC_LOG_LEVEL": "info"}
    _task(tmp_path / "bare", "needs-secret", "${HARBOR_TEST_SECRET}")
    refused = harbor_async("run", "-p", str(tmp_path / "bare"), "-a", "none", "-o", str(tmp_path / "jobs"), env=env)
    assert refused.returncode == 2
    assert "needs-secret  [environment.env] LEAK  HARBOR_TEST_SECRET" in refused.stderr  # one row of the table
    assert not (tmp_path / "jobs").exists()  # refused before any job folder or sandbox
    _task(tmp_path / "defaulted", "defaulted", "${HARBOR_TEST_SECRET:-fallback}")
    kept = harbor_async(
        "run", "-p", str(tmp_path / "defaulted"), "-a", "none", "-o", str(tmp_path / "jobs"), "--job-name", "kept",
        env=env,
    )  # fmt: skip
    assert kept.returncode == 0, kept.stderr
    (record,) = records(tmp_path / "jobs" / "kept")
    assert record["reward"] == 1.0  # the sandbox saw the default, not the host's value
    job_text = "".join(p.read_text() for p in (tmp_path / "jobs" / "kept").rglob("*") if p.is_file())  # Harbor's trial folders too
    assert SECRET not in job_text + kept.stdout + kept.stderr
    allowed = harbor_async(
        "run", "-p", str(tmp_path / "defaulted"), "-a", "none", "-o", str(tmp_path / "jobs"), "--job-name", "allowed",
        "--env-allow", "HARBOR_TEST_SECRET", env=env,
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    (record,) = records(tmp_path / "jobs" / "allowed")
    assert record["reward"] == 0.0  # allowed on purpose: the sandbox saw the secret
    settings = json.loads((tmp_path / "jobs" / "allowed" / "harbor-async.json").read_text())
    assert settings["env_allow"] == ["HARBOR_TEST_SECRET"]


def test_the_shim_and_eval_refuse_it_up_front_too(tmp_path, monkeypatch):
    import shim
    from harbor_async.agents.task_checks import MissingVariablesError
    from harbor_async.evaluation import evaluate_sync

    monkeypatch.setenv("HARBOR_TEST_SECRET", SECRET)
    suite = tmp_path / "suite"
    _task(suite, "needs-secret", "${HARBOR_TEST_SECRET}")
    with pytest.raises(MissingVariablesError, match=r"needs-secret  \[environment.env\] LEAK  HARBOR_TEST_SECRET"):
        shim.HarborSpec(suite, environment_type="local", preflight=False)
    spec = shim.HarborSpec(suite, environment_type="local", preflight=False, env_allow=["HARBOR_TEST_SECRET"])
    assert len(spec.train_dataset) == 1
    spec.close()
    with pytest.raises(MissingVariablesError, match="HARBOR_TEST_SECRET"):
        evaluate_sync(["m"], str(suite), base_url="http://127.0.0.1:9/v1", jobs_dir=tmp_path / "jobs")
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("${NOT_SET_HERE:-${HARBOR_TEST_SECRET:-fallback}}", "fallback"),  # a nested default, filled by us
        ("x${HARBOR_TEST_SECRET:-fallback}y", "xfallbacky"),  # text around it
        ("${HARBOR_TEST_SECRET-fallback}", "fallback"),
        ("$$HARBOR_TEST_SECRET", "$HARBOR_TEST_SECRET"),  # Compose's escape: a literal $
        ("cost: $5 and $(date)", "cost: $5 and $(date)"),  # nothing to fill
        ("${NOT_SET_HERE:-${HARBOR_TEST_SECRET}}", None),  # the default names a variable not allowed: refused
        ("$HARBOR_TEST_SECRET", None),  # $NAME without braces, as Compose fills it
        ("x${HARBOR_TEST_SECRET}", None),
        ("${HARBOR_TEST_SECRET:?set it}", None),  # a form Harbor does not fill
        ("${NOT_SET_HERE:-$${HARBOR_TEST_SECRET\\}}", None),  # left a whole ${...}: Harbor would fill it again
    ],
)
def test_every_reference_is_filled_by_us_and_nothing_is_left_for_harbor_or_compose(
    tmp_path, monkeypatch, template: str, expected: str | None
):
    monkeypatch.setenv("HARBOR_TEST_SECRET", SECRET)
    task = load_task(_task(tmp_path, "t", template.replace("\\", "\\\\")))
    if expected is None:
        with pytest.raises(TaskEnvError):
            with_allowed_env(task, ())
        assert missing_variables(task, ())
        return
    assert with_allowed_env(task, ()).config.environment.env == {"LEAK": expected}
    escaped = expected.replace("$", "$$")  # on docker Compose reads [environment.env]: every $ is escaped
    assert with_allowed_env(task, (), compose=True).config.environment.env == {"LEAK": escaped}
    allowed = with_allowed_env(task, {"HARBOR_TEST_SECRET"}).config.environment.env["LEAK"]
    reads_it = "HARBOR_TEST_SECRET" in template.replace("$$HARBOR", "")  # not the escaped literal
    assert (SECRET in allowed) == reads_it  # allowed on purpose: the host's value is read


@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=[pytest.mark.slow, pytest.mark.docker])])
def test_a_nested_default_or_a_bare_name_reaches_no_sandbox(tmp_path, backend: str, request: pytest.FixtureRequest):
    """The measured leaks, end to end: the sandbox sees the default or a literal, never the host's secret."""
    if backend == "docker":
        request.getfixturevalue("docker_daemon")
    env = {"HARBOR_TEST_SECRET": SECRET}
    suite = tmp_path / "suite"
    _task(suite, "nested", "${NOT_SET_HERE:-${HARBOR_TEST_SECRET:-fallback}}")
    literal = _task(suite, "literal", "$$HARBOR_TEST_SECRET")  # a literal $ the sandbox must see as it is
    (literal / "tests" / "test.sh").write_text(
        '#!/bin/sh\nmkdir -p /logs/verifier\n'
        'if [ "$LEAK" = "\\$HARBOR_TEST_SECRET" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
    )
    done = harbor_async(
        "run", "-p", str(suite), "-a", "none", "-e", backend, "-o", str(tmp_path / "jobs"), "--job-name", "j", env=env,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert {r["task"]: r["reward"] for r in records(tmp_path / "jobs" / "j")} == {"nested": 1.0, "literal": 1.0}
    job_text = "".join(p.read_text(errors="replace") for p in (tmp_path / "jobs" / "j").rglob("*") if p.is_file())
    assert SECRET not in job_text + done.stdout + done.stderr
    leaky = tmp_path / "leaky"
    _task(leaky, "bare", "x$HARBOR_TEST_SECRET")
    refused = harbor_async("run", "-p", str(leaky), "-a", "none", "-e", backend, "-o", str(tmp_path / "jobs2"), env=env)
    assert refused.returncode == 2 and "HARBOR_TEST_SECRET" in refused.stderr and SECRET not in refused.stderr
