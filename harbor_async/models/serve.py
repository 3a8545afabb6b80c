"""The managed model server: start ``vllm serve`` (or any command) for a checkpoint, wait, stop.

:class:`ManagedServer` launches the command in its own process group on a
free loopback port, writes its output to a log file (in the job folder), waits
until ``/health`` and ``/v1/models`` answer (bounded), and stops the whole
process group on exit, on error and on any signal that unwinds the program
(SIGINT, SIGTERM via the loop module's handler, interpreter exit).

vLLM is not a dependency: its torch pin may differ from ours, so it is run
from its own environment and found on ``PATH`` (see the README's "Evaluation").
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

import anyio
import httpx

from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.logs import get_logger

log = get_logger(__name__)

#: Seconds a server gets to answer ``/health`` and ``/v1/models`` (a big model loads slowly).
DEFAULT_READY_TIMEOUT = 900.0
#: Seconds between SIGTERM and SIGKILL of the server's process group.
STOP_GRACE = 10.0
#: Seconds of server errors (HTTP 5xx) while waiting for readiness before giving up (a broken server, not a slow one).
DEFAULT_ERROR_TIMEOUT = 60.0


class ServeError(HarborAsyncError):
    """The model server could not be started, reached or kept running."""


class ServerExitedError(ServeError):
    """The server process exited before it was ready."""


class ServerNotReadyError(ServeError, TimeoutError):
    """The server did not answer ``/health`` and ``/v1/models`` in time."""


class ServerDiedError(ServeError):
    """The managed server exited while episodes were running."""


class ServerUnreachableError(ServeError):
    """Nothing answers at the server's base URL."""


class ServerAuthError(ServeError):
    """The server refused the API key (HTTP 401 or 403)."""


class ModelNotServedError(ServeError, LookupError):
    """The server does not list the requested model."""


# ── command lines ────────────────────────────────────────────────────────

#: vLLM tool-call parsers by the model family a chat template belongs to (first match wins).
_PARSERS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "hermes"),  # Qwen2/2.5/3, Hermes, many fine-tunes
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("<|tool_call_start|>", "pythonic"),
)
_PARSERS_BY_TYPE = {
    "qwen2": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "mistral": "mistral",
    "llama": "llama3_json",
}


def tool_call_parser_for(model_path: str | Path) -> str:
    """The vLLM ``--tool-call-parser`` that fits a checkpoint's chat template (``hermes`` by default).

    Reads the template from ``tokenizer_config.json`` or ``chat_template.jinja``
    and looks for the family's tool-call marker; falls back to ``config.json``'s
    ``model_type``.
    """
    path = Path(model_path)
    template = ""
    try:
        template = str(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template") or "")
    except (OSError, ValueError):
        pass
    if not template and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(errors="replace")
    for marker, parser in _PARSERS:
        if marker in template:
            return parser
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        model_type = ""
    return _PARSERS_BY_TYPE.get(model_type, "hermes")


def lora_base(adapter: str | Path) -> str | None:
    """The base model of a PEFT LoRA adapter folder (``None`` if it is not one)."""
    try:
        config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("base_model_name_or_path")


def vllm_command(
    model: str | Path,
    port: int,
    *,
    served_name: str | None = None,
    tool_call_parser: str | None = None,
    lora_adapters: dict[str, str | Path] | None = None,
    extra_args: Sequence[str] = (),
    executable: str = "vllm",
) -> list[str]:
    """The ``vllm serve`` command line for ``model`` with tool calling on, listening on 127.0.0.1:``port``.

    With ``lora_adapters`` (``{served name: adapter folder}``) ``model`` is the
    base model and every adapter is served as its own model (``--enable-lora``).
    """
    parser = tool_call_parser or tool_call_parser_for(model)
    cmd = [executable, "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    if served_name is not None:
        cmd += ["--served-model-name", served_name]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    if lora_adapters:
        cmd += ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in lora_adapters.items())]
    return cmd + list(extra_args)


def format_serve_cmd(template: str, model: str, port: int) -> list[str]:
    """``--serve-cmd``: split like a shell, then put the model and port in each word."""
    if "{port}" not in template:
        raise ServeError(f"--serve-cmd must contain {{port}} (the server must listen where we look): {template!r}")
    return [word.replace("{model}", model).replace("{port}", str(port)) for word in shlex.split(template)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ── readiness ────────────────────────────────────────────────────────────


async def served_models(base_url: str, *, api_key: str | None = None, timeout: float = 10.0) -> list[str]:
    """The model ids ``GET {base_url}/models`` lists (``base_url`` ends in ``/v1``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await client.get(base_url.rstrip("/") + "/models", headers=headers)
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"model server at {base_url} unreachable: {type(exc).__name__}: {exc}") from exc
    if response.status_code in (401, 403):
        raise ServerAuthError(
            f"GET {base_url}/models answered HTTP {response.status_code} ({first_line(response.text)}): "
            "the server refused the API key; set it in OPENAI_API_KEY or name its variable with --api-key-name"
        )
    if response.status_code != 200:
        raise ServerUnreachableError(
            f"GET {base_url}/models answered HTTP {response.status_code}: {first_line(response.text)}"
        )
    try:
        return [str(m["id"]) for m in response.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ServerUnreachableError(f"GET {base_url}/models did not return a model list") from exc


def first_line(text: str, limit: int = 200) -> str:
    """The first non-empty line of a server's answer, cut to ``limit`` characters."""
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:limit]
    return "(empty body)"


async def chat_answers(base_url: str, model: str, *, api_key: str | None = None, timeout: float = 60.0) -> str | None:
    """``None`` when a one-token chat request for ``model`` succeeds, else why not (status and first line)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await client.post(base_url.rstrip("/") + "/chat/completions", json=body, headers=headers)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code == 200:
        return None
    return f"HTTP {response.status_code}: {first_line(response.text)}"


async def check_models(
    wanted: Sequence[str], listed: Sequence[str], base_url: str, *, api_key: str | None = None
) -> list[str]:
    """Models of ``wanted`` the server does not list but that answer a chat request (a warning each).

    Some servers list nothing or other names (``transformers serve`` of a local
    folder lists nothing): a one-token chat request decides.

    Raises:
        ModelNotServedError: a model neither listed nor answering, with what is listed and the chat's error.
    """
    unlisted = []
    for model in wanted:
        if model in listed:
            continue
        refused = await chat_answers(base_url, model, api_key=api_key)
        if refused is not None:
            raise ModelNotServedError(
                f"model {model!r} not served at {base_url}; it serves: {', '.join(listed) or 'nothing'} "
                f"(a chat request for it: {refused})"
            )
        log.warning("model not listed by the server, but it answers a chat request", model=model, url=base_url)
        unlisted.append(model)
    return unlisted


# ── the process ──────────────────────────────────────────────────────────


def _hub_cache() -> Path:
    """Hugging Face's hub cache folder (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"

_LIVE: set[subprocess.Popen] = set()


def _stop_process_group(proc: subprocess.Popen, grace: float = STOP_GRACE) -> None:
    """SIGTERM the process group, then SIGKILL it after ``grace`` seconds; reap the leader."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM:  # the leader left; children may linger in the group
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        except subprocess.TimeoutExpired:
            continue
    _LIVE.discard(proc)


@atexit.register
def _stop_all() -> None:  # a last line of defence: exit after an unhandled error or SIGTERM
    for proc in list(_LIVE):
        _stop_process_group(proc, grace=2.0)


class ManagedServer:
    """A model server process we own: ``async with ManagedServer(cmd, port, log) as server: ...``.

    Args:
        command: the argv to run (see :func:`vllm_command`, :func:`format_serve_cmd`).
        port: the port it listens on (127.0.0.1).
        log_path: where its stdout and stderr go.
        ready_timeout: seconds to wait for ``/health`` and ``/v1/models``.
    """

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        log_path: str | Path,
        *,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        error_timeout: float = DEFAULT_ERROR_TIMEOUT,
        on_status: Callable[[str], None] | None = None,
    ) -> None:
        self.command = list(command)
        self.port = port
        self.log_path = Path(log_path)
        self.ready_timeout = ready_timeout
        self.error_timeout = error_timeout
        self.on_status = on_status
        self.last_answer = "nothing yet"
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI API root (``http://127.0.0.1:PORT/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        """Raise :class:`ServerDiedError` if the server exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerDiedError(
                f"the model server exited (code {self.proc.returncode}) while episodes were running; "
                f"see its log {self.log_path}"
            )

    def start(self) -> None:
        """Launch the process in its own session (so its whole group can be stopped)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _hub_cache().mkdir(parents=True, exist_ok=True)  # transformers serve answers 500 without it
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(self.command)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
            except OSError as exc:
                hint = ""
                if isinstance(exc, FileNotFoundError) and Path(self.command[0]).name == "vllm":
                    hint = (
                        "; vLLM is not installed here (it needs a GPU: install it in its own environment), "
                        "or, on a CPU-only machine, serve with --serve-cmd "
                        "\"transformers serve {model} --host 127.0.0.1 --port {port}\", or pass --base-url"
                    )
                raise ServerExitedError(f"cannot start the model server {self.command[0]!r}: {exc}{hint}") from exc
        _LIVE.add(self.proc)

    async def wait_ready(self) -> None:
        """Poll ``/health`` then ``/v1/models`` until both answer 200.

        Bounded by ``ready_timeout``, and by ``error_timeout`` of server errors
        (HTTP 5xx) in a row: a server that keeps failing is broken, not loading.
        Each answer goes to ``on_status`` (the progress line); every failure
        names the last answer and ends with the log's last lines.
        """
        root = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.ready_timeout
        failing_since: float | None = None
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    raise ServerExitedError(
                        f"the model server exited with code {self.proc.returncode} before it was ready; "
                        f"see its log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    answer = await client.get(root + "/health")
                    if answer.status_code == 200:
                        answer = await client.get(root + "/v1/models")
                        if answer.status_code == 200:
                            return
                    path = answer.request.url.path
                    self._answered(f"GET {path}: HTTP {answer.status_code}: {first_line(answer.text)}")
                    if answer.status_code >= 500:
                        failing_since = failing_since if failing_since is not None else time.monotonic()
                    else:
                        failing_since = None
                except httpx.HTTPError as exc:
                    self._answered(f"no answer yet ({type(exc).__name__})")
                    failing_since = None
                now = time.monotonic()
                if failing_since is not None and now - failing_since >= self.error_timeout:
                    raise ServerNotReadyError(
                        f"the model server kept failing for {self.error_timeout:g} s: {self.last_answer}; "
                        f"see its log {self.log_path}:\n{self.log_tail()}"
                    )
                if now >= deadline:
                    raise ServerNotReadyError(
                        f"the model server did not become ready on port {self.port} within {self.ready_timeout:g} s "
                        f"(last answer: {self.last_answer}); see its log {self.log_path}:\n{self.log_tail()}"
                    )
                await anyio.sleep(0.5)

    def _answered(self, text: str) -> None:
        self.last_answer = text
        if self.on_status is not None:
            self.on_status(f"waiting for the model server: {text}")

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the process group (idempotent)."""
        if self.proc is not None:
            _stop_process_group(self.proc)

    async def __aenter__(self) -> Self:
        self.start()
        try:
            await self.wait_ready()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)
