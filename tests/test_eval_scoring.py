"""pass@k and the sweep's statistics, against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from harbor_async.core.records import EpisodeRecord
from harbor_async.jobs.scoring import pass_at_k, summarize, sweep_summary


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (3, 1, 1, 1 / 3),
        (4, 0, 2, 0.0),
        (4, 3, 2, 1.0),  # fewer failures than k: every draw of k holds a success
        (10, 5, 3, 1 - (5 * 4 * 3) / (10 * 9 * 8)),
        (2, 1, 2, 1.0),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected) -> None:
    assert math.isclose(pass_at_k(n, c, k), expected)


def _records(model: str, rewards: dict[str, list[float]]) -> list[EpisodeRecord]:
    return [
        EpisodeRecord(task=task, task_path=task, attempt=i, model=model, reward=r)
        for task, values in rewards.items()
        for i, r in enumerate(values)
    ]


def test_pass_at_k_with_a_success_threshold_for_fractional_rewards() -> None:
    records = _records("m", {"a": [0.5, 0.2, 0.9], "b": [0.1, 0.1, 0.1]})
    s = summarize(records, k=3, success_threshold=0.5)
    # a: 2 of 3 pass -> pass@1 = 2/3, pass@2 = 1 - C(1,2)/C(3,2) = 1; b: 0
    assert math.isclose(s["pass_at_k"]["1"]["value"], (2 / 3 + 0) / 2)
    assert math.isclose(s["pass_at_k"]["2"]["value"], 0.5)
    assert math.isclose(s["mean_reward"], (1.6 + 0.3) / 6)
    assert summarize(records, k=1)["pass_at_k"]["1"]["value"] == 0.0  # default threshold 1.0


def test_sweep_pairs_tasks() -> None:
    first = _records("c100", {"a": [0, 0], "b": [1, 0], "c": [0, 0]})
    second = _records("c200", {"a": [1, 1], "b": [1, 1], "c": [0, 1]})
    third = _records("c300", {"a": [1, 1], "b": [1, 1], "c": [1, 1]})
    sweep = sweep_summary([("c100", 100, first), ("c200", 200, second), ("c300", 300, third)], k=2)
    assert [r["step"] for r in sweep["rows"]] == [100, 200, 300]
    assert math.isclose(sweep["rows"][0]["pass_at_k"]["2"]["value"], 1 / 3)
    vs_first = {p["other"]: p for p in sweep["vs_first"]}
    assert math.isclose(vs_first["c200"]["difference"], (1 + 0.5 + 0.5) / 3)
    assert vs_first["c200"]["per_task"] == {"a": 1.0, "b": 0.5, "c": 0.5}
    low, high = vs_first["c300"]["ci"]
    assert 0 < low <= vs_first["c300"]["difference"] <= high <= 1
    assert [(p["base"], p["other"]) for p in sweep["neighbours"]] == [("c100", "c200"), ("c200", "c300")]
    assert math.isclose(sweep["neighbours"][1]["difference"], 0.5 / 3)
