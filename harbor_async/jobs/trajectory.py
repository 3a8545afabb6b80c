"""A harness's conversation as Harbor's agent trajectory (ATIF, ``agent/trajectory.json``), for Harbor's viewer.

The record keeps the OpenAI chat messages the model saw and wrote; Harbor's
viewer shows an agent's steps from ``trajectory.json`` (Harbor's
``Trajectory`` model): each system or user message is a step, each assistant
message a step of the agent with its tool calls, and the tool messages that
answer them are that step's observation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harbor_async.core.records import EpisodeRecord


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return {"raw": str(raw)}
    return value if isinstance(value, dict) else {"value": value}


def trajectory(record: EpisodeRecord) -> Any:
    """Harbor's ``Trajectory`` of the record's transcript."""
    from harbor.models.trajectories.agent import Agent
    from harbor.models.trajectories.observation import Observation
    from harbor.models.trajectories.observation_result import ObservationResult
    from harbor.models.trajectories.step import Step
    from harbor.models.trajectories.tool_call import ToolCall
    from harbor.models.trajectories.trajectory import Trajectory

    steps: list[Step] = []
    for message in record.transcript or []:
        role = message.get("role")
        if role == "tool" and steps and steps[-1].source == "agent":
            last = steps[-1]
            results = [*(last.observation.results if last.observation else [])]
            results.append(ObservationResult(source_call_id=message.get("tool_call_id"), content=_text(message.get("content"))))
            last.observation = Observation(results=results)
            continue
        source = {"system": "system", "user": "user", "tool": "user"}.get(str(role), "agent")
        calls = [
            ToolCall(
                tool_call_id=str(call.get("id") or index),
                function_name=str((call.get("function") or {}).get("name", "")),
                arguments=_arguments((call.get("function") or {}).get("arguments")),
            )
            for index, call in enumerate(message.get("tool_calls") or [])
        ]
        steps.append(
            Step(
                step_id=len(steps) + 1,
                source=source,
                message=_text(message.get("content")),
                model_name=record.model if source == "agent" else None,
                tool_calls=calls or None,
            )
        )
    return Trajectory(
        session_id=record.sandbox or record.key,
        agent=Agent(name=record.agent or "harness", version="unknown", model_name=record.model),
        steps=steps,
    )


def write_trajectory(path: Path, record: EpisodeRecord) -> None:
    """Write the record's transcript to ``path`` as Harbor's trajectory (nothing if it has none)."""
    if not record.transcript:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trajectory(record).model_dump_json(indent=2, exclude_none=True), encoding="utf-8")
