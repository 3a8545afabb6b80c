"""The capture proxy between an agent and a real model server (the scripted one): what it forwards, records and refuses.

The agent's side is the ``openai`` client, as Harbor's agents use it (or
httpx where the test needs the raw answer); the model server is
``tests/scripted_server.py`` over real HTTP, speaking vLLM's token fields when asked.
"""

from __future__ import annotations

import json
import socket
import struct

import anyio
import anyio.abc
import httpx
import openai
import pytest

from harbor_async.models.capture import CaptureLimits, CaptureProxy, CaptureProxyError
from harbor_async.suites import example_suite_path
from tests.scripted_server import ScriptedServer, chat_ids, load_solutions, token_ids

VLLM_TOKENS = {"logprobs": True, "return_token_ids": True}
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def _instruction() -> str:
    return load_solutions(example_suite_path() / "tasks")[0][0]


def _messages() -> list[dict]:
    return [{"role": "user", "content": _instruction()}]


def _client(proxy: CaptureProxy, key: str) -> openai.AsyncOpenAI:
    """The agent's client; use it in ``async with``: one left open is closed by its ``__del__`` in whichever loop
    is running when it is collected (another test's), where its connections' closed loop raises."""
    return openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)


async def _ask(proxy: CaptureProxy, key: str, **request: object) -> object:
    """One chat completion from a client of its own, closed before the answer is returned."""
    async with _client(proxy, key) as client:
        return await client.chat.completions.create(**request)


@pytest.fixture
def server():
    with ScriptedServer(api_key="upstream-secret") as running:
        yield running


def test_a_call_is_forwarded_and_recorded_with_the_servers_tokens(server):
    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret", request_extra=VLLM_TOKENS) as proxy:
            session = proxy.open_session("episode-1")
            reply = await _ask(proxy, session.api_key, model="solver", messages=_messages(), tools=TOOLS)
            return session, reply

    session, reply = anyio.run(main)
    (call,) = session.calls
    assert reply.choices[0].message.tool_calls[0].function.name == "bash"  # what the server said reaches the agent
    assert call.status == 200 and not call.streamed and call.error is None
    assert call.request["messages"] == _messages() and call.request["tools"] == TOOLS
    assert "return_token_ids" not in call.request  # the record holds what the agent sent, not the proxy's additions
    recorded = call.reply["choices"][0]["message"]["tool_calls"][0]
    assert recorded["function"]["arguments"] == reply.choices[0].message.tool_calls[0].function.arguments
    assert call.prompt_token_ids == chat_ids(_messages())
    assert call.completion_token_ids == token_ids("bash" + recorded["function"]["arguments"])
    assert call.logprobs is not None and len(call.logprobs) == len(call.completion_token_ids)
    assert call.tokens_from_server and not session.retokenize
    # The upstream saw its own key only: the session's key never leaves the proxy.
    assert server.auth == {"Bearer upstream-secret"}


def test_a_field_the_server_refuses_is_dropped_and_the_call_asked_again() -> None:
    async def main(server: ScriptedServer):
        async with CaptureProxy(server.base_url, request_extra=VLLM_TOKENS) as proxy:
            session = proxy.open_session("episode-1")
            async with _client(proxy, session.api_key) as client:
                first = await client.chat.completions.create(model="solver", messages=_messages(), tools=TOOLS)
                second = await client.chat.completions.create(  # an agent asking for the refused field itself is spared too
                    model="solver", messages=_messages(), tools=TOOLS, stream=True, extra_body={"return_token_ids": True}
                )
                async for _ in second:
                    pass
                return session, first

    with ScriptedServer(refuse_fields=("return_token_ids",)) as server:
        session, first = anyio.run(main, server)
        assert server.requests["solver"] == 2  # the refused asks never reached the model
    assert first.choices[0].message.tool_calls  # the agent got its answer, not the 422
    assert [call.status for call in session.calls] == [200, 200] and session.retokenize
    assert all(call.logprobs and not call.tokens_from_server for call in session.calls)  # logprobs still asked


def test_without_the_servers_tokens_the_session_is_marked_for_retokenizing(server):
    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret") as proxy:
            session = proxy.open_session("e")
            await _ask(proxy, session.api_key, model="quitter", messages=_messages())
            return session

    session = anyio.run(main)
    assert session.calls[0].completion_token_ids is None and session.retokenize


def test_a_streamed_reply_reaches_the_agent_and_is_recorded_as_the_unstreamed_one(server):
    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret", request_extra=VLLM_TOKENS) as proxy:
            session = proxy.open_session("e")
            async with _client(proxy, session.api_key) as client:
                arguments = ""
                async for chunk in await client.chat.completions.create(model="solver", messages=_messages(), tools=TOOLS, stream=True):
                    for part in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                        arguments += part.function.arguments or ""
                plain = await client.chat.completions.create(model="quitter", messages=_messages())
                streamed_text = ""
                async for chunk in await client.chat.completions.create(model="quitter", messages=_messages(), stream=True):
                    streamed_text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                return session, arguments, plain, streamed_text

    session, arguments, plain, streamed_text = anyio.run(main)
    tool_call, unstreamed, text = session.calls
    assert tool_call.streamed and tool_call.status == 200
    recorded = tool_call.reply["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in recorded] == ["bash"] and recorded[0]["function"]["arguments"] == arguments
    assert json.loads(arguments)["command"]  # joined from two pieces into the whole JSON
    assert tool_call.reply["choices"][0]["finish_reason"] == "tool_calls"
    assert tool_call.completion_token_ids == token_ids("bash" + arguments)
    assert tool_call.prompt_token_ids == chat_ids(_messages())
    assert len(tool_call.logprobs) == len(tool_call.completion_token_ids)
    assert streamed_text == plain.choices[0].message.content
    assert text.reply["choices"][0]["message"]["content"] == unstreamed.reply["choices"][0]["message"]["content"]
    assert text.completion_token_ids == unstreamed.completion_token_ids and text.logprobs == unstreamed.logprobs


def test_sessions_never_mix_and_a_key_not_open_is_refused_before_the_server(server):
    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret") as proxy:
            sessions = [proxy.open_session(f"e{i}") for i in range(4)]

            async def agent(i: int) -> None:
                for _ in range(i + 1):
                    await _ask(proxy, sessions[i].api_key, model="quitter", messages=_messages())

            async with anyio.create_task_group() as group:
                for i in range(4):
                    group.start_soon(agent, i)
            seen = sum(server.requests.values())
            with pytest.raises(openai.AuthenticationError):
                await _ask(proxy, "sk-guessed", model="quitter", messages=_messages())
            proxy.close_session(sessions[0])
            with pytest.raises(openai.AuthenticationError):
                await _ask(proxy, sessions[0].api_key, model="quitter", messages=_messages())
            async with httpx.AsyncClient() as raw:
                models = await raw.get(f"{proxy.base_url}/models", headers={"authorization": f"Bearer {sessions[1].api_key}"})
            return sessions, seen, models

    sessions, seen, models = anyio.run(main)
    assert [len(s.calls) for s in sessions] == [1, 2, 3, 4]
    assert len({s.api_key for s in sessions}) == 4
    assert sum(server.requests.values()) == seen == 10  # neither refused request reached the server
    assert models.status_code == 200 and "solver" in {m["id"] for m in models.json()["data"]}


def test_the_bounds_refuse_in_openais_shape_and_count(server):
    limits = CaptureLimits(max_calls=2, max_request_bytes=4096, call_seconds=0.5)

    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret", limits=limits) as proxy:
            session = proxy.open_session("e")
            async with _client(proxy, session.api_key) as client:
                with pytest.raises(openai.APIStatusError) as too_large:
                    await client.chat.completions.create(model="quitter", messages=[{"role": "user", "content": "x" * 10_000}])
                await client.chat.completions.create(model="quitter", messages=_messages())
                with pytest.raises(openai.APIStatusError) as too_slow:
                    await client.chat.completions.create(model="slow", messages=_messages())
                with pytest.raises(openai.RateLimitError) as too_many:
                    await client.chat.completions.create(model="quitter", messages=_messages())
                return session, too_large.value, too_slow.value, too_many.value

    server.slow_seconds = 3.0
    session, too_large, too_slow, too_many = anyio.run(main)
    assert too_large.status_code == 413 and too_slow.status_code == 504 and too_many.status_code == 429
    assert "calls are used up" in too_many.message
    assert [c.request["model"] for c in session.calls] == ["quitter", "slow"]  # the oversized one was never a call
    assert session.calls[1].error and session.calls[1].status == 0
    assert session.refused == 1
    assert server.requests["quitter"] == 1  # neither the oversized nor the refused request reached the server


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_proxy_runs_in_the_callers_loop_on_either_backend(server, backend):
    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret") as proxy:
            session = proxy.open_session("e")
            async with httpx.AsyncClient() as raw:
                body = {"model": "quitter", "messages": _messages()}
                answer = await raw.post(f"{proxy.base_url}/chat/completions", json=body, headers={"authorization": f"Bearer {session.api_key}"})
            return session, answer

    session, answer = anyio.run(main, backend=backend)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == session.calls[0].reply["choices"][0]["message"]["content"]


def test_the_proxy_listens_on_loopback_only_and_says_when_it_is_not_serving(server):
    proxy = CaptureProxy(server.base_url)
    with pytest.raises(CaptureProxyError):
        proxy.base_url

    async def main():
        async with proxy:
            return proxy.base_url

    assert anyio.run(main).startswith("http://127.0.0.1:")


def test_a_servers_refusal_reaches_the_agent_and_the_record_streamed_or_not(server):
    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret") as proxy:
            session = proxy.open_session("e")
            async with _client(proxy, session.api_key) as client:
                refusals = []
                for stream in (False, True):
                    with pytest.raises(openai.NotFoundError) as refused:
                        await client.chat.completions.create(model="no-such-model", messages=_messages(), stream=stream)
                    refusals.append(refused.value)
                async with httpx.AsyncClient() as raw:
                    headers = {"authorization": f"Bearer {session.api_key}"}
                    malformed = await raw.post(f"{proxy.base_url}/chat/completions", content=b"{not json", headers=headers)
                    unknown = await raw.post(f"{proxy.base_url}/completions", json={"model": "solver"}, headers=headers)
                return session, refusals, malformed, unknown

    session, refusals, malformed, unknown = anyio.run(main)
    assert [c.streamed for c in session.calls] == [False, True]
    assert all(c.status == 404 and "does not exist" in c.reply["error"]["message"] for c in session.calls)
    assert all("does not exist" in r.message for r in refusals)
    assert malformed.status_code == 400 and unknown.status_code == 404  # neither is a call of the session
    assert len(session.calls) == 2


@pytest.mark.parametrize("backend", ["asyncio", "trio"])  # trio's send to a reset socket raises; asyncio's drops it
def test_a_client_gone_mid_call_ends_its_connection_only(server, backend):
    """A client that hangs up before its answer: the proxy (in its caller's task group) goes on serving."""
    server.slow_seconds = 0.3

    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret") as proxy:
            session = proxy.open_session("e")
            body = json.dumps({"model": "slow", "messages": _messages(), "tools": TOOLS, "stream": True}).encode()
            for _ in range(3):
                client = await anyio.connect_tcp("127.0.0.1", int(proxy.base_url.rsplit(":", 1)[1].split("/")[0]))
                head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {session.api_key}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                await client.send(head.encode() + body)
                raw = client.extra(anyio.abc.SocketAttribute.raw_socket)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                await client.aclose()  # gone before the answer, with a reset: the proxy's answer cannot be sent
            await anyio.sleep(1.2)  # the three slow answers arrive to closed connections
            reply = await _ask(proxy, session.api_key, model="quitter", messages=_messages())
            return session, reply

    session, reply = anyio.run(main, backend=backend)
    assert reply.choices[0].message.content == "I think the answer is 42."
    assert [c.request["model"] for c in session.calls] == ["slow", "slow", "slow", "quitter"]


def test_a_stream_asked_of_a_server_that_answers_whole_is_recorded_whole(server):
    """A server that ignores ``stream`` (answers one JSON): forwarded as it came, recorded with its tokens."""
    async def main():
        async with CaptureProxy(server.base_url, upstream_api_key="upstream-secret", request_extra=VLLM_TOKENS) as proxy:
            session = proxy.open_session("e")
            async with httpx.AsyncClient() as raw:
                body = {"model": "quitter", "messages": _messages(), "stream": True, "stream_whole": True}
                answer = await raw.post(f"{proxy.base_url}/chat/completions", json=body, headers={"authorization": f"Bearer {session.api_key}"})
            return session, answer

    session, answer = anyio.run(main)
    (call,) = session.calls
    assert answer.json()["choices"][0]["message"]["content"] == call.reply["choices"][0]["message"]["content"]
    assert call.completion_token_ids == token_ids(call.reply["choices"][0]["message"]["content"])
