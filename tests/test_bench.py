"""The benchmark commands run end to end on small sizes and write complete results.

Speed itself is measured by the benchmarks, not asserted here.
"""

from __future__ import annotations

import pytest

import json
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.slow  # a real trainer, cluster, daemon, browser or wheel

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str, out: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "harbor_async", "bench", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={**__import__("os").environ, "TRL_EXPERIMENTAL_SILENCE": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {"stdout": result.stdout, "stderr": result.stderr}


def test_grpo_step_compares_trl_and_the_shim(tmp_path):
    run = bench("grpo-step", "-b", "local", "-B", "2,3", "-T", "2", "-s", "2", out=tmp_path)
    data = json.loads((tmp_path / "grpo-step-local.json").read_text())
    assert data["machine"]["cpus"] >= 1 and data["machine"]["packages"]["trl"] == "1.16.0"
    runs = {(r["implementation"], r["batch"]): r for r in data["runs"]}
    assert set(runs) == {("trl", 2), ("shim", 2), ("trl", 3), ("shim", 3)}
    for (impl, batch), r in runs.items():
        assert len(r["steps"]) == 2 and all(s["reset"] >= 0 and s["tools"] > 0 for s in r["steps"])
        # Same tasks, same scripted answers: both implementations earn the same reward.
        assert r["mean_reward"] == runs[("trl", batch)]["mean_reward"]
    assert (tmp_path / "grpo-step-local.png").stat().st_size > 10_000
    assert "ratio shim/TRL" in run["stdout"]
    assert "benchmarks.reference" in run["stderr"]  # says how TRL's env was driven on this backend


def test_throughput_reports_rates_latencies_and_memory(tmp_path):
    bench("throughput", "-e", "simulated", "--latency", "zero", "--episodes", "12", "-n", "1,4", out=tmp_path)
    data = json.loads((tmp_path / "throughput-simulated.json").read_text())
    assert [r["concurrency"] for r in data["runs"]] == [1, 4]
    for r in data["runs"]:
        assert r["episodes"] == 12 and r["failures"] == 0 and r["episodes_per_second"] > 0
        assert r["peak_live"] == r["concurrency"]
        assert set(r["phases"]) >= {"start", "exec", "verify", "stop"}
        assert all(p["p50"] <= p["p95"] <= p["p99"] for p in r["phases"].values())


def test_overhead_reports_the_round_trip_and_capacity(tmp_path):
    # A bound no probe can meet: the ramp stops at its first size and holds nothing.
    bench("overhead", "--calls", "200", "--sizes", "20,40", "--bound-us", "0.001", out=tmp_path / "tight")
    tight = json.loads((tmp_path / "tight" / "overhead.json").read_text())
    assert [s["sandboxes"] for s in tight["capacity"]] == [20] and tight["capacity"][0]["under_bound"] is False
    assert tight["bound_us"] == 0.001 and tight["max_sandboxes_under_bound"] == 0
    # A bound every probe meets: both sizes are held, the largest is the answer.
    bench("overhead", "--calls", "200", "--sizes", "20,40", "--bound-us", "1000000", out=tmp_path / "loose")
    data = json.loads((tmp_path / "loose" / "overhead.json").read_text())
    rt = data["round_trip"]
    assert rt["calls"] == 200
    assert 0 < rt["direct_p50_us"] < rt["portal_p50_us"]  # the portal adds a thread hand-off
    assert 0 < rt["floor_p50_us"] < rt["portal_p50_us"]  # a bare hand-off of nothing costs less than one of an exec
    capacity = data["capacity"]
    assert [s["sandboxes"] for s in capacity] == [20, 40]
    for step in capacity:  # each step's verdict is its own p50, and the probe ran under load
        assert step["under_bound"] is True and 0 < step["probe_p50_us"] <= step["probe_p99_us"]
    assert data["max_sandboxes_under_bound"] == 40


def test_grpo_step_replay_with_prefetch_claims_every_later_start_and_leaves_nothing(example_tasks):
    from benchmarks.grpo_step import run_grpo_steps
    from shim import engines, prefetch

    latencies = {"start_latency": 0.2, "exec_latency": 0.01, "verify_latency": 0.05, "stop_latency": 0.0}
    kwargs = {"backend": "simulated", "batch": 4, "turns": 2, "steps": 3, "backend_kwargs": latencies}
    rounds = run_grpo_steps("shim-rounds", **kwargs)
    for implementation in ("shim-prefetch", "shim-prefetch-early"):
        ahead = run_grpo_steps(implementation, optimise_seconds=0.3, **kwargs)
        assert ahead.prefetch_hits == [0, 4, 4], implementation
        assert ahead.mean_reward == rounds.mean_reward > 0  # same tasks and answers, same verdicts
    assert prefetch.parked_count() == 0 and engines.live_sandbox_count() == 0
