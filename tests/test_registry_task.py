"""``-t/--task`` as Harbor spells it: one registry task, resolved by Harbor's own client and run alone (issue 46).

The registry file is Harbor's format, its tasks in a local git repo (as in
tests/test_registry.py): ``demo/alpha`` is pinned to the first commit by
``mini@1.0`` and to the second by ``mini@2.0`` (two different tasks of one
name), ``beta`` is listed by both at HEAD (one task). ``HOME`` points into the
test folder, so Harbor's task cache is the test's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_async.jobs.folder import JobFolder
from tests.cli_helpers import harbor_async, make_suite, records
from tests.test_registry import _env, _error_lines, _git

ALPHA = "demo/alpha"  # a name with an org, so that Harbor's own -t takes it too (--print-config)


@pytest.fixture
def registry(tmp_path: Path) -> tuple[Path, list[str]]:
    """``registry.json`` and the repo's two commits: mini@1.0 = alpha@first + beta; mini@2.0 = alpha@second + beta."""
    repo = make_suite(tmp_path / "repo", ["alpha", "beta"])
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "two tasks")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "tasks" / "alpha" / "instruction.md").write_text("The same task, changed.\n")
    _git(repo, "commit", "-qam", "alpha changed")
    second = _git(repo, "rev-parse", "HEAD")

    def alpha(commit: str) -> dict:
        return {"name": ALPHA, "git_url": str(repo), "git_commit_id": commit, "path": "tasks/alpha"}

    beta = {"name": "beta", "git_url": repo.as_uri(), "path": "tasks/beta"}
    path = tmp_path / "registry.json"
    path.write_text(json.dumps([
        {"name": "mini", "version": "1.0", "description": "", "tasks": [alpha(first), beta]},
        {"name": "mini", "version": "2.0", "description": "", "tasks": [alpha(second), beta]},
    ]))  # fmt: skip
    return path, [first, second]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return harbor_async("run", *args, "-e", "local", "-o", str(tmp_path / "jobs"), env=_env(tmp_path))


@pytest.mark.slow
def test_t_runs_exactly_that_registry_task_alone_and_the_job_says_so(tmp_path: Path, registry) -> None:
    path, _ = registry
    done = _run(tmp_path, "-t", "beta", "--registry-path", str(path), "-k", "2", "--job-name", "j")
    assert done.returncode == 0, done.stderr
    job = tmp_path / "jobs" / "j"
    assert sorted((r["task"], r["attempt"], r["reward"]) for r in records(job)) == [("beta", 0, 1.0), ("beta", 1, 1.0)]
    settings = JobFolder.open(job).config
    assert settings["task_ref"] == "beta" and Path(settings["suite"]).is_relative_to(tmp_path / "home" / ".cache" / "harbor")
    config = json.loads((job / "config.json").read_text())  # Harbor's JobConfig of the job: the task, no dataset
    assert config["tasks"] == [{**config["tasks"][0], "name": "beta", "ref": "latest"}] and config["datasets"] == []


@pytest.mark.slow
def test_a_name_listed_as_different_tasks_is_refused_naming_them_and_a_commit_picks_one(tmp_path: Path, registry) -> None:
    path, (first, second) = registry
    refused = _run(tmp_path, "-t", ALPHA, "--registry-path", str(path), "--dry-run")
    assert refused.returncode == 2
    (line,) = _error_lines(refused.stderr)
    assert line.startswith("error:") and "different tasks named 'demo/alpha'" in line, line
    assert "mini@1.0" in line and "mini@2.0" in line and first in line and second in line
    picked = _run(tmp_path, "-t", f"{ALPHA}@{first[:10]}", "--registry-path", str(path), "--job-name", "p")
    assert picked.returncode == 0, picked.stderr
    assert [(r["task"], r["reward"]) for r in records(tmp_path / "jobs" / "p")] == [("alpha", 1.0)]
    unknown = _run(tmp_path, "-t", f"{ALPHA}@0000000", "--registry-path", str(path), "--dry-run")
    assert unknown.returncode == 2 and "has no task 'demo/alpha' at commit '0000000'" in unknown.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("-t", "bta"), "has no task 'bta'; its tasks: beta, demo/alpha"),
        (("-t", "beta", "-p", "."), "give one suite, not -p/--path and -t/--task"),
        (("-t", "beta", "-d", "mini@1.0"), "give one suite, not -d/--dataset and -t/--task"),
    ],
)
def test_what_t_cannot_resolve_exits_2_in_one_line_before_any_job(tmp_path: Path, registry, args, message) -> None:
    path, _ = registry
    done = _run(tmp_path, *args, "--registry-path", str(path))
    assert done.returncode == 2
    (line,) = _error_lines(done.stderr)
    assert line.startswith("error:") and message in line, done.stderr
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_harbors_own_registry_takes_org_name_packages(tmp_path: Path) -> None:
    """Without a registry file, -t is a Harbor package, org/name[@ref]; a bare name is refused before any lookup."""
    done = _run(tmp_path, "-t", "beta")
    assert done.returncode == 2
    (line,) = _error_lines(done.stderr)
    assert "Harbor's registry names a task org/name" in line and "--registry-path" in line, line


@pytest.mark.slow
def test_print_config_writes_t_as_harbor_does_and_c_reads_it_back(tmp_path: Path, registry) -> None:
    path, (first, _) = registry
    harbor = Path(sys.executable).with_name("harbor")
    theirs = subprocess.run([str(harbor), "run", "-t", f"{ALPHA}@{first}", "--print-config"], capture_output=True, text=True, cwd=tmp_path)
    assert theirs.returncode == 0, theirs.stderr
    ours = _run(tmp_path, "-t", f"{ALPHA}@{first}", "--registry-path", str(path), "--print-config")
    assert ours.returncode == 0, ours.stderr
    assert json.loads(ours.stdout)["tasks"] == json.loads(theirs.stdout)["tasks"] == [{"name": ALPHA, "ref": first}]
    assert "datasets" not in json.loads(ours.stdout)
    # Harbor's file runs the task here; its registry (Harbor's -t has none in the file) given beside -c
    (tmp_path / "job.json").write_text(theirs.stdout)
    done = _run(tmp_path, "-c", str(tmp_path / "job.json"), "--registry-path", str(path), "-a", "oracle", "--job-name", "c")
    assert done.returncode == 0, done.stderr
    assert [(r["task"], r["reward"]) for r in records(tmp_path / "jobs" / "c")] == [("alpha", 1.0)]


def test_a_job_configs_registry_task_is_t_and_a_git_task_is_refused(tmp_path: Path) -> None:
    from harbor.models.job.config import JobConfig

    from harbor_async.jobs.harbor_config import JobConfigError, run_options

    found = run_options(JobConfig.model_validate({"tasks": [{"name": ALPHA, "ref": "3"}]}))
    assert found["task_ref"] == f"{ALPHA}@3" and "path" not in found and "dataset" not in found
    assert run_options(JobConfig.model_validate({"tasks": [{"name": ALPHA}]}))["task_ref"] == ALPHA
    git = JobConfig.model_validate({"tasks": [{"path": "tasks/a", "git_url": "https://example.org/r.git"}]})
    with pytest.raises(JobConfigError, match=r"tasks\[0\]\.git_url"):
        run_options(git)
