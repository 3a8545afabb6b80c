"""One tool round of TRL 1.16's GRPOTrainer, all rollouts at once: TRL's per-rollout body, verbatim.

No torch or trl import here (the GRPO-step replay uses it too); the loop that
calls it is :mod:`shim.tool_rounds`. Within a rollout, :func:`call_rollout_tools`
is TRL's code: calls in order, sync results before async ones (gathered on TRL's
event loop), ``{"error": str(e)}`` results and TRL's call and failure counts.
Different rollouts run at the same time on a thread pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

#: One rollout's round: its tool calls, its sync tools and its async tools (by name).
RolloutCalls = tuple[list[dict[str, Any]], Mapping[str, Callable[..., Any]], Mapping[str, Callable[..., Any]]]
#: What one rollout's round gives back: ``(name, result)`` pairs in TRL's order, calls, failures.
RolloutOutcome = tuple[list[tuple[str, Any]], int, int]


def call_rollout_tools(
    tool_call_list: list[dict[str, Any]],
    sync_tool_dict: Mapping[str, Callable[..., Any]],
    async_tool_dict: Mapping[str, Callable[..., Any]],
    async_loop: asyncio.AbstractEventLoop | None,
) -> RolloutOutcome:
    """One rollout's tool calls of one round: TRL 1.16's per-rollout body, verbatim.

    Sync tools run in call order as they come; async ones are collected and
    gathered afterwards on ``async_loop`` (TRL's daemon loop), so their results
    follow every sync result. A tool that raises, an unknown tool and a call of
    another type become ``{"error": ...}`` results and count as failures.
    """
    async_coros = []
    tool_call_results: list[tuple[str, Any]] = []
    tool_call_count = 0
    tool_failure_count = 0
    for tool_call in tool_call_list:
        tool_call_count += 1
        if tool_call["type"] == "function":
            function = tool_call["function"]
            name = function["name"]
            try:
                if name in sync_tool_dict:
                    tool_call_results.append((name, sync_tool_dict[name](**function["arguments"])))
                elif name in async_tool_dict:
                    async_coros.append((name, async_tool_dict[name](**function["arguments"])))
                else:
                    raise ValueError(f"Tool {name} not found.")
            except Exception as e:  # noqa: BLE001 - TRL turns every tool error into a message
                tool_failure_count += 1
                result = {"error": str(e)}
                tool_call_results.append((name, result))
        else:
            tool_failure_count += 1
            name = tool_call.get("name", "unknown")
            tool_call_results.append((name, {"error": f"Unsupported tool call type: {tool_call['type']}"}))

    if async_coros:

        async def _run_async_tools(async_coros):
            coros = [coro for _, coro in async_coros]
            results = await asyncio.gather(*coros, return_exceptions=True)
            return [(name, result) for (name, _), result in zip(async_coros, results, strict=False)]

        assert async_loop is not None  # TRL starts its loop whenever a tool is async
        async_results = asyncio.run_coroutine_threadsafe(_run_async_tools(async_coros), async_loop).result()

        for name, result in async_results:
            if isinstance(result, Exception):
                tool_failure_count += 1
                tool_call_results.append((name, {"error": str(result)}))
            else:
                tool_call_results.append((name, result))
    return tool_call_results, tool_call_count, tool_failure_count


def run_tool_round(
    rollouts: Sequence[RolloutCalls],
    async_loop: asyncio.AbstractEventLoop | None,
    pool: ThreadPoolExecutor | None,
) -> list[RolloutOutcome]:
    """Every rollout's calls of one round, the rollouts at once on ``pool``; outcomes in rollout order.

    Without a pool (or with a single rollout) the rollouts run one after
    another on the caller's thread, exactly as TRL does. An exception that
    TRL would not catch (a malformed call) is raised once every rollout has
    returned, the first in rollout order.
    """
    if pool is None or len(rollouts) < 2:
        return [call_rollout_tools(calls, sync, asyn, async_loop) for calls, sync, asyn in rollouts]
    futures = [pool.submit(call_rollout_tools, calls, sync, asyn, async_loop) for calls, sync, asyn in rollouts]
    wait(futures)  # every rollout finishes before any error surfaces: no call is left running
    return [future.result() for future in futures]
