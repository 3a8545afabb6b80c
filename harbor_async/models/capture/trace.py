"""What the capture proxy records of one model call, and how a streamed reply is put back together.

A call's record keeps what the agent sent (its messages, tools and
parameters), what it got back (one ``chat.completion``, assembled from the
chunks when the reply was streamed) and the tokens where the server returned
them: vLLM gives the prompt's and the completion's token ids when asked
(``return_token_ids``), and any OpenAI-compatible server gives per-token
logprobs when asked (``logprobs``). A call without them is marked so
(:attr:`CapturedCall.tokens_from_server` is false): such an episode is
re-tokenized later with the model's own tokenizer, never trained on as if the
server had said what it sampled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CapturedCall:
    """One chat completion the agent asked for, as forwarded and as answered."""

    index: int  # its place in the session, from 0
    request: dict[str, Any]  # the body the agent sent (before the proxy's own additions)
    streamed: bool
    status: int = 0  # the upstream's HTTP status (0: no answer, see ``error``)
    reply: dict[str, Any] | None = None  # the chat.completion (assembled when streamed), or the error body
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None  # one per completion token
    seconds: float = 0.0
    error: str | None = None  # why there is no reply: unreachable, over time, over size

    @property
    def tokens_from_server(self) -> bool:
        """Whether the server said which tokens it took and sampled (else: to be re-tokenized)."""
        return self.prompt_token_ids is not None and self.completion_token_ids is not None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_from_server": self.tokens_from_server}


@dataclass
class CaptureSession:
    """The calls of one episode's agent; its :attr:`api_key` is what the agent authenticates with."""

    name: str
    api_key: str
    calls: list[CapturedCall] = field(default_factory=list)
    refused: int = 0  # requests refused by a bound (size, count), never forwarded
    #: a closed session's key is refused (401), as an unknown one: its agent is not acting (between the steps of
    #: a task, after its episode), so nothing it left running can add calls to the episode's record
    closed: bool = False

    @property
    def retokenize(self) -> bool:
        """Some answered call lacks the server's token ids: the episode must be re-tokenized to be trained on."""
        return any(call.status == 200 and not call.tokens_from_server for call in self.calls)

    def to_json(self, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The session as JSON; ``calls``: the calls as JSON already (a part of them, say), else all of them."""
        return {
            "name": self.name, "refused": self.refused, "retokenize": self.retokenize,
            "calls": [call.to_json() for call in self.calls] if calls is None else calls,
        }  # fmt: skip


def read_tokens(call: CapturedCall, reply: dict[str, Any]) -> None:
    """Take the token ids and logprobs of a non-streamed ``reply`` (its first choice) into ``call``."""
    call.prompt_token_ids = _ints(reply.get("prompt_token_ids"))
    choices = reply.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    call.completion_token_ids = _ints(choice.get("token_ids"))
    call.logprobs = _logprobs(choice.get("logprobs"))


class StreamAssembler:
    """Feed it the ``data:`` payloads of a streamed reply; :meth:`reply` is then the same as unstreamed.

    Content and tool-call argument fragments are joined per choice index and
    tool-call index, as OpenAI's clients join them; vLLM's ``prompt_token_ids``
    (first chunk) and ``token_ids`` (each chunk's choice) are joined too.
    """

    def __init__(self) -> None:
        self._head: dict[str, Any] = {}
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._role = "assistant"
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._finish: str | None = None
        self._token_ids: list[int] | None = None
        self._logprobs: list[float] | None = None
        self._prompt_token_ids: list[int] | None = None
        self._usage: Any = None

    def feed(self, chunk: dict[str, Any]) -> None:
        if not self._head:
            self._head = {k: chunk.get(k) for k in ("id", "created", "model", "system_fingerprint") if k in chunk}
        if chunk.get("prompt_token_ids") is not None:
            self._prompt_token_ids = _ints(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # the first choice is the one an agent acts on
            delta = choice.get("delta") or {}
            self._role = delta.get("role") or self._role
            if delta.get("content"):
                self._content.append(delta["content"])
            for key in ("reasoning_content", "reasoning"):
                if delta.get(key):
                    self._reasoning.append(delta[key])
            for part in delta.get("tool_calls") or []:
                self._add_tool_call(part)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
            ids = _ints(choice.get("token_ids"))
            if ids is not None:
                self._token_ids = (self._token_ids or []) + ids
            values = _logprobs(choice.get("logprobs"))
            if values is not None:
                self._logprobs = (self._logprobs or []) + values

    def _add_tool_call(self, part: dict[str, Any]) -> None:
        slot = self._tool_calls.setdefault(
            part.get("index", len(self._tool_calls)), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if part.get("id"):
            slot["id"] = part["id"]
        function = part.get("function") or {}
        slot["function"]["name"] += function.get("name") or ""
        slot["function"]["arguments"] += function.get("arguments") or ""

    def fill(self, call: CapturedCall) -> None:
        """Put the assembled reply and its tokens into ``call``."""
        message: dict[str, Any] = {"role": self._role, "content": "".join(self._content) or None}
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._tool_calls:
            message["tool_calls"] = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        call.reply = {
            **self._head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": self._finish}],
            **({"usage": self._usage} if self._usage else {}),
        }  # fmt: skip
        call.prompt_token_ids, call.completion_token_ids, call.logprobs = (
            self._prompt_token_ids, self._token_ids, self._logprobs
        )


def parse_event_data(line: bytes) -> dict[str, Any] | None:
    """The JSON of one SSE ``data:`` line (``None``: another field, ``[DONE]``, or not JSON)."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return None
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _logprobs(value: Any) -> list[float] | None:
    """The sampled tokens' logprobs of an OpenAI ``logprobs`` object (``{"content": [{"logprob": x}, ...]}``)."""
    if not isinstance(value, dict) or not isinstance(value.get("content"), list):
        return None
    found = [entry.get("logprob") for entry in value["content"] if isinstance(entry, dict)]
    numbers = [float(v) for v in found if isinstance(v, (int, float))]
    return numbers if len(numbers) == len(found) else None


def check_rollout_details(calls: list[CapturedCall], details: Any) -> dict[str, int] | None:
    """The captured calls against the agent's own record of its ids (Harbor's ``rollout_details``, terminus-2's).

    Harbor's first ``RolloutDetail`` is the main conversation, one entry per turn it kept (terminus-2 keeps
    the turns of its chat, not the calls it repeats after a reply it could not parse). ``turns``: Harbor's
    turns; ``mismatches``: those with no captured call of the same prompt and completion ids (the two records
    disagree); ``missing``: answered calls with ids that Harbor's record does not hold. ``None``: the agent
    recorded no ids.
    """
    if not isinstance(details, list) or not details or not isinstance(details[0], dict):
        return None
    main = details[0]
    turns = list(zip(main.get("prompt_token_ids") or [], main.get("completion_token_ids") or []))
    if not turns:
        return None
    ours = [
        (tuple(call.prompt_token_ids or ()), tuple(call.completion_token_ids or ()))
        for call in calls if call.status == 200 and call.tokens_from_server
    ]  # fmt: skip
    unmatched = list(ours)
    mismatches = 0
    for prompt, completion in turns:
        key = (tuple(prompt), tuple(completion))
        if key in unmatched:
            unmatched.remove(key)
        else:
            mismatches += 1
    return {"turns": len(turns), "mismatches": mismatches, "missing": len(unmatched)}


def check_trajectory(calls: list[CapturedCall], trajectory: Any) -> dict[str, int] | None:
    """The captured calls against the agent's ATIF trajectory (``agent/trajectory.json``, terminus-2's).

    Each agent step that reports its model call's ``metrics`` is matched with a captured call, in order:
    by the ids where the step holds them (``prompt_token_ids`` and ``completion_token_ids``, written when
    the agent collects its rollout details), else by the counts (``prompt_tokens``, ``completion_tokens``)
    against the captured ids' lengths, for the calls whose ids came from the server. ``steps``: the agent
    steps with metrics; ``mismatches``: those whose ids or counts no captured call has. ``None``: no
    trajectory, no step with metrics, or no call whose ids came from the server.
    """
    steps = trajectory.get("steps") if isinstance(trajectory, dict) else None
    measured = [
        step["metrics"] for step in steps or []
        if isinstance(step, dict) and step.get("source") == "agent" and isinstance(step.get("metrics"), dict)
    ]  # fmt: skip
    if not measured:
        return None
    ours = [call for call in calls if call.status == 200 and call.tokens_from_server]
    if not ours:  # a server that gave no ids: the capture's are re-tokenized, not the server's, so nothing to match
        return None
    by_ids = [(tuple(c.prompt_token_ids or ()), tuple(c.completion_token_ids or ())) for c in ours]
    by_counts = [(len(c.prompt_token_ids or ()), len(c.completion_token_ids or ())) for c in ours]
    mismatches = 0
    for metrics in measured:
        prompt, completion = metrics.get("prompt_token_ids"), metrics.get("completion_token_ids")
        if isinstance(prompt, list) and isinstance(completion, list):
            key: tuple[Any, Any] = (tuple(prompt), tuple(completion))
            pool: list[Any] = by_ids
        else:
            key, pool = (metrics.get("prompt_tokens"), metrics.get("completion_tokens")), by_counts
        if key in pool:
            index = pool.index(key)
            del by_ids[index], by_counts[index]
        else:
            mismatches += 1
    return {"steps": len(measured), "mismatches": mismatches}
