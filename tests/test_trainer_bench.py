"""The trainer-step benchmark runs end to end on its smoke scenario and writes complete results.

Speed is measured by the benchmark itself; here only what must hold whatever the
machine: every step timed, TRL's env replayed, and the concurrent rounds' tool
time below the serial loop's (2 turns x 4 rollouts x 0.2 s serial, against
2 x 0.2 s at once).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a real trainer, cluster, daemon, browser or wheel

REPO = Path(__file__).resolve().parents[1]


def test_trainer_step_benchmark_smoke(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.trainer_step", "--scenario", "smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "trainer-step-smoke.json").read_text())
    assert data["benchmark"] == "trainer-step" and data["machine"]["packages"]["trl"] == "1.16.0"
    runs = {run["trainer"]: run for run in data["runs"]}
    assert set(runs) == {"grpo-trainer", "harbor-grpo-trainer", "harbor-grpo-trainer-prefetch"}
    for run in runs.values():
        assert len(run["steps"]) == 2 and all(step["wall"] > step["tools"] > 0 for step in run["steps"])
    assert runs["harbor-grpo-trainer"]["logged_env_wait"]  # the trainer's own metric reached the logs
    assert runs["harbor-grpo-trainer-prefetch"]["logged_prefetch_hits"] == [0.0, 4.0]  # step 2 claimed all 4
    serial = min(step["tools"] for step in runs["grpo-trainer"]["steps"])
    rounds = max(step["tools"] for step in runs["harbor-grpo-trainer"]["steps"])
    assert serial > 1.6 and rounds < serial
    assert len(data["trl_env"]["steps"]) == 2
    assert {"wall_ratio_plain_over_harbor", "env_ratio_trl_over_harbor", "wall_ratio_harbor_over_prefetch"} <= set(
        data["summary"]
    )
    # Each Harbor trainer's limit, from its own run with zero-latency execs in the same invocation.
    assert sorted(run["trainer"] for run in data["limit_runs"]) == [
        "harbor-grpo-trainer-prefetch/zero-exec", "harbor-grpo-trainer/zero-exec"
    ]  # fmt: skip
    for trainer in ("harbor-grpo-trainer", "harbor-grpo-trainer-prefetch"):
        assert data["summary"][f"{trainer}/over_limit"] > 0
        assert f"{trainer}: step " in result.stdout and "step / limit" in result.stdout


def test_the_limit_is_the_zero_exec_step_plus_the_turns_execs_and_repeats_take_medians() -> None:
    from benchmarks.trainer_step import limits, summarize

    def run(trainer: str, wall: float, env: float) -> dict:
        return {"trainer": trainer, "later_wall_mean": wall, "later_env_mean": env}

    result = {
        "turns": 3,
        "latencies": {"exec_latency": 0.5},
        "runs": [run("harbor-grpo-trainer-prefetch", wall, 2.0) for wall in (6.0, 9.0, 5.0)],
        "limit_runs": [run("harbor-grpo-trainer-prefetch/zero-exec", wall, 0.4) for wall in (3.0, 3.5, 2.5)],
    }
    found = limits(result)
    assert found["harbor-grpo-trainer-prefetch/limit_s"] == 4.5  # median 3.0 + 3 x 0.5
    assert found["harbor-grpo-trainer-prefetch/over_limit"] == round(6.0 / 4.5, 3)  # median step over it
    assert found["harbor-grpo-trainer-prefetch/env_over_limit_s"] == 0.1  # 2.0 - (0.4 + 1.5)
    assert summarize(result)["harbor-grpo-trainer-prefetch/later_wall_repeats_s"] == [6.0, 9.0, 5.0]
