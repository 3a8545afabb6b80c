"""The trainer's own model as an OpenAI-compatible chat server, in this process: on-policy rollouts without vLLM.

A Harbor agent (terminus-2) calls its model through the engine's capture proxy
(:mod:`harbor_async.models.capture`); with :class:`PolicyTransport` as the
proxy's upstream, each chat completion is answered by ``model.generate`` on the
trainer's current weights, with the trainer's sampling settings, and the reply
carries what vLLM's would when asked: the prompt's token ids (the model's chat
template over the request's messages and tools), the sampled ids and their
logprobs. The capture is exact, so nothing is re-tokenized.

It is an httpx transport, not a socket: only the proxy reaches it (the agent
reaches the proxy, on 127.0.0.1, with its episode's key). Generation runs in a
worker thread, one call at a time (one model), under ``torch.no_grad``; the
caller puts the model in eval mode for the rollouts (:mod:`shim.agent_rollouts`).
Tool calls are not parsed out of the text: the agents this serves (terminus-2)
read their commands from the message's content.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx


@dataclass(frozen=True)
class Sampling:
    """The trainer's sampling settings (``GRPOConfig``'s names), over the agent's own.

    The agent's temperature is not taken: TRL scores the tokens at its own. A request's ``max_tokens`` can only lower
    the cap.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 256

    @classmethod
    def of_trainer(cls, args: Any) -> Sampling:
        """The sampling of a ``GRPOConfig``: its temperature, top-p, top-k and ``max_completion_length``."""
        top_k = getattr(args, "top_k", None)
        return cls(
            temperature=float(getattr(args, "temperature", 1.0) or 1.0), top_p=float(getattr(args, "top_p", 1.0) or 1.0),
            top_k=int(top_k) if top_k else None, max_tokens=int(getattr(args, "max_completion_length", 256) or 256),
        )  # fmt: skip


@dataclass
class Generation:
    """One answered call: what the model read and sampled (kept for the caller's checks and metrics)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


@dataclass
class PolicyTransport(httpx.AsyncBaseTransport):
    """``POST /v1/chat/completions`` and ``GET /v1/models``, answered by ``model`` with ``tokenizer``'s chat template."""

    model: Any
    tokenizer: Any
    sampling: Sampling = field(default_factory=Sampling)
    model_name: str = "policy"
    generations: list[Generation] = field(default_factory=list)  # every call answered, in order
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [{"id": self.model_name, "object": "model"}]})
        if request.method != "POST" or not path.endswith("/chat/completions"):
            return _error(404, f"no route {request.method} {path}")
        try:
            body = json.loads(await request.aread())
            messages = body["messages"]
            if not isinstance(messages, list):
                raise TypeError("messages is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"not a chat completion request: {exc}")
        reply = await anyio.to_thread.run_sync(self._complete, body)
        if body.get("stream"):
            return httpx.Response(200, content=_as_stream(reply), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=reply)

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch

        tokenizer, sampling = self.tokenizer, self.sampling
        text = tokenizer.apply_chat_template(
            [plain_message(message) for message in body["messages"]], tools=body.get("tools") or None,
            add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        prompt_ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        limit = min(int(asked), sampling.max_tokens) if isinstance(asked, int) and asked > 0 else sampling.max_tokens
        temperature = sampling.temperature  # the trainer's, whatever the agent asks: its logprobs are the trainer's
        greedy = temperature <= 0
        with self._lock, torch.no_grad():
            device = next(self.model.parameters()).device
            inputs = torch.tensor([prompt_ids], device=device)
            out = self.model.generate(
                inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=limit, do_sample=not greedy,
                temperature=None if greedy else temperature, top_p=None if greedy else sampling.top_p,
                top_k=None if greedy else sampling.top_k, output_logits=True, return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
            completion = out.sequences[0, len(prompt_ids) :].tolist()
            logits = torch.stack(out.logits[: len(completion)], dim=0)[:, 0, :].float()
            scaled = logits if greedy else logits / temperature
            chosen = torch.tensor(completion, device=logits.device).unsqueeze(-1)
            logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, chosen).squeeze(-1).tolist()
        self.generations.append(Generation(list(prompt_ids), list(completion), list(logprobs)))
        finish = "stop" if completion and completion[-1] == tokenizer.eos_token_id else "length"
        tokens = tokenizer.convert_ids_to_tokens(completion)
        return {
            "id": f"chatcmpl-policy-{next(self._ids)}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "prompt_token_ids": prompt_ids,
            "choices": [{
                "index": 0, "finish_reason": finish, "token_ids": completion,
                "message": {"role": "assistant", "content": tokenizer.decode(completion, skip_special_tokens=True)},
                "logprobs": {"content": [{"token": t, "logprob": lp, "top_logprobs": []} for t, lp in zip(tokens, logprobs, strict=True)]},
            }],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion), "total_tokens": len(prompt_ids) + len(completion)},
        }  # fmt: skip


def plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of parts (LiteLLM sends some so) with the text parts joined."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return {**message, "content": text}
    return message


def _as_stream(reply: dict[str, Any]) -> bytes:
    """A whole reply as the SSE chunks vLLM sends: the content in one delta, then the finish and the usage."""
    choice = reply["choices"][0]
    head = {key: reply[key] for key in ("id", "created", "model")}
    chunks = [
        {**head, "object": "chat.completion.chunk", "prompt_token_ids": reply["prompt_token_ids"],
         "choices": [{"index": 0, "delta": choice["message"], "token_ids": choice["token_ids"], "logprobs": choice["logprobs"]}]},
        {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]},
        {**head, "object": "chat.completion.chunk", "choices": [], "usage": reply["usage"]},
    ]  # fmt: skip
    return b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "invalid_request_error"}})
