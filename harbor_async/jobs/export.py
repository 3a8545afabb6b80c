"""A job's captured episodes as a Hugging Face ``datasets`` dataset (``harbor-async export``).

For SFT, rejection sampling or offline RL on what an agent did: one row per
captured episode (``--capture``) that was judged, with its task, attempt,
agent, model and reward, and its model calls in order. A call keeps the
request and the reply (as JSON text: messages and tool calls vary in shape)
and, where the server gave them, the token ids and the completion's logprobs.
Who made which tokens follows from where they are: a call's
``prompt_token_ids`` are the environment's and the agent's scaffolding (the
chat template over the conversation so far), its ``completion_token_ids``
the model's. ``retokenize`` marks an episode whose server gave no token ids
(null there): tokenize it with the model's own tokenizer before training on it.

Each row also holds the episode as one training sequence, as the trainer's
agent path builds it (:func:`~harbor_async.models.capture.rows.token_row`):
``prompt_ids``, ``completion_ids``, ``env_mask`` (1: the model's token, 0: the
environment's or the scaffolding's), ``logprobs`` and ``dropped_calls`` (calls
after the agent re-templated its history); null without the server's ids.

Episodes not judged (the infrastructure's, a model server's, cancelled) are
left out, as the trainer leaves them out of the loss; ``--all`` keeps them
(reward null).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.records import EpisodeRecord
from harbor_async.jobs.folder import EPISODES_NAME, latest_records, read_records
from harbor_async.models.capture.rows import token_row


class ExportError(HarborAsyncError, ValueError):
    """Nothing to export: not a job folder, or no captured episode in it."""


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote and left out."""

    rows: int
    calls: int
    not_judged: int  # captured but not judged: left out (kept with ``include_unjudged``)
    not_captured: int  # episodes run without --capture
    retokenize: int  # rows whose server gave no token ids


def captured_rows(job: Path, *, include_unjudged: bool = False) -> Iterator[dict[str, Any]]:
    """The rows of :func:`export_job`, one per captured episode (the last record of each), in the job's order."""
    for record in latest_records(read_records(job / EPISODES_NAME)).values():
        if record.capture is None or (not record.judged and not include_unjudged):
            continue
        yield _row(job, record)


def _row(job: Path, record: EpisodeRecord) -> dict[str, Any]:
    raw: list[dict[str, Any]] = []
    assert record.capture is not None
    for name in record.capture.get("files", []):
        path = job / (record.trial or "") / name
        try:
            captured = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ExportError(f"episode {record.key}: cannot read {path}: {exc}") from exc
        raw += [call for call in captured.get("calls", []) if isinstance(call, dict)]
    row = token_row(raw)  # the server's ids only: a call without them ends the sequence (retokenize)
    return {
        "task": record.task_path or record.task, "attempt": record.attempt, "agent": record.agent, "model": record.model,
        "reward": record.reward, "rewards": json.dumps(record.rewards), "judged": record.judged,
        "retokenize": bool(record.capture.get("retokenize")), "calls": [_call(call) for call in raw],
        "prompt_ids": row.prompt_ids if row else None, "completion_ids": row.completion_ids if row else None,
        "env_mask": row.env_mask if row else None, "logprobs": row.logprobs if row else None,
        "dropped_calls": row.dropped if row else None,
    }  # fmt: skip


def _call(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "request": json.dumps(call.get("request"), ensure_ascii=False),
        "reply": json.dumps(call.get("reply"), ensure_ascii=False),
        "status": call.get("status", 0),
        "prompt_token_ids": call.get("prompt_token_ids"),
        "completion_token_ids": call.get("completion_token_ids"),
        "logprobs": call.get("logprobs"),
    }


def export_job(job: Path, out: Path, *, include_unjudged: bool = False) -> ExportSummary:
    """Write the job's captured episodes to ``out`` as a ``datasets`` dataset (``datasets.load_from_disk(out)``).

    Raises:
        ExportError: ``job`` has no ``episodes.jsonl``, or no captured episode to write.
        ImportError: ``datasets`` is not installed (the ``trl`` extra).
    """
    import datasets

    if not (job / EPISODES_NAME).is_file():
        raise ExportError(f"{job} is not a job folder (no {EPISODES_NAME})")
    latest = latest_records(read_records(job / EPISODES_NAME)).values()
    captured = [r for r in latest if r.capture is not None]
    rows = list(captured_rows(job, include_unjudged=include_unjudged))
    if not rows:
        why = "none of its episodes was captured (run it with --capture)" if not captured else "no captured episode was judged (--all keeps them)"
        raise ExportError(f"nothing to export from {job}: {why}")
    datasets.Dataset.from_list(rows).save_to_disk(str(out))
    return ExportSummary(
        rows=len(rows), calls=sum(len(row["calls"]) for row in rows),
        not_judged=sum(1 for r in captured if not r.judged) if not include_unjudged else 0,
        not_captured=len(latest) - len(captured), retokenize=sum(1 for row in rows if row["retokenize"]),
    )  # fmt: skip
