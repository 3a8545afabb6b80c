"""Names and messages are printed as they are: markup characters neither crash nor vanish."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cli_helpers import harbor_async, make_suite, records


@pytest.mark.slow
def test_names_paths_and_messages_with_markup_characters(tmp_path, suite_root):
    suite = tmp_path / "we[" / "]suite"  # the path holds "[/]", rich's closing tag
    make_suite(suite, ["good[red]", "[bold]x"])
    broken = suite / "tasks" / "broken[i]"
    shutil.copytree(suite_root / "tasks" / "csv-column-sum", broken)
    shutil.rmtree(broken / "environment")  # its reason names "[environment].docker_image"
    assert "[/]" in str(suite)

    listed = harbor_async("tasks", "-p", str(suite))
    assert listed.returncode == 0, listed.stderr
    assert "good[red]" in listed.stdout and "[bold]x" in listed.stdout
    assert listed.stderr.count("[environment].docker_image") == 1

    ran = harbor_async("run", "-p", str(suite), "-o", str(tmp_path / "jobs"), "--job-name", "j")
    assert ran.returncode == 0, ran.stderr
    assert "good[red]" in ran.stdout and "[bold]x" in ran.stdout
    assert ran.stderr.count("[environment].docker_image") == 1 and "Traceback" not in ran.stderr
    assert sorted(r["task"] for r in records(tmp_path / "jobs" / "j")) == ["[bold]x", "good[red]"]


@pytest.mark.slow
def test_error_messages_keep_their_brackets(tmp_path):
    result = harbor_async("run", "-p", str(tmp_path / "no[/]such"), "-o", str(tmp_path / "jobs"))
    assert result.returncode == 2
    assert "no[/]such" in result.stderr


@pytest.mark.slow
def test_the_error_column_keeps_whole_words(tmp_path):
    result = harbor_async(
        "run", "-e", "tests.broken_backend:FailingStartEnvironment", "-l", "1", "-o", str(tmp_path),
        env={"COLUMNS": "100"},
    )  # fmt: skip
    assert result.returncode == 1
    table = result.stdout.split("episodes:")[0]
    text = " ".join(cell.strip() for line in table.splitlines() for cell in line.split("│")[-2:-1])
    assert "simulated: disk full (permanent)" in " ".join(text.split())


@pytest.mark.slow
def test_tasks_of_the_same_name_are_told_apart_by_path(tmp_path):
    suite = make_suite(tmp_path / "suite", ["a", "b"])
    for name in ("a", "b"):
        toml = suite / "tasks" / name / "task.toml"
        first, rest = toml.read_text().split("\n", 1)
        toml.write_text(f'{first}\n\n[task]\nname = "org/same"\n{rest}')
    result = harbor_async("run", "-p", str(suite), "-o", str(tmp_path / "jobs"), "--job-name", "j")
    assert result.returncode == 0, result.stderr
    found = records(tmp_path / "jobs" / "j")
    assert {r["task"] for r in found} == {"org/same"} and {r["task_path"] for r in found} == {"a", "b"}
    rows = [line.split("│")[1].strip() for line in result.stdout.splitlines() if line.startswith("│")]
    assert sorted(rows) == ["a", "b"]  # the table names each by its path in the suite
    summary = json.loads((tmp_path / "jobs" / "j" / "summary.json").read_text())
    assert summary["tasks"] == 2 and summary["episodes"] == 2


@pytest.mark.slow
def test_terminal_escapes_from_a_task_never_reach_the_terminal(tmp_path):
    """A task folder name, a Dockerfile line (in the backend's warning) and a verifier's error are escaped."""
    evil = "\x1b]0;owned\x07\x1b[2J"
    suite = make_suite(tmp_path / "suite", ["fine"])
    bad = suite / "tasks" / f"evil{evil}"
    shutil.copytree(suite / "tasks" / "fine", bad)
    dockerfile = bad / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + f"RUN echo '{evil}ALL EPISODES PASSED'\n")
    (bad / "tests" / "test.sh").write_text(f"#!/bin/sh\nprintf '{evil}' > /logs/verifier/reward.txt\n")
    result = harbor_async(
        "run", "-p", str(suite), "-o", str(tmp_path / "jobs"), "--job-name", "j", "--log-level", "info",
        env={"HARBOR_ASYNC_LOG_FORMAT": "console"},
    )  # fmt: skip
    both = result.stdout + result.stderr
    assert "\x1b" not in both and "\x07" not in both
    assert "\\x1b]0;owned" in both  # shown, visibly
