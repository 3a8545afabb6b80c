"""``-d`` as Harbor spells it: a registry file pointing at a local git repo, resolved by Harbor's own client, offline.

The registry file is Harbor's format (a JSON list of datasets, each task a git
URL, commit and path); the repo is made here with two copies of a bundled task,
one task reached by a plain path and pinned to a commit, the other by a
``file://`` URL at HEAD. ``HOME`` points into the test folder, so Harbor's task
cache (``~/.cache/harbor/tasks``) is the test's own.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harbor_async.jobs.folder import JobFolder
from harbor_async.tasks.registry import Dataset, parse_hf, resolve_dataset
from harbor_async.tasks.suite import _parse_hub_source, load_suite
from tests.cli_helpers import harbor_async, make_suite, records
from tests.scripted_server import ScriptedServer


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.email=t@example.org", "-c", "user.name=t", *args],
        cwd=repo, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    """``registry.json``: ``mini@1.0`` = alpha (path, pinned) + beta (file://, HEAD); ``mini@2.0`` = beta."""
    repo = make_suite(tmp_path / "repo", ["alpha", "beta"])
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "two tasks")
    commit = _git(repo, "rev-parse", "HEAD")
    alpha = {"name": "alpha", "git_url": str(repo), "git_commit_id": commit, "path": "tasks/alpha"}
    beta = {"name": "beta", "git_url": repo.as_uri(), "path": "tasks/beta"}
    path = tmp_path / "registry.json"
    path.write_text(json.dumps([
        {"name": "mini", "version": "1.0", "description": "two tasks", "tasks": [alpha, beta]},
        {"name": "mini", "version": "2.0", "description": "one task", "tasks": [beta]},
    ]))  # fmt: skip
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    # Harbor's cache under the test's HOME; the Hub never reached (the deprecated spelling's fallback fails fast).
    return {"HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.range
def test_run_of_a_registry_dataset_downloads_it_into_harbors_cache_and_scores_it(tmp_path: Path, registry: Path) -> None:
    jobs = tmp_path / "jobs"
    result = harbor_async(
        "run", "-d", "mini@1.0", "--registry-path", str(registry), "-b", "local", "-o", str(jobs), "--job-name", "j",
        env=_env(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rewards = {r["task"]: r["reward"] for r in records(jobs / "j")}
    assert rewards == {"alpha": 1.0, "beta": 1.0}
    cache = tmp_path / "home" / ".cache" / "harbor" / "tasks"
    assert sorted(p.name for p in cache.glob("*/*")) == ["alpha", "beta"]  # Harbor's cache layout: <id>/<task>
    assert JobFolder.open(jobs / "j").config["dataset"] == "mini@1.0"  # the job says which dataset it ran
    # and so does Harbor's layout of it: the registry dataset, and each trial's source (Harbor's eval key)
    harbor_config = json.loads((jobs / "j" / "config.json").read_text())
    assert [(d.get("name"), d.get("version")) for d in harbor_config["datasets"]] == [("mini", "1.0")]
    assert set(json.loads((jobs / "j" / "result.json").read_text())["stats"]["evals"]) == {"oracle__mini"}


@pytest.mark.slow
def test_a_dataset_name_alone_takes_harbors_default_version_and_filters_apply(tmp_path: Path, registry: Path) -> None:
    latest = harbor_async("tasks", "-d", "mini", "--registry-path", str(registry), env=_env(tmp_path))
    assert latest.returncode == 0, latest.stderr
    assert "beta" in latest.stdout and "alpha" not in latest.stdout  # 2.0, the highest version
    picked = harbor_async("tasks", "-d", "mini@1.0", "--registry-path", str(registry), "-x", "beta", env=_env(tmp_path))
    assert picked.returncode == 0, picked.stderr
    assert "alpha" in picked.stdout and "beta" not in picked.stdout


@pytest.mark.parametrize(
    ("dataset", "registry_file", "message"),
    [
        ("mini@9", None, "has no version '9' of dataset 'mini'; its versions: 1.0, 2.0"),
        ("nope@1", None, "has no dataset 'nope'; its datasets: mini"),
        ("mini@1.0", "missing.json", "cannot read registry file"),
        ("mini@1.0", "bad.json", "is not a Harbor registry"),
    ],
)
def test_what_the_registry_cannot_resolve_exits_2_in_one_line_before_any_job(
    tmp_path: Path, registry: Path, dataset: str, registry_file: str | None, message: str
) -> None:
    (tmp_path / "bad.json").write_text('{"datasets": 1}')
    path = registry if registry_file is None else tmp_path / registry_file
    jobs = tmp_path / "jobs"
    result = harbor_async("run", "-d", dataset, "--registry-path", str(path), "-o", str(jobs), env=_env(tmp_path))
    assert result.returncode == 2
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert not jobs.exists()


@pytest.mark.slow
def test_a_registry_that_cannot_be_reached_names_itself(tmp_path: Path) -> None:
    url = "http://127.0.0.1:9/registry.json"  # nothing listens on the discard port
    result = harbor_async("run", "-d", "mini@1.0", "--registry-url", url, env=_env(tmp_path))
    assert result.returncode == 2
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and f"cannot reach registry {url}" in lines[0], result.stderr


@pytest.mark.slow
def test_org_name_the_registry_does_not_know_is_read_as_hugging_face_with_a_deprecation(tmp_path: Path, registry: Path) -> None:
    result = harbor_async("run", "-d", "org/suite", "--registry-path", str(registry), env=_env(tmp_path))
    assert result.returncode == 2  # the Hub is offline here: the download fails, in one line
    lines = _error_lines(result.stderr)
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("deprecated: -d org/suite is read as the Hugging Face dataset hf:org/suite")
    assert "write -d hf:org/suite" in lines[0]
    assert lines[1].startswith("error:") and "'org/suite'" in lines[1]


def test_hf_spelling_is_a_hugging_face_repo_without_asking_the_registry() -> None:
    assert parse_hf("hf:org/name") == ("org/name", None)
    assert parse_hf("hf:org/name@v2") == ("org/name", "v2")
    assert parse_hf("hf://org/name@main") == ("org/name", "main")
    assert parse_hf("org/name") is None
    assert resolve_dataset("hf:org/name@v2") == Dataset("hf://org/name@v2", "hf:org/name@v2")
    assert _parse_hub_source("hf:org/name@v2") == ("org/name", "v2")  # load_suite's (HarborSpec's) reading


@pytest.mark.slow
def test_registry_options_without_d_are_refused(tmp_path: Path, registry: Path) -> None:
    result = harbor_async("run", "-p", str(tmp_path), "--registry-path", str(registry), env=_env(tmp_path))
    assert result.returncode == 2 and "give -d name@version" in result.stderr


def test_a_list_of_task_folders_is_a_suite_in_its_order(tmp_path: Path) -> None:
    suite = make_suite(tmp_path / "s", ["b-task", "a-task"])
    folders = [suite / "tasks" / "b-task", suite / "tasks" / "a-task", suite / "tasks" / "b-task"]
    loaded = load_suite([str(f) for f in folders])
    assert loaded.names == ["b-task", "a-task"]  # the given order (the registry's), a repeat once
    assert loaded.root == (suite / "tasks").resolve()


@pytest.mark.slow  # an eval and its resume against a scripted model server: about 20 s
def test_eval_resolves_d_as_run_does_and_resumes_from_the_downloaded_folders(tmp_path: Path, registry: Path) -> None:
    jobs = tmp_path / "jobs"
    env = {**os.environ, **_env(tmp_path)}
    with ScriptedServer(slow_seconds=0) as server:
        args = ("-m", "solver", "--base-url", server.base_url, "-o", str(jobs), "--job-name", "j")
        result = harbor_async("eval", "-d", "mini@1.0", "--registry-path", str(registry), *args, env=env)
        assert result.returncode == 0, result.stderr
        assert sorted(r.reward for r in JobFolder(jobs / "j").records()) == [1.0, 1.0]
        resumed = harbor_async("eval", "--resume", str(jobs / "j"), "--base-url", server.base_url, env=env)
    assert resumed.returncode == 0, resumed.stderr  # the task folders came back from the job's settings
