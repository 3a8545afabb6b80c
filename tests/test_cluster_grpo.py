"""Two torch ranks (``torchrun --nproc_per_node 2``, gloo, CPU) train with the shim and one Ray budget.

The Ray head and worker node are real processes started by the test; the
ranks' sandboxes (the counting simulated backend) never exceed the cluster
cap together, counted by the backend, and the leases are the budget actor's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.cluster_backend import observed_peak
from tests.cluster_grpo_rank import CLUSTER_CAP, RANK_BATCH
from tests.cluster_helpers import REPO, child_env, free_port

pytestmark = pytest.mark.slow  # a real trainer, cluster, daemon, browser or wheel


@pytest.mark.timeout(1200)
def test_two_ranks_train_two_steps_under_one_cluster_budget(ray_cluster, tmp_path: Path) -> None:
    from benchmarks.tiny_model import build_tiny_qwen3
    from tests.test_shim_grpo import TASKS, _instructions

    warnings.filterwarnings("ignore", category=UserWarning)
    model_dir, _ = build_tiny_qwen3(tmp_path / "tiny-qwen3", corpus=list(_instructions(list(TASKS))))
    live = tmp_path / "live"
    live.mkdir()
    (tmp_path / "child-tmp").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.run(
        [
            torchrun, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            "-m", "tests.cluster_grpo_rank", ray_cluster.address, str(model_dir), str(out),
        ],
        cwd=REPO,
        env=child_env(HARA_LIVE_DIR=str(live), TMPDIR=str(tmp_path / "child-tmp"), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["world_size"] == 2
        assert result["global_step"] == 2
        assert result["tool_calls"] == 2 * 2  # two rollouts a step on each rank, each one tool call
        assert result["failure_frequency"] == [0.0, 0.0]  # every sandbox started under the shared cap
    # Both ranks' batches of 2 live under the cluster cap of 4, counted by the backend, and leased from
    # the cluster's budget actor: its grants and its peak are the ranks' (a process-local budget grants none).
    assert RANK_BATCH <= observed_peak(live) <= CLUSTER_CAP
    budget = results[-1]["budget"]
    assert budget["caps"]["max_live"] == CLUSTER_CAP and budget["grants"] >= 2 * 2  # two ranks, two steps
    assert RANK_BATCH <= budget["live_peak"] <= CLUSTER_CAP
