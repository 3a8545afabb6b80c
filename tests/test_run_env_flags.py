"""harbor run's --ae, --ve and --env-file: variables of the agent's commands and of the verifier's, through every
way a run is given (flags, Harbor's job config, the cluster), and never a host variable --env-allow does not name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, harbor_async, make_suite, records

# The agent's commands see A, the verifier's see B and not A: reward 1 only then, else a line saying what it saw.
SOLVE = '#!/bin/sh\nprintf %s "$A" > /workdir/a\nprintf %s "$B" > /workdir/b-of-agent\n'
TEST = (
    "#!/bin/sh\nmkdir -p /logs/verifier\n"
    'if [ "$(cat /workdir/a)" = from-agent ] && [ "$B" = for-verifier ] && [ -z "$A" ] '
    '&& [ ! -s /workdir/b-of-agent ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
    'echo "a=$(cat /workdir/a) B=$B A=$A agent-saw-B=$(cat /workdir/b-of-agent)"\n'
)


def _suite(root: Path) -> Path:
    suite = make_suite(root, ["t1"])
    task = suite / "tasks" / "t1"
    (task / "solution" / "solve.sh").write_text(SOLVE)
    (task / "tests" / "test.sh").write_text(TEST)
    return suite


def _run(tmp_path: Path, name: str, *args: str, code: int = 0) -> list[dict]:
    done = harbor_async("run", "-e", "local", "-o", str(tmp_path / "jobs"), "--job-name", name, *args)
    assert done.returncode == code, done.stdout + done.stderr
    return records(tmp_path / "jobs" / name)


@pytest.mark.slow
def test_ae_reaches_the_agents_commands_and_ve_the_verifiers_alone(tmp_path):
    suite = _suite(tmp_path / "suite")
    flags = ["--ae", "A=from-agent", "--ve", "B=for-verifier"]
    found = _run(tmp_path, "both", "-p", str(suite), *flags)
    assert [r["reward"] for r in found] == [1.0], found[0].get("verifier_output")
    # Without --ae the agent writes nothing; without --ve the verifier has no B: both judged 0, not failures.
    assert [r["reward"] for r in _run(tmp_path, "no-ae", "-p", str(suite), "--ve", "B=for-verifier")] == [0.0]
    assert [r["reward"] for r in _run(tmp_path, "no-ve", "-p", str(suite), "--ae", "A=from-agent")] == [0.0]
    # A task's own [verifier.env] is overridden by --ve, as Harbor's job-level verifier env wins.
    toml = suite / "tasks" / "t1" / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\n", '[verifier]\nenv = { B = "from-task" }\n', 1))
    assert [r["reward"] for r in _run(tmp_path, "over-task", "-p", str(suite), *flags)] == [1.0]
    # Harbor's job config carries both (agents[0].env, verifier.env), and runs the same.
    shown = harbor_async("run", "-p", str(suite), "-e", "local", *flags, "--print-config")
    assert shown.returncode == 0, shown.stderr
    config = json.loads(shown.stdout)
    assert config["agents"][0]["env"] == {"A": "from-agent"} and config["verifier"]["env"] == {"B": "for-verifier"}
    (tmp_path / "job.json").write_text(shown.stdout)
    assert [r["reward"] for r in _run(tmp_path, "config", "-c", str(tmp_path / "job.json"))] == [1.0]
    bad = harbor_async("run", "-p", str(suite), "--ae", "no-equals", "--dry-run")
    assert bad.returncode == 2 and "--ae 'no-equals': write KEY=VALUE" in bad.stderr


@pytest.mark.slow
def test_env_file_values_reach_a_task_only_through_env_allow(tmp_path):
    suite = _suite(tmp_path / "suite")
    env_file = tmp_path / "vars.env"
    env_file.write_text("HA_TEST_AGENT=from-agent\nHA_TEST_VERIFIER=for-verifier\n")
    flags = ["--env-file", str(env_file), "--ae", "A=${HA_TEST_AGENT}", "--ve", "B=${HA_TEST_VERIFIER}"]
    refused = harbor_async("run", "-p", str(suite), "-e", "local", *flags, "--env-allow", "HA_TEST_VERIFIER", "--dry-run")
    assert refused.returncode == 2 and "--ae A=${HA_TEST_AGENT}" in refused.stderr and "--env-allow" in refused.stderr
    refused = harbor_async("run", "-p", str(suite), "-e", "local", *flags, "--env-allow", "HA_TEST_AGENT", "--dry-run")
    assert refused.returncode == 2 and "HA_TEST_VERIFIER" in refused.stderr  # the task's table: [verifier.env] B
    allowed = ["--env-allow", "HA_TEST_AGENT", "--env-allow", "HA_TEST_VERIFIER"]
    found = _run(tmp_path, "file", "-p", str(suite), *flags, *allowed)
    assert [r["reward"] for r in found] == [1.0], found[0].get("verifier_output")
    stored = (tmp_path / "jobs" / "file" / "config.json").read_text()
    assert "${HA_TEST_AGENT}" in stored and "from-agent" not in stored  # the job keeps the template, not the value
    settings = tmp_path / "jobs" / "file" / "harbor-async.json"
    assert "${HA_TEST_AGENT}" in settings.read_text() and settings.stat().st_mode & 0o777 == 0o600  # the owner's alone
    missing = harbor_async("run", "-p", str(suite), "--env-file", str(tmp_path / "nope.env"), "--dry-run")
    assert missing.returncode == 2 and "nope.env: no such file" in missing.stderr


@pytest.mark.slow
def test_a_run_on_the_cluster_gives_its_workers_the_runs_task_changes(ray_cluster, tmp_path):
    """The cluster's workers load each task anew from its folder: --ae, --ve and --artifact reach them as a local
    run's engine applies them (the engine applies the run's changes to every task it starts)."""
    from tests.cluster_helpers import child_env

    suite = _suite(tmp_path / "suite")
    flags = ["--ae", "A=from-agent", "--ve", "B=for-verifier", "--artifact", "/workdir/a"]
    command = [
        sys.executable, "-m", "harbor_async", "run", "-p", str(suite), "-e", "local", *flags, "-o", str(tmp_path),
        "--job-name", "sharded", "--ray", "--ray-address", ray_cluster.address,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    found = records(tmp_path / "sharded")
    assert [r["reward"] for r in found] == [1.0], found[0].get("verifier_output")
    artifact = tmp_path / "sharded" / found[0]["trial"] / "artifacts" / "workdir" / "a"
    assert artifact.read_text() == "from-agent"


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_a_tasks_compose_file_reads_a_host_variable_only_through_env_allow(tmp_path):
    """Compose fills ${VAR} in a task's docker-compose.yaml from its own environment: it gets only the host
    variables it needs itself and the --env-allow'ed ones, so an --env-file's secret stays on the host."""
    task = tmp_path / "suite" / "leak"
    for folder in ("environment", "solution", "tests"):
        (task / folder).mkdir(parents=True)
    (task / "task.toml").write_text('schema_version = "1.4"\n')
    (task / "instruction.md").write_text("Say what you see.\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    environment:\n      LEAK: ${HA_TEST_SECRET:-unset}\n"
    )
    (task / "solution" / "solve.sh").write_text('#!/bin/sh\nprintf %s "$LEAK" > /app/leak\n')
    (task / "tests" / "test.sh").write_text(
        '#!/bin/sh\n[ "$(cat /app/leak)" = unset ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n'
        'echo "leak=$(cat /app/leak)"\n'
    )
    env_file = tmp_path / "secret.env"
    env_file.write_text("HA_TEST_SECRET=leaked-secret\n")
    args = ["-p", str(tmp_path / "suite"), "-e", "docker", "--env-file", str(env_file)]
    done = harbor_async("run", *args, "-o", str(tmp_path / "jobs"), "--job-name", "kept")
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = records(tmp_path / "jobs" / "kept")
    assert record["reward"] == 1.0, record.get("verifier_output")  # the compose file got no secret
    done = harbor_async("run", *args, "--env-allow", "HA_TEST_SECRET", "-o", str(tmp_path / "jobs"), "--job-name", "allowed")
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = records(tmp_path / "jobs" / "allowed")
    assert record["reward"] == 0.0 and "leaked-secret" in (record.get("verifier_output") or ""), record
