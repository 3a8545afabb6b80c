"""Harbor's job config files: `harbor-async run -c FILE` runs what `harbor run -c FILE` runs (issue 46).

The files are written by Harbor itself (`harbor run ... --print-config`), read by Harbor's own loader and
model, and run by both tools side by side on the same tasks and backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from harbor_async.suites import example_suite_path
from tests.cli_helpers import REPO, harbor_async, records

HARBOR = Path(sys.executable).with_name("harbor")
TASKS = example_suite_path() / "tasks"


def harbor(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(REPO)}
    return subprocess.run([str(HARBOR), *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=900)


def printed_config(tmp_path: Path, *flags: str) -> Path:
    """A JobConfig as Harbor writes it: ``harbor run FLAGS --print-config``."""
    done = harbor("run", "-p", str(TASKS), *flags, "--print-config", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    path = tmp_path / "job.json"
    path.write_text(done.stdout)
    return path


@pytest.mark.slow
@pytest.mark.range  # each Harbor prints and reads its own JobConfig: both ends of the range
def test_print_config_gives_back_the_config_harbor_printed(tmp_path: Path) -> None:
    config = printed_config(tmp_path, "-e", "harbor_async.backends.local:LocalEnvironment", "-n", "2", "-k", "3", "-l", "2", "-i", "csv*", "-a", "nop")
    ours = harbor_async("run", "-c", str(config), "--print-config")
    assert ours.returncode == 0, ours.stderr
    assert same_job(json.loads(ours.stdout), json.loads(config.read_text()))
    # a flag given beside the file wins, as in Harbor
    overridden = harbor_async("run", "-c", str(config), "-n", "1", "--job-name", "mine", "--print-config")
    expected = {**json.loads(config.read_text()), "n_concurrent_trials": 1, "job_name": "mine"}
    assert same_job(json.loads(overridden.stdout), expected, keep_name=True)


def same_job(printed: dict, expected: dict, *, keep_name: bool = False) -> bool:
    """Whether two printed configs are one job, as the installed Harbor's model reads them (each Harbor prints
    its own way: 0.25 leaves every default out, 0.26 keeps nested ones); a name not given is a timestamp."""
    from harbor.models.job.config import JobConfig

    def normal(config: dict) -> dict:
        found = JobConfig.model_validate(config).model_dump(mode="json", exclude_defaults=True)
        if not keep_name:
            found.pop("job_name", None)
        return found

    return normal(printed) == normal(expected)


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_a_harbor_config_runs_the_same_tasks_attempts_agent_and_backend_as_harbor_run(tmp_path: Path) -> None:
    """Harbor's defaults come with its file: no environment in it is docker, 4 at once, the oracle."""
    config = printed_config(tmp_path, "-k", "2", "-l", "2")
    assert "environment" not in json.loads(config.read_text())  # docker, by Harbor's default
    jobs = tmp_path / "jobs"
    theirs = harbor("run", "-c", str(config), "-o", str(jobs), "--job-name", "theirs", "-y", cwd=tmp_path)
    assert theirs.returncode == 0, theirs.stdout[-3000:] + theirs.stderr[-3000:]
    ours = harbor_async("run", "-c", str(config), "-o", str(jobs), "--job-name", "ours", timeout=900)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "defaults:" not in ours.stderr  # the file's (Harbor's) defaults, not ours
    settings = json.loads((jobs / "ours" / "harbor-async.json").read_text())
    assert (settings["environment_type"], settings["n_concurrent"], settings["agent"]) == ("docker", 4, "oracle")

    def trials(job: Path) -> Counter:
        found = Counter()
        for folder in job.iterdir():
            if (folder / "result.json").is_file():
                result = json.loads((folder / "result.json").read_text())
                found[(result["task_name"].split("/")[-1], result["agent_info"]["name"], result["verifier_result"]["rewards"]["reward"])] += 1
        return found

    assert trials(jobs / "ours") == trials(jobs / "theirs") and sum(trials(jobs / "ours").values()) == 4
    from harbor.models.job.config import JobConfig

    kinds = {job: JobConfig.model_validate_json((jobs / job / "config.json").read_text()).environment.type for job in ("ours", "theirs")}
    assert kinds["ours"] == kinds["theirs"] and kinds["ours"].value == "docker"
    assert {r["task"] for r in records(jobs / "ours")} == {name for name, _, _ in trials(jobs / "theirs")}


@pytest.mark.slow
@pytest.mark.range
@pytest.mark.parametrize(
    ("content", "field"),
    [
        ({"environment": {"mounts": [{"type": "bind", "source": "relative/path", "target": "/host"}]}}, "environment.mounts"),
        ({"retry": {"max_retries": 3, "max_wait_sec": 5}}, "retry.max_wait_sec"),
        ({"retry": {"max_retries": 3, "include_exceptions": ["VerifierTimeoutError"]}}, "--retry-include"),
        ({"agents": [{"name": "oracle"}, {"name": "nop"}]}, "agents"),
        ({"verifier": {"kwargs": {"x": 1}}}, "verifier.kwargs"),
        ({"n_attempts": 0}, "n_attempts"),  # Harbor's own model refuses it, in its words
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line_naming_the_field(tmp_path: Path, content: dict, field: str) -> None:
    path = tmp_path / "job.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"datasets": [{"path": str(TASKS)}], **content}))
    done = harbor_async("run", "-c", str(path), "-o", str(tmp_path / "jobs"))
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and field in line, line
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_the_old_c_alias_is_gone_and_an_unreadable_config_is_one_line(tmp_path: Path) -> None:
    done = harbor_async("run", "-c", "4", "-o", str(tmp_path / "jobs"))
    assert done.returncode == 2 and "cannot read the job config 4" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
