"""Data embedded in the page: the index as inert JSON, each episode's details gzip-compressed.

An episode's transcript, verifier output and phases are compressed one episode
at a time (gzip, then base64) and decoded by the page only when the episode is
opened (the browser's ``DecompressionStream``), so a job of 10,000 long
transcripts parses and paints in a few seconds: the browser never builds them
until asked.
"""

from __future__ import annotations

import base64
import gzip
import json
from typing import Any

from harbor_async.core.records import EpisodeRecord
from harbor_async.report.analysis import episode_phases

# In a <script type="application/json"> block the only danger is text that ends
# the block ("</script>") or opens a comment ("<!--"): JSON may spell every "<",
# ">" and "&" as a \u escape, which leaves nothing the HTML parser acts on.
_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def script_json(data: Any) -> str:
    """``data`` as JSON safe to place inside a ``<script type="application/json">`` element."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=_default).translate(_ESCAPES)


def _default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, tuple | set):
        return list(value)
    raise TypeError(f"cannot embed {type(value).__name__} in the report")


def episode_details(record: EpisodeRecord) -> dict[str, Any]:
    """What the episode view shows beyond the index row."""
    return {
        "task": record.task,
        "task_path": record.task_path,
        "attempt": record.attempt,
        "agent": record.agent,
        "model": record.model,
        "checkpoint": record.checkpoint,
        "reward": record.reward,
        "rewards": record.rewards,
        "error_class": record.error_class,
        "error_phase": record.error_phase,
        "error_type": record.error_type,
        "error": record.error,
        "sandbox": record.sandbox,
        "start_attempts": record.start_attempts,
        "started_at": record.started_at,
        "phases": episode_phases(record),
        "verifier_output": record.verifier_output,
        "transcript": record.transcript or [],
        "usage": record.usage,
        "finish_reason": record.finish_reason,
        "steps": record.steps,
        "resources": record.resources,
    }


def pack_episode(record: EpisodeRecord) -> str:
    """The episode's details as base64 of gzip of JSON (ASCII only: inert in any HTML context)."""
    raw = json.dumps(episode_details(record), ensure_ascii=False, separators=(",", ":"), default=_default)
    # mtime=0: the same records give the same report, byte for byte.
    return base64.b64encode(gzip.compress(raw.encode("utf-8"), compresslevel=6, mtime=0)).decode("ascii")


def unpack_episode(blob: str) -> dict[str, Any]:
    """Inverse of :func:`pack_episode` (for tests and tools)."""
    return json.loads(gzip.decompress(base64.b64decode(blob)).decode("utf-8"))
