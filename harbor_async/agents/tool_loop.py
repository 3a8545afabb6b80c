"""The evaluation agent: an async tool-calling loop against an OpenAI-compatible server.

The model sees what it saw in training (TRL's ``GRPOTrainer`` with a shim
harness as ``environment_factory``):

- the tools are the harness's public functions, listed as TRL lists them
  (``inspect.getmembers(type(env), inspect.isfunction)`` minus ``reset``,
  ``get_reward`` and ``_private`` names), each described by transformers'
  ``get_json_schema``;
- the prompt is one user message: the task instruction + ``PROMPT_SUFFIX``
  (what ``env.reset()`` returns, appended to the dataset's empty user message);
- a tool result is ``str(result)``; a failing or unknown tool is
  ``str({"error": message})``, TRL's text for a tool that raised.

Tool calls of one reply run one after another (tools may share state);
sync tool methods run in worker threads under the caller's limiter, never on
the event loop. A failed request is judged by :mod:`harbor_async.models.model_server`
(by type and HTTP status, as for Harbor's agents): a transient error (408, 409,
429, 5xx, timeouts, connection resets) is retried with tenacity, and when the
retries run out the episode ends with :class:`ModelServerError` (a model-server
failure, rerun by a resume); a refused configuration (401, 403, 404, another
4xx) ends it at once with :class:`~harbor_async.core.errors.ModelServerConfigError`
(the run stops); the model's own refusal (its context outgrown, its malformed
tool call) ends the loop and the episode is scored.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import openai
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from harbor_async.core.errors import ModelServerError
from harbor_async.core.moved import renamed_attribute
from harbor_async.harnesses.toolset import Toolset, build_toolset
from harbor_async.jobs.setting_fields import AgentLimits, Sampling
from harbor_async.models.model_server import (
    ServerVerdict,
    classify,
    is_context_overflow,
    model_server_error,
)

if TYPE_CHECKING:
    from openai import AsyncOpenAI


def initial_messages(observation: str) -> list[dict[str, Any]]:
    """TRL's prompt: the dataset's empty user message with ``reset()``'s text appended."""
    return [{"role": "user", "content": "" + observation}]


def tool_error_text(message: str) -> str:
    """The text TRL sends back for a tool that raised or does not exist."""
    return str({"error": message})


@dataclass
class AgentResult:
    """What one episode's loop produced.

    ``finish_reason``: ``stop`` (a reply without tool calls), ``length`` (a
    reply cut by ``max_tokens`` without tool calls), ``max_turns``,
    ``max_total_tokens``, ``context_length`` (the server refused the prompt as
    too long; the episode is scored), ``invalid_tool_call`` (the server refused a
    conversation holding a tool call of the model's whose arguments are no JSON
    object; scored), ``agent_timeout``, ``episode_deadline`` (set by the caller
    when the engine's episode deadline was the tighter bound) or ``model_server``
    (retries ran out, or the server refused its configuration: see ``error``, a
    :class:`~harbor_async.core.errors.ModelServerConfigError` then).
    """

    messages: list[dict[str, Any]]
    finish_reason: str = "stop"
    usage: dict[str, int] = field(default_factory=dict)
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    model_seconds: float = 0.0
    tool_seconds: float = 0.0
    error: ModelServerError | None = None


def _retryable(exc: BaseException) -> bool:
    # Only what may work on another try: a refused key or request would be refused again.
    return classify(exc) is ServerVerdict.TRANSIENT


class _ModelRefusal(Exception):
    """The server refused the request for the model's own doing: the loop ends with ``reason``, scored."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ToolLoop:
    """Runs episodes of one model against one server.

    Args:
        client: the ``openai.AsyncOpenAI`` client (its own retries off: tenacity retries here).
        model: the model name sent with every request.
        sampling: sampling options.
        limits: loop limits and retries.
        request_limiter: bounds model requests in flight across episodes.
        tool_limiter: bounds worker threads running sync tool methods.
    """

    def __init__(
        self,
        client: AsyncOpenAI,
        model: str,
        *,
        sampling: Sampling | None = None,
        limits: AgentLimits | None = None,
        request_limiter: anyio.CapacityLimiter | None = None,
        tool_limiter: anyio.CapacityLimiter | None = None,
    ) -> None:
        self.client = client
        self.model = model
        self.sampling = sampling or Sampling()
        self.limits = limits or AgentLimits()
        self.request_limiter = request_limiter or anyio.CapacityLimiter(16)
        self.tool_limiter = tool_limiter or anyio.CapacityLimiter(16)
        self.retries_used = 0

    async def run(
        self, env: object, observation: str, *, timeout: float | None = None, sampling: Sampling | None = None
    ) -> AgentResult:
        """Run the loop for one reset harness ``env`` whose ``reset()`` returned ``observation``.

        ``sampling`` overrides the agent's for this episode (a per-attempt
        seed); it is passed down the episode's calls, never kept on the agent,
        which concurrent episodes share. Never raises for the model's or the tools' misbehaviour: the
        outcome is in the result. Cancellation propagates.
        """
        toolset = build_toolset(env)
        result = AgentResult(messages=initial_messages(observation))
        budget = timeout if timeout is not None else self.limits.timeout
        with anyio.move_on_after(budget if budget is not None else float("inf")) as scope:
            await self._loop(toolset, result, sampling or self.sampling)
        if scope.cancelled_caught:
            result.finish_reason = "agent_timeout"
        return result

    async def _loop(self, toolset: Toolset, result: AgentResult, sampling: Sampling) -> None:
        usage = result.usage
        while True:
            if result.turns >= self.limits.max_turns:
                result.finish_reason = "max_turns"
                return
            started = time.perf_counter()
            try:
                response = await self._complete(result.messages, toolset.schemas, usage, sampling)
            except _ModelRefusal as refusal:
                result.finish_reason = refusal.reason
                return
            except ModelServerError as exc:
                result.finish_reason, result.error = "model_server", exc
                return
            finally:
                result.model_seconds += time.perf_counter() - started
            result.turns += 1
            if response.usage is not None:
                for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                    usage[key] = usage.get(key, 0) + int(getattr(response.usage, key, 0) or 0)
                usage["last_total_tokens"] = int(response.usage.total_tokens or 0)
            if not response.choices:  # a server bug, not the model's answer
                result.finish_reason = "model_server"
                result.error = ModelServerError(f"model {self.model!r}: a reply without choices")
                return
            choice = response.choices[0]
            message = choice.message
            calls = list(message.tool_calls or [])
            assistant: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
            if calls:
                assistant["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                    for call in calls
                ]
            assistant["finish_reason"] = choice.finish_reason
            result.messages.append(assistant)
            if not calls:
                result.finish_reason = "length" if choice.finish_reason == "length" else "stop"
                return
            for call in calls:  # in order: a tool may depend on the previous one's effect
                started = time.perf_counter()
                text, failed = await self._call_tool(toolset, call.function.name, call.function.arguments)
                result.tool_seconds += time.perf_counter() - started
                result.tool_calls += 1
                result.tool_failures += failed
                result.messages.append(
                    {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": text}
                )
            limit = self.limits.max_total_tokens
            if limit is not None and usage.get("last_total_tokens", 0) >= limit:
                result.finish_reason = "max_total_tokens"
                return

    async def _complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], usage: dict[str, int], sampling: Sampling
    ):
        # What the server sees: OpenAI's message shape (our bookkeeping keys stripped).
        wire = [{k: v for k, v in m.items() if k != "finish_reason"} for m in messages]
        retrying = AsyncRetrying(
            retry=retry_if_exception(_retryable),
            stop=stop_after_attempt(self.limits.retries + 1),
            # exponential backoff with jitter, so that many episodes do not retry in lockstep
            wait=wait_exponential(multiplier=0.5, max=self.limits.retry_max_wait) + wait_random(0, 0.25),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        usage["retries"] = usage.get("retries", 0) + 1
                        self.retries_used += 1
                    usage["requests"] = usage.get("requests", 0) + 1
                    async with self.request_limiter:
                        return await self.client.chat.completions.create(
                            model=self.model, messages=wire, tools=tools, **sampling.request_kwargs()  # type: ignore[arg-type]  # plain dicts for OpenAI's TypedDicts
                        )
        except openai.APIError as exc:
            verdict = classify(exc, wire)
            if verdict is ServerVerdict.MODEL:
                raise _ModelRefusal("context_length" if is_context_overflow(exc) else "invalid_tool_call") from exc
            # transient after its retries (ModelServerError), or a refused configuration (ModelServerConfigError)
            raise model_server_error(exc, self.model, verdict) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call_tool(self, toolset: Toolset, name: str, arguments: str | None) -> tuple[str | list[Any], bool]:
        """Run one tool call; return the text for the model and whether the call failed."""
        try:
            args = json.loads(arguments or "{}")
        except ValueError as exc:
            return tool_error_text(f"Invalid JSON in the arguments of tool {name}: {exc}"), True
        if not isinstance(args, dict):
            return tool_error_text(f"The arguments of tool {name} must be a JSON object, got {args!r}"), True
        try:
            if name in toolset.sync:
                fn = functools.partial(toolset.sync[name], **args)
                value = await anyio.to_thread.run_sync(fn, limiter=self.tool_limiter, abandon_on_cancel=True)
            elif name in toolset.async_:
                value = await toolset.async_[name](**args)
            else:
                raise ValueError(f"Tool {name} not found.")
        except Exception as exc:  # as TRL: any tool failure is text for the model
            return tool_error_text(str(exc)), True
        return (value if isinstance(value, list) else str(value)), False

if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any name as defined

    def __getattr__(name: str) -> Any:
        """The old class names of the move (one release, with a DeprecationWarning)."""
        return renamed_attribute(__name__, name)
