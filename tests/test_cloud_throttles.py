"""A cloud provider's rate-limit and quota answers, through each SDK's own client and exception classes.

No provider is reachable from here, so a local HTTP server plays one: it
answers every request of E2B's, Daytona's and Runloop's own clients (the ones
Harbor's environments drive) with the status, body and ``Retry-After`` a
provider gives, and the SDK raises what it raises for it. The backend's
adapter (:meth:`BackendSpec.typed_error`, the one place a start error is typed)
must turn a 429 into a rate limit, a refusal that names a quota or a limit of
concurrent sandboxes into a quota, and leave any other refusal alone. Modal
speaks gRPC, not HTTP: its own ``ResourceExhaustedError`` (what its client
raises for ``RESOURCE_EXHAUSTED``) is checked as the class its SDK defines,
without a transport. Marked ``range``: ``.ci/range`` runs it on each SDK's
lowest release too (E2B 2.25's ``RateLimitException`` carries no status).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harbor_async.backends import resolve_backend
from harbor_async.core.errors import (
    BackendQuotaError,
    BackendRateLimitError,
    is_throttle,
)

pytestmark = pytest.mark.range

RATE = "Rate limit exceeded: too many sandbox creations, slow down"
QUOTA = "You have reached the maximum number of concurrent sandboxes (20) for your team"


@dataclass
class Provider:
    """What the stub answers, and what it was asked."""

    status: int = 429
    message: str = RATE
    retry_after: str | None = "0"
    requests: list[str] = field(default_factory=list)
    url: str = ""


@pytest.fixture
def provider() -> Iterator[Provider]:
    answer = Provider()

    class Handler(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if length:
                self.rfile.read(length)
            answer.requests.append(f"{self.command} {self.path}")
            body = json.dumps({"message": answer.message, "code": answer.status}).encode()
            self.send_response(answer.status)
            self.send_header("Content-Type", "application/json")
            if answer.retry_after is not None:
                self.send_header("Retry-After", answer.retry_after)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _refuse

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    answer.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield answer
    finally:
        server.shutdown()
        server.server_close()


async def _create(sdk: str, url: str) -> BaseException:
    """Ask the SDK for a sandbox, as Harbor's environment does at its start; return what it raised."""
    try:
        if sdk == "e2b":
            from e2b import AsyncSandbox

            await AsyncSandbox.create(api_key="e2b_" + "0" * 40, api_url=url, request_timeout=10)
        elif sdk == "daytona":
            from daytona import AsyncDaytona, DaytonaConfig

            async with AsyncDaytona(DaytonaConfig(api_key="key", api_url=url, target="us")) as client:
                await client.create(timeout=10)
        else:
            from runloop_api_client import AsyncRunloop

            async with AsyncRunloop(bearer_token="key", base_url=url, max_retries=0) as runloop:
                await runloop.devboxes.create()
    except Exception as exc:  # noqa: BLE001 - the SDK's own error is what is checked
        return exc
    raise AssertionError(f"{sdk} created a sandbox on a provider that refuses everything")


def _typed(sdk: str, exc: BaseException) -> BaseException:
    """The adapter's typing, also with the error wrapped the way Harbor re-raises some (``from``)."""
    typed = resolve_backend(sdk).typed_error(exc)
    wrapped = RuntimeError(f"{sdk} start failed")
    wrapped.__cause__ = exc
    again = resolve_backend(sdk).typed_error(wrapped)
    assert type(again) is type(typed) or (again is wrapped and typed is exc)
    return typed


SDKS = ["e2b", "daytona", "runloop"]


@pytest.mark.parametrize("sdk", SDKS)
def test_a_429_is_a_rate_limit(sdk: str, provider: Provider) -> None:
    exc = asyncio.run(_create(sdk, provider.url))
    assert provider.requests, f"{sdk} never reached the provider: {exc!r}"
    typed = _typed(sdk, exc)
    assert type(typed) is BackendRateLimitError and is_throttle(typed), repr(exc)
    assert type(exc).__name__ in str(typed)  # the SDK's own error, named
    if sdk != "e2b":  # E2B's errors keep no headers; Daytona's keep them, Runloop's keep the response
        assert typed.retry_after == 0.0


@pytest.mark.parametrize("sdk", SDKS)
def test_a_refusal_that_names_a_concurrency_limit_is_a_quota(sdk: str, provider: Provider) -> None:
    provider.message, provider.retry_after = QUOTA, "7"
    provider.status = 429
    typed = _typed(sdk, asyncio.run(_create(sdk, provider.url)))
    assert type(typed) is BackendQuotaError, repr(typed)


@pytest.mark.parametrize("sdk", ["daytona", "runloop"])
def test_a_403_that_names_a_quota_is_a_quota_and_a_plain_403_is_nothing(sdk: str, provider: Provider) -> None:
    provider.status, provider.message, provider.retry_after = 403, "Total CPU quota exceeded for the organization", None
    assert type(_typed(sdk, asyncio.run(_create(sdk, provider.url)))) is BackendQuotaError
    provider.message = "Forbidden: this API key may not create sandboxes"
    exc = asyncio.run(_create(sdk, provider.url))
    assert _typed(sdk, exc) is exc and not is_throttle(exc)  # a refusal of another kind: the error as it was


@pytest.mark.parametrize("sdk", SDKS)
def test_another_refusal_stays_what_it_was(sdk: str, provider: Provider) -> None:
    provider.status, provider.message, provider.retry_after = 400, "invalid template", None
    exc = asyncio.run(_create(sdk, provider.url))
    assert provider.requests and _typed(sdk, exc) is exc and not is_throttle(exc)


def test_modals_resource_exhausted_is_a_rate_limit_or_a_quota() -> None:
    from modal.exception import NotFoundError, ResourceExhaustedError

    assert type(_typed("modal", ResourceExhaustedError("Too many requests, retry later"))) is BackendRateLimitError
    quota = _typed("modal", ResourceExhaustedError("Workspace has reached its limit of 100 concurrent sandboxes"))
    assert type(quota) is BackendQuotaError
    other = NotFoundError("App not found")
    assert _typed("modal", other) is other
