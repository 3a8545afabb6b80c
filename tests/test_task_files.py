"""Harbor's ``.harborignore`` rules hold on every verify, while the task's file filter answers each path once."""

from __future__ import annotations

from pathlib import Path

import pytest

import shim
from harbor_async.tasks.files import RememberingFileFilter
from harbor_async.tasks.suite import load_task
from shim.rewards import verify_environments
from shim.task_cache import load_task_cached

TEST_SH = """#!/bin/sh
# The ignored file must not reach the sandbox; the kept one must.
if [ -e /tests/answer-key.txt ] || [ ! -e /tests/helper.txt ]; then echo 0 > /logs/verifier/reward.txt; exit 0; fi
echo 1 > /logs/verifier/reward.txt
"""


def _task(root: Path) -> Path:
    task = root / "ignoring"
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /workdir\n")
    (task / "tests").mkdir()
    (task / "tests" / "test.sh").write_text(TEST_SH)
    (task / "tests" / "helper.txt").write_text("kept\n")
    (task / "tests" / "answer-key.txt").write_text("never uploaded\n")
    (task / "tests" / ".harborignore").write_text("answer-key.txt\n")
    (task / "instruction.md").write_text("Do the thing.\n")
    (task / "task.toml").write_text("")
    return task


def test_ignored_test_files_stay_out_on_every_verify(tmp_path: Path):
    task_dir = _task(tmp_path)
    task = load_task_cached(task_dir)
    assert isinstance(task.file_filter, RememberingFileFilter)
    envs = [shim.HarborBashEnv("local") for _ in range(2)]
    try:
        for round_ in range(2):  # the second round's verifies answer from the remembered selection
            for env in envs:
                env.reset(task_dir=str(task_dir))
            assert verify_environments(envs) == [1.0, 1.0], f"round {round_}"
    finally:
        for env in envs:
            env.close()
    selection = task.file_filter.select(task_dir / "tests")
    assert selection is task.file_filter.select(task_dir / "tests")  # remembered, not recomputed
    assert Path("answer-key.txt") not in selection.relative_paths and Path("helper.txt") in selection.relative_paths


def test_a_failed_check_is_not_remembered(tmp_path: Path):
    task_dir = _task(tmp_path)
    task = load_task(task_dir)
    outside = tmp_path / "outside"
    outside.mkdir()
    for _ in range(2):  # refused each time: a failure is never cached as an answer
        with pytest.raises(ValueError, match="within the task"):
            task.file_filter.select(outside)
