"""A deterministic OpenAI-compatible chat server for the evaluation tests (stdlib HTTP, 127.0.0.1 only).

It recognises a bundled task by its instruction (the start of the first user
message), answers with a real tool call that runs the task's
``solution/solve.sh`` through the harness's shell tool (``bash``, else
``run``), then, once it has seen the tool's output, ends the episode with a
plain reply. So a solved task's reward is the verifier's 1.0.

The model name chooses the behaviour (each is listed by ``/v1/models``):

- ``solver``: solves every task.
- ``quitter``: answers in prose, never calls a tool (reward 0).
- ``half``: solves the tasks at even positions of the suite, quits the others.
- ``misbehave``: first a tool call with malformed JSON arguments, then one to an
  unknown tool, then solves (both errors go back to the model as tool messages).
- ``flaky-429`` / ``flaky-500``: every distinct request fails once with 429 / 500, then succeeds.
- ``always-500``: every request fails with 500.
- ``slow``: solves, waiting ``slow_seconds`` before every reply.
- ``context``: solves, then refuses the next request as longer than the context.
- ``terminus``: speaks Harbor's terminus-2 JSON protocol (no tool calls): first a
  batch of keystrokes that runs the task's ``solve.sh``, then ``"task_complete": true``
  twice (terminus-2 asks for a confirmation).

With ``"stream": true`` the reply comes as server-sent events, as OpenAI's and vLLM's do (content in
pieces of 5 characters, a tool call as its name and then its arguments in two pieces); with
``"stream_whole": true`` too, as one JSON answer (a server that ignores ``stream``). As vLLM does,
``"return_token_ids": true`` adds the prompt's and the completion's token ids (here: the UTF-8 bytes of
the messages under :func:`chat_text` and of the reply's text, or of each tool call's name and arguments) and
``"logprobs": true`` one logprob per completion token.

Any other model name gets a 404, as vLLM answers. With ``api_key``, a chat
request with another key gets a 401 (as OpenAI's API answers). ``GET /stats`` returns the
requests seen per model. Run as a program for a managed-server test::

    python tests/scripted_server.py --port 8000 [--die-after N] [--suite PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MODELS = ("solver", "quitter", "half", "misbehave", "flaky-429", "flaky-500", "always-500", "slow", "context", "terminus", "terminus-forgetful")
EXAMPLE_SUITE = Path(__file__).resolve().parent.parent / "harbor_async" / "suites" / "example" / "tasks"


def load_solutions(suite: Path) -> list[tuple[str, str]]:
    """(instruction, solve.sh) of every task folder, in suite order (a multi-step task's: of each step)."""
    out = []
    for task in sorted(p for p in suite.iterdir() if (p / "task.toml").is_file()):
        steps = sorted(p for p in (task / "steps").glob("*") if (p / "instruction.md").is_file())
        for part in steps or [task]:
            out.append(((part / "instruction.md").read_text(), (part / "solution" / "solve.sh").read_text()))
    return out


class ScriptedServer:
    """The server; ``with ScriptedServer() as server: server.base_url``."""

    def __init__(
        self,
        suite: Path = EXAMPLE_SUITE,
        *,
        port: int = 0,
        slow_seconds: float = 1.0,
        die_after: int | None = None,
        api_key: str | None = None,
        models: str = "listed",
        refuse_fields: tuple[str, ...] = (),
    ) -> None:
        self.solutions = load_solutions(Path(suite))
        self.api_key = api_key  # chat requests with another key get a 401 (the model list answers anyway)
        #: ``/v1/models``: "listed" (every model), "empty" (none, as transformers serve of a local folder),
        #: "500" (an error, as transformers serve without its hub cache), "401" (the key is checked there too).
        self.models = models
        #: request fields answered with a 422 naming them, as ``transformers serve`` answers vLLM's ``return_token_ids``
        self.refuse_fields = refuse_fields
        self.slow_seconds = slow_seconds
        self.die_after = die_after
        self.requests: Counter[str] = Counter()
        self.tools: dict[str, list[dict[str, Any]]] = {}  # the tools of the latest request, per model
        self.seeds: set[int | None] = set()
        self.sampling: list[dict[str, Any]] = []  # temperature and top_p of every chat request, in arrival order
        #: (tool messages in the conversation so far, seed) of every chat request, in arrival order.
        self.seed_turns: list[tuple[int, int | None]] = []
        self.auth: set[str | None] = set()  # Authorization headers of chat requests
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ScriptedServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ── behaviour ────────────────────────────────────────────────────────

    def _first_time(self, body: dict[str, Any]) -> bool:
        """Whether this exact request (model + conversation) arrives for the first time."""
        digest = hashlib.sha256(json.dumps([body["model"], body["messages"]], sort_keys=True).encode()).hexdigest()
        with self._lock:
            if digest in self._seen:
                return False
            self._seen.add(digest)
            return True

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        model = body.get("model")
        refused = {name for name in self.refuse_fields if name in body}
        if refused:
            return 422, {"detail": f"Unexpected fields in the request: {refused}"}
        if model not in MODELS:
            return 404, _error(f"The model `{model}` does not exist.", "NotFoundError", 404)
        with self._lock:
            self.requests[model] += 1
            self.tools[model] = body.get("tools") or []
            self.seeds.add(body.get("seed"))
            self.sampling.append({key: body.get(key) for key in ("temperature", "top_p")})
            self.seed_turns.append((sum(1 for m in body["messages"] if m.get("role") == "tool"), body.get("seed")))
            total = sum(self.requests.values())
        if self.die_after is not None and total > self.die_after:
            os._exit(3)  # a crash, as a server killed by the OOM killer
        messages = body["messages"]
        if model == "slow":
            time.sleep(self.slow_seconds)
        if model == "always-500" or (model in ("flaky-429", "flaky-500") and self._first_time(body)):
            code = 429 if model == "flaky-429" else 500
            return code, _error("try again later", "RateLimitError" if code == 429 else "InternalServerError", code)
        if model in ("terminus", "terminus-forgetful"):
            return 200, _reply(body, messages, None, self._terminus(messages))
        tools = [t["function"]["name"] for t in body.get("tools") or []]
        tool_turns = sum(1 for m in messages if m.get("role") == "tool")
        if model == "context" and tool_turns >= 1:
            message = "This model's maximum context length is 64 tokens. However, you requested 9000 tokens."
            return 400, _error(message, "BadRequestError", 400)
        index, solution = self._task(messages[0].get("content") or "")
        solve = model != "quitter" and not (model == "half" and index % 2 == 1)
        if model == "misbehave" and tool_turns == 0:
            return 200, _reply(body, messages, [_call("bash" if "bash" in tools else tools[0], '{"command": "ls')])
        if model == "misbehave" and tool_turns == 1:
            return 200, _reply(body, messages, [_call("no_such_tool", '{"x": 1}')])
        solved_already = tool_turns >= (3 if model == "misbehave" else 1)
        if not solve or solution is None or solved_already:
            return 200, _reply(body, messages, None, "Done." if solve else "I think the answer is 42.")
        shell = "bash" if "bash" in tools else "run" if "run" in tools else tools[0]
        return 200, _reply(body, messages, [_call(shell, json.dumps({"command": solution}))])

    def _terminus(self, messages: list[dict[str, Any]]) -> str:
        """terminus-2's next JSON answer: run the solution, then mark the task complete (and confirm it)."""
        prompt = "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
        solution = next((s for instruction, s in self.solutions if instruction.strip() in prompt), None)
        answered = sum(1 for m in messages if m.get("role") == "assistant")
        if answered == 0 and solution is not None:
            lines = [line for line in solution.splitlines() if line.strip() and not line.lstrip().startswith("#")]
            commands = [{"keystrokes": line + "\n", "duration": 0.5} for line in lines]
            answer = {"analysis": "A fresh terminal.", "plan": "Run the solution.", "commands": commands, "task_complete": False}
        else:
            answer = {"analysis": "The solution ran.", "plan": "Nothing left to do.", "commands": [], "task_complete": True}
        return json.dumps(answer)

    def _task(self, prompt: str) -> tuple[int, str | None]:
        for index, (instruction, solution) in enumerate(self.solutions):
            if prompt.startswith(instruction):
                return index, solution
        return -1, None


def _error(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


_CALLS = Counter()


def _call(name: str, arguments: str) -> dict[str, Any]:
    _CALLS["n"] += 1
    return {"id": f"call_{_CALLS['n']}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _reply(body: dict[str, Any], messages: list[dict[str, Any]], calls, text: str | None = None) -> dict[str, Any]:
    completion = "".join(c["function"]["name"] + c["function"]["arguments"] for c in calls or []) or text or ""
    # As vLLM counts: the token ids this server gives (a trace checked against the agent's own usage agrees).
    prompt_tokens, completion_tokens = len(chat_ids(messages)), len(token_ids(completion))
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}
    reply = {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body["model"],
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    _add_tokens(body, reply, choice, completion)
    return reply


def token_ids(text: str) -> list[int]:
    """This server's "tokenizer": a text's UTF-8 bytes."""
    return list(text.encode())


def chat_text(messages: list[dict[str, Any]]) -> str:
    """This server's "chat template": each message as ``<|role|>`` and its text, then ``<|assistant|>``.

    As a real template does, a conversation extended by the model's answer and the next message renders as the
    earlier prompt, the answer, and what was added: the captured rows of an agent that keeps its history chain.
    """
    parts = []
    for message in messages:
        content = message.get("content")
        text = "".join(p.get("text", "") for p in content if isinstance(p, dict)) if isinstance(content, list) else content or ""
        text += "".join(c["function"]["name"] + c["function"]["arguments"] for c in message.get("tool_calls") or [])
        parts.append(f"<|{message.get('role')}|>{text}")
    return "".join(parts) + "<|assistant|>"


def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
    """The prompt token ids this server gives for ``messages``."""
    return token_ids(chat_text(messages))


def _add_tokens(body: dict[str, Any], reply: dict[str, Any], choice: dict[str, Any], completion: str) -> None:
    if body.get("return_token_ids"):
        messages = body["messages"]
        if body.get("model") == "terminus-forgetful":  # a template that drops earlier answers (as Qwen3's drops
            # earlier reasoning): a later call's prompt no longer extends the earlier prompt and answer
            messages = [{**m, "content": "..."} if m.get("role") == "assistant" else m for m in messages]
        reply["prompt_token_ids"] = chat_ids(messages)
        choice["token_ids"] = token_ids(completion)
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": str(b), "logprob": -0.125 * (b % 4)} for b in completion.encode()]}


def stream_events(body: dict[str, Any], reply: dict[str, Any]) -> bytes:
    """``reply`` as the server-sent events of a streamed answer, ``data: [DONE]`` last."""
    message = reply["choices"][0]["message"]
    head = {k: reply[k] for k in ("id", "created", "model")}
    pieces: list[dict[str, Any]] = [{"role": "assistant"}]
    texts = [""]
    content = message.get("content") or ""
    for start in range(0, len(content), 5):
        pieces.append({"content": content[start : start + 5]})
        texts.append(content[start : start + 5])
    for index, call in enumerate(message.get("tool_calls") or []):
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        half = len(arguments) // 2
        pieces.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function", "function": {"name": name, "arguments": arguments[:half]}}]})
        texts.append(name + arguments[:half])
        pieces.append({"tool_calls": [{"index": index, "function": {"arguments": arguments[half:]}}]})
        texts.append(arguments[half:])
    events = []
    for number, (delta, text) in enumerate(zip(pieces, texts)):
        chunk: dict[str, Any] = {**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        if number == 0 and "prompt_token_ids" in reply:
            chunk["prompt_token_ids"] = reply["prompt_token_ids"]
        if text:
            _add_tokens(body, {}, chunk["choices"][0], text)
        events.append(chunk)
    events.append({**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": reply["choices"][0]["finish_reason"]}]})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _handler(server: ScriptedServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: tests read /stats instead
            pass

        def _send(self, code: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                if server.models == "500":
                    self._send(500, _error("Traceback (most recent call last): hub cache not found", "InternalError", 500))
                elif server.models == "401" and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    self._send(401, _error("Incorrect API key provided", "invalid_request_error", 401))
                else:
                    listed = [] if server.models == "empty" else MODELS
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in listed]})
            elif self.path == "/stats":
                self._send(200, dict(server.requests))
            else:
                self._send(404, _error("not found", "NotFound", 404))

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path != "/v1/chat/completions":
                self._send(404, _error("not found", "NotFound", 404))
                return
            server.auth.add(self.headers.get("Authorization"))
            if server.api_key is not None and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                server.requests[body.get("model", "?")] += 1
                self._send(401, _error("Incorrect API key provided", "invalid_request_error", 401))
                return
            code, payload = server.chat(body)
            if code == 200 and body.get("stream") and not body.get("stream_whole"):  # stream_whole: a server that ignores stream
                data = stream_events(body, payload)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self._send(code, payload)

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--suite", type=Path, default=EXAMPLE_SUITE)
    parser.add_argument("--die-after", type=int, default=None, help="exit after this many chat requests")
    parser.add_argument("--slow-seconds", type=float, default=1.0)
    parser.add_argument("--tag", default="", help="ignored: lets a test find this process by its command line")
    parser.add_argument("--models", default="listed", choices=["listed", "empty", "500", "401"])
    args = parser.parse_args(argv)
    server = ScriptedServer(
        args.suite, port=args.port, slow_seconds=args.slow_seconds, die_after=args.die_after, models=args.models
    )
    print(f"scripted server on {server.base_url}", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
