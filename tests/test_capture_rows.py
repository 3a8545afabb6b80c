"""An episode's captured calls as one training row (harbor_async.models.capture.rows): chained, cut, re-tokenized."""

from __future__ import annotations

import math

from harbor_async.models.capture.rows import token_row
from harbor_async.models.capture.trace import (
    CapturedCall,
    check_rollout_details,
    check_trajectory,
)


def call(prompt: list[int] | None, completion: list[int] | None, logprobs: list[float] | None = None, status: int = 200) -> dict:
    return {
        "status": status, "prompt_token_ids": prompt, "completion_token_ids": completion, "logprobs": logprobs,
        "request": {"messages": [{"role": "user", "content": "x"}]}, "reply": {"choices": [{"message": {"content": "y"}}]},
    }  # fmt: skip


def test_calls_that_extend_each_other_make_one_row_with_the_additions_masked() -> None:
    calls = [
        call([1, 2], [3, 4], [-0.5, -0.25]),
        call([1, 2, 3, 4, 9, 9], [5], [-1.0]),  # the environment added 9 9
        call([1, 2, 3, 4, 9, 9, 5, 8], [6, 7], [-2.0, -3.0]),  # and then 8
    ]
    row = token_row(calls)
    assert row is not None
    assert row.prompt_ids == [1, 2]
    assert row.completion_ids == [3, 4, 9, 9, 5, 8, 6, 7]
    assert row.env_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert row.logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0, 0.0, -2.0, -3.0]
    assert (row.calls, row.dropped, row.truncated, row.model_tokens) == (3, 0, False, 5)


def test_a_call_that_rewrites_the_history_ends_the_row_and_is_counted() -> None:
    calls = [call([1, 2], [3]), call([1, 2, 3, 4], [5]), call([1, 7, 3], [6]), call([1, 7, 3, 6], [8])]  # summarised
    row = token_row(calls)
    assert row is not None
    assert row.completion_ids == [3, 4, 5] and row.env_mask == [1, 0, 1]
    assert (row.calls, row.dropped) == (2, 2)


def test_failed_calls_are_skipped_and_the_budget_cuts_the_row() -> None:
    calls = [call(None, None, status=500), call([1], [2, 3]), call([1, 2, 3, 4, 5], [6, 7, 8])]
    row = token_row(calls, max_completion_length=5)
    assert row is not None
    assert row.completion_ids == [2, 3, 4, 5, 6] and row.env_mask == [1, 1, 0, 0, 1] and row.truncated
    assert token_row([call(None, None, status=502)]) is None  # no answered call: no row
    assert token_row([]) is None


def test_a_call_without_the_servers_ids_is_retokenized_or_ends_the_row() -> None:
    calls = [call([1], [2], [-0.5]), call(None, None)]
    row = token_row(calls)
    assert row is not None and (row.calls, row.dropped, row.retokenized) == (1, 1, 0)  # no tokenizer: the row ends

    seen = []

    def retokenize(request: dict, reply: dict) -> tuple[list[int], list[int]]:
        seen.append((request, reply))
        return [1, 2, 3], [4, 0]

    row = token_row(calls, retokenize=retokenize)
    assert row is not None and seen == [(calls[1]["request"], calls[1]["reply"])]
    assert row.completion_ids == [2, 3, 4, 0] and row.env_mask == [1, 0, 1, 1] and row.retokenized == 1
    assert row.logprobs[:2] == [-0.5, 0.0] and all(math.isnan(x) for x in row.logprobs[2:])  # unknown, not made up
    row = token_row(calls, retokenize=lambda request, reply: None)  # a reply it cannot render (tool calls)
    assert row is not None and (row.calls, row.dropped, row.retokenized) == (1, 1, 0)


def test_the_capture_is_checked_against_the_agents_own_record_of_its_ids() -> None:
    calls = [
        CapturedCall(0, {}, False, status=200, prompt_token_ids=[1], completion_token_ids=[2]),
        CapturedCall(1, {}, False, status=500),  # no answer: in neither record
        CapturedCall(2, {}, False, status=200, prompt_token_ids=[1, 2, 3], completion_token_ids=[4]),
    ]
    same = [{"prompt_token_ids": [[1], [1, 2, 3]], "completion_token_ids": [[2], [4]]}]
    assert check_rollout_details(calls, same) == {"turns": 2, "mismatches": 0, "missing": 0}
    other = [{"prompt_token_ids": [[1], [1, 2, 9]], "completion_token_ids": [[2], [4]]}]
    assert check_rollout_details(calls, other) == {"turns": 2, "mismatches": 1, "missing": 1}
    later = [{"prompt_token_ids": [[1, 2, 3]], "completion_token_ids": [[4]]}]  # Harbor kept only the later turn
    assert check_rollout_details(calls, later) == {"turns": 1, "mismatches": 0, "missing": 1}
    assert check_rollout_details(calls, None) is None and check_rollout_details(calls, [{}]) is None


def test_the_capture_is_checked_against_the_agents_atif_trajectory() -> None:
    calls = [
        CapturedCall(0, {}, False, status=200, prompt_token_ids=[1], completion_token_ids=[2, 3]),
        CapturedCall(1, {}, False, status=500),
        CapturedCall(2, {}, False, status=200, prompt_token_ids=[1, 2, 3], completion_token_ids=[4]),
    ]

    def trajectory(*metrics: dict) -> dict:
        steps = [{"step_id": 1, "source": "user", "message": "task"}]
        steps += [{"step_id": i + 2, "source": "agent", "metrics": m} for i, m in enumerate(metrics)]
        return {"schema_version": "ATIF-v1.4", "steps": steps}

    by_ids = trajectory({"prompt_token_ids": [1], "completion_token_ids": [2, 3]}, {"prompt_token_ids": [1, 2, 3], "completion_token_ids": [4]})
    assert check_trajectory(calls, by_ids) == {"steps": 2, "mismatches": 0}
    by_counts = trajectory({"prompt_tokens": 1, "completion_tokens": 2}, {"prompt_tokens": 3, "completion_tokens": 1})
    assert check_trajectory(calls, by_counts) == {"steps": 2, "mismatches": 0}
    other = trajectory({"prompt_tokens": 1, "completion_tokens": 2}, {"prompt_token_ids": [1, 2, 9], "completion_token_ids": [4]})
    assert check_trajectory(calls, other) == {"steps": 2, "mismatches": 1}
    twice = trajectory({"prompt_tokens": 1, "completion_tokens": 2}, {"prompt_tokens": 1, "completion_tokens": 2})
    assert check_trajectory(calls, twice) == {"steps": 2, "mismatches": 1}  # one captured call answers one step
    assert check_trajectory(calls, None) is None and check_trajectory(calls, trajectory()) is None
    no_ids = [CapturedCall(0, {}, False, status=200)]  # a server that gave none (transformers serve)
    assert check_trajectory(no_ids, by_counts) is None  # nothing of the server's to check the counts by
