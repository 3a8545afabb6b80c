"""The capture proxy: an OpenAI-compatible endpoint between agents and their model server that records every call.

An agent is pointed at :attr:`CaptureProxy.base_url` with its session's API
key (:meth:`CaptureProxy.open_session`): the key names the session, so the
agents of concurrent episodes never mix, and a request with any other key is
refused (401) without reaching the model server. Each chat completion,
streamed or not, tool calls included, is forwarded to the upstream server
under the upstream's own key and recorded in the session
(:class:`~.trace.CapturedCall`); ``GET /v1/models`` is forwarded as is.

``request_extra`` is merged into every forwarded chat request: with vLLM,
``{"logprobs": True, "return_token_ids": True}`` makes the server say which
tokens it read and sampled (the agent sees those fields too). A server that
refuses a field the proxy adds (a 400 or 422 naming it: ``transformers serve``,
OpenAI's API) is asked again without it, and the field is dropped for the rest
of the proxy's life: its calls are then re-tokenized, never lost.

The proxy listens on 127.0.0.1 only, runs in the calling event loop (asyncio
or trio: h11 over anyio streams, httpx to the upstream) and is bounded
(:class:`CaptureLimits`): the request body's size (413), the calls of one
session (429), the seconds of one call (504) and the reply's size (502). A
refused request is counted in its session and never forwarded.
"""

from __future__ import annotations

import json
import secrets
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import h11
import httpx
from anyio.abc import SocketStream, TaskGroup

from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.logs import get_logger
from harbor_async.models.capture.trace import (
    CapturedCall,
    CaptureSession,
    StreamAssembler,
    parse_event_data,
    read_tokens,
)

log = get_logger(__name__)

_READ_SIZE = 64 * 1024


class CaptureProxyError(HarborAsyncError, RuntimeError):
    """The capture proxy was used outside its ``async with`` block."""


@dataclass(frozen=True)
class CaptureLimits:
    """What one request and one session may take."""

    max_request_bytes: int = 8 * 1024 * 1024
    max_reply_bytes: int = 16 * 1024 * 1024
    max_calls: int = 1000  # per session
    call_seconds: float = 600.0  # per call, from the request's end to the reply's end


class _Refused(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class CaptureProxy:
    """``async with CaptureProxy(upstream) as proxy:``; then :meth:`open_session` per episode.

    ``transport``: an httpx transport that answers for the upstream in this process (a model served by the
    trainer itself, :mod:`shim.policy_server`) instead of a socket to ``upstream_base_url``.
    """

    def __init__(
        self,
        upstream_base_url: str,
        *,
        upstream_api_key: str | None = None,
        limits: CaptureLimits = CaptureLimits(),
        request_extra: Mapping[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.upstream_base_url = upstream_base_url.rstrip("/")
        self._transport = transport  # an in-process upstream (the trainer's own model): no socket to it
        self.limits = limits
        self._upstream_key = upstream_api_key
        self._extra = dict(request_extra or {})
        self._refused: set[str] = set()  # fields of ``request_extra`` the server refused: not sent again
        #: held weakly: a session the caller dropped (its episode over) is gone, and its key refused, with no close
        self._sessions: weakref.WeakValueDictionary[str, CaptureSession] = weakref.WeakValueDictionary()
        self._port: int | None = None
        self._group: TaskGroup | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def base_url(self) -> str:
        """What an agent takes as its OpenAI base URL (``http://127.0.0.1:PORT/v1``)."""
        if self._port is None:
            raise CaptureProxyError("the capture proxy is not serving: use it inside `async with`")
        return f"http://127.0.0.1:{self._port}/v1"

    def open_session(self, name: str) -> CaptureSession:
        """A new session with a fresh API key: the calls made with that key are recorded in it.

        The proxy holds it weakly: it serves the key while the caller keeps the session.
        """
        session = CaptureSession(name=name, api_key=f"hb-capture-{secrets.token_urlsafe(24)}")
        self._sessions[session.api_key] = session
        return session

    def close_session(self, session: CaptureSession) -> None:
        """Later requests with the session's key are refused (401); its record stays as it is."""
        session.closed = True
        self._sessions.pop(session.api_key, None)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen and answer until cancelled (``await task_group.start(proxy.serve)``: started once it listens)."""
        if self._port is not None:
            raise CaptureProxyError("the capture proxy is serving already")
        async with await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as listener:
            self._client = httpx.AsyncClient(
                base_url=self.upstream_base_url, timeout=httpx.Timeout(self.limits.call_seconds), transport=self._transport
            )
            try:
                self._port = listener.extra(anyio.abc.SocketAttribute.local_port)
                log.debug("capture proxy serving", url=self.base_url, upstream=self.upstream_base_url)
                task_status.started()
                await listener.serve(self._serve_connection)
            finally:
                self._port = None
                with anyio.CancelScope(shield=True):
                    await self._client.aclose()

    async def __aenter__(self) -> CaptureProxy:
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        await self._group.start(self.serve)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._group is not None
        self._group.cancel_scope.cancel()
        await self._group.__aexit__(None, None, None)
        self._group = None

    # The HTTP side: one h11 connection per client, requests one after another (keep-alive).

    async def _serve_connection(self, stream: SocketStream) -> None:
        """One client's connection; whatever ends it (the client gone, a bug) ends it alone, never the proxy.

        The proxy serves in the engine's task group: an exception out of here would end the engine.
        """
        try:
            await self._serve_requests(stream)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, h11.ProtocolError, OSError) as exc:
            log.debug("capture proxy: a client's connection ended", error=repr(exc))
        except Exception:  # noqa: BLE001 - contained: the other connections and the engine go on
            log.exception("capture proxy: a connection failed")

    async def _serve_requests(self, stream: SocketStream) -> None:
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        async with stream:
            while True:
                try:
                    request = await self._read_request(connection, stream)
                except _Refused as refused:  # over size or malformed: answer, then drop the connection
                    await self._send_json(connection, stream, refused.status, _error_body(str(refused), refused.kind), close=True)
                    return
                if request is None:
                    return
                head, body = request
                await self._answer(connection, stream, head, body)
                if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                    return
                connection.start_next_cycle()

    async def _read_request(self, connection: h11.Connection, stream: SocketStream) -> tuple[h11.Request, bytes] | None:
        """The next request; one over the size bound is read to its end (not kept) and refused (413).

        Refusing before the body's end would close the socket under a client still sending, which
        it sees as a broken connection rather than an answer.
        """
        head: h11.Request | None = None
        body = bytearray()
        over = False
        while True:
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Refused(400, f"malformed request: {exc}", "invalid_request_error") from exc
            if event is h11.NEED_DATA:
                with anyio.move_on_after(self.limits.call_seconds if over else None) as waited:
                    try:
                        data = await stream.receive(_READ_SIZE)
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        data = b""
                if waited.cancelled_caught:  # still sending an oversized body after call_seconds
                    return None
                connection.receive_data(data)
            elif isinstance(event, h11.Request):
                head = event
                length = _header(event, b"content-length")
                over = length is not None and length.isdigit() and int(length) > self.limits.max_request_bytes
            elif isinstance(event, h11.Data):
                over = over or len(body) + len(event.data) > self.limits.max_request_bytes
                if not over:
                    body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                if over:
                    raise _Refused(413, f"request body over {self.limits.max_request_bytes} bytes", "invalid_request_error")
                return head, bytes(body)
            else:  # ConnectionClosed, PAUSED
                return None

    async def _answer(self, connection: h11.Connection, stream: SocketStream, head: h11.Request, body: bytes) -> None:
        path = head.target.split(b"?")[0].rstrip(b"/")
        session = self._session_of(head)
        if session is None:
            await self._send_json(connection, stream, 401, _error_body("unknown API key for this proxy", "authentication_error"))
        elif head.method == b"GET" and path == b"/v1/models":
            await self._forward_models(connection, stream)
        elif head.method == b"POST" and path == b"/v1/chat/completions":
            await self._chat(connection, stream, session, body)
        else:
            await self._send_json(connection, stream, 404, _error_body(f"no route {head.method.decode()} {path.decode(errors='replace')}", "not_found_error"))

    def _session_of(self, head: h11.Request) -> CaptureSession | None:
        value = _header(head, b"authorization") or ""
        key = value[7:].strip() if value.lower().startswith("bearer ") else ""
        session = self._sessions.get(key)
        return None if session is None or session.closed else session

    def _upstream_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._upstream_key}"} if self._upstream_key else {}

    async def _forward_models(self, connection: h11.Connection, stream: SocketStream) -> None:
        assert self._client is not None
        try:
            with anyio.fail_after(self.limits.call_seconds):
                reply = await self._client.get("/models", headers=self._upstream_headers())
            await self._send(connection, stream, reply.status_code, reply.content, reply.headers.get("content-type", "application/json"))
        except (httpx.HTTPError, TimeoutError) as exc:
            await self._send_json(connection, stream, 502, _error_body(f"model server: {exc!r}", "api_error"))

    async def _chat(self, connection: h11.Connection, stream: SocketStream, session: CaptureSession, body: bytes) -> None:
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            await self._send_json(connection, stream, 400, _error_body(f"the body is not a JSON object: {exc}", "invalid_request_error"))
            return
        if len(session.calls) >= self.limits.max_calls:
            session.refused += 1
            await self._send_json(connection, stream, 429, _error_body(f"this episode's {self.limits.max_calls} model calls are used up", "rate_limit_error"))
            return
        call = CapturedCall(index=len(session.calls), request=request, streamed=bool(request.get("stream")))
        session.calls.append(call)
        began = time.monotonic()
        try:
            with anyio.fail_after(self.limits.call_seconds):
                if call.streamed:
                    await self._chat_streamed(connection, stream, call, request)
                else:
                    await self._chat_once(connection, stream, call, request)
        except TimeoutError:
            call.error = f"no reply within {self.limits.call_seconds} s"
            if connection.our_state is h11.SEND_RESPONSE:
                await self._send_json(connection, stream, 504, _error_body(call.error, "timeout"))
        except httpx.HTTPError as exc:
            call.error = f"model server: {exc!r}"
            if connection.our_state is h11.SEND_RESPONSE:
                await self._send_json(connection, stream, 502, _error_body(call.error, "api_error"))
        finally:
            call.seconds = round(time.monotonic() - began, 4)

    async def _read_bounded(self, reply: httpx.Response) -> bytes:
        data = bytearray()
        async for chunk in reply.aiter_bytes():
            data += chunk
            if len(data) > self.limits.max_reply_bytes:
                raise httpx.DecodingError(f"the model server's reply is over {self.limits.max_reply_bytes} bytes")
        return bytes(data)

    def _refused_extras(self, status: int, data: bytes) -> bool:
        """Whether the server refused a field the proxy adds (``transformers serve``: 422 on ``return_token_ids``).

        The fields it names are dropped for good (the calls are then re-tokenized, as for any server that gives no
        ids); the caller asks again without them.
        """
        if status not in (400, 422):
            return False
        named = [key for key in self._extra if key.encode() in data]
        for key in named:
            log.warning("the model server refuses a field the capture proxy asks for; asking without it", field=key,
                        upstream=self.upstream_base_url)  # fmt: skip
            del self._extra[key]
            self._refused.add(key)  # an agent that asks for it too (terminus-2's collect_rollout_details) is spared the error
        return bool(named)

    def _body(self, request: dict[str, Any]) -> dict[str, Any]:
        """What goes upstream: the agent's request less the fields the server refused, plus the proxy's own."""
        return {**{k: v for k, v in request.items() if k not in self._refused}, **self._extra}

    async def _chat_once(self, connection: h11.Connection, stream: SocketStream, call: CapturedCall, request: dict[str, Any]) -> None:
        assert self._client is not None
        body = self._body(request)
        async with self._client.stream("POST", "/chat/completions", json=body, headers=self._upstream_headers()) as reply:
            data = await self._read_bounded(reply)
        if self._refused_extras(reply.status_code, data):
            return await self._chat_once(connection, stream, call, request)
        call.status = reply.status_code
        _take_reply(call, data)
        await self._send(connection, stream, reply.status_code, data, reply.headers.get("content-type", "application/json"))

    async def _chat_streamed(self, connection: h11.Connection, stream: SocketStream, call: CapturedCall, request: dict[str, Any]) -> None:
        assert self._client is not None
        body = self._body(request)
        async with self._client.stream("POST", "/chat/completions", json=body, headers=self._upstream_headers()) as reply:
            call.status = reply.status_code
            if reply.status_code != 200 or not reply.headers.get("content-type", "").startswith("text/event-stream"):
                data = await self._read_bounded(reply)  # an error, or a server that does not stream: one answer
                if self._refused_extras(reply.status_code, data):
                    return await self._chat_streamed(connection, stream, call, request)
                _take_reply(call, data)
                await self._send(connection, stream, reply.status_code, data, reply.headers.get("content-type", "application/json"))
                return
            assembler, pending, size = StreamAssembler(), b"", 0
            await stream.send(connection.send(h11.Response(status_code=200, headers=[
                (b"content-type", reply.headers.get("content-type", "text/event-stream").encode()), (b"cache-control", b"no-cache"),
            ])))  # fmt: skip
            async for chunk in reply.aiter_bytes():
                size += len(chunk)
                if size > self.limits.max_reply_bytes:
                    raise httpx.DecodingError(f"the model server's reply is over {self.limits.max_reply_bytes} bytes")
                await stream.send(connection.send(h11.Data(data=chunk)))
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    event = parse_event_data(line.rstrip(b"\r"))
                    if event is not None:
                        assembler.feed(event)
            for line in pending.split(b"\n"):
                event = parse_event_data(line.rstrip(b"\r"))
                if event is not None:
                    assembler.feed(event)
            assembler.fill(call)
            await stream.send(connection.send(h11.EndOfMessage()))

    async def _send(
        self, connection: h11.Connection, stream: SocketStream, status: int, body: bytes, content_type: str, close: bool = False
    ) -> None:
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
        if close:  # the connection ends after this answer: the client must not send another request on it
            headers.append((b"connection", b"close"))
        await stream.send(connection.send(h11.Response(status_code=status, headers=headers)))
        await stream.send(connection.send(h11.Data(data=body)))
        await stream.send(connection.send(h11.EndOfMessage()))

    async def _send_json(
        self, connection: h11.Connection, stream: SocketStream, status: int, payload: dict[str, Any], close: bool = False
    ) -> None:
        try:
            await self._send(connection, stream, status, json.dumps(payload).encode(), "application/json", close)
        except (h11.LocalProtocolError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client is gone or the response was under way: nothing more can be said to it


def _take_reply(call: CapturedCall, data: bytes) -> None:
    """A whole (unstreamed) answer into ``call``: its JSON (else the start of its text), and its tokens if it succeeded."""
    try:
        reply = json.loads(data)
    except ValueError:
        reply = None
    call.reply = reply if isinstance(reply, dict) else {"text": data[:4096].decode(errors="replace")}
    if call.status == 200 and isinstance(reply, dict):
        read_tokens(call, reply)


def _header(head: h11.Request, name: bytes) -> str | None:
    for key, value in head.headers:
        if key == name:
            return value.decode("latin-1")
    return None


def _error_body(message: str, kind: str) -> dict[str, Any]:
    """An error in OpenAI's shape, which every OpenAI client reads."""
    return {"error": {"message": message, "type": kind, "code": None}}
