"""What a failed call to the policy's model server means: one classifier, by type and HTTP status.

Both evaluation paths ask it: the tool-calling loop of ``eval``'s harnesses
(:mod:`harbor_async.agents.tool_loop`, the ``openai`` client) and Harbor's own agents
(:mod:`harbor_async.agents.harbor_episode`; terminus-2 calls the server through
LiteLLM, whose exceptions derive from ``openai``'s and wrap one another). So a
given answer of the server is blamed the same way whichever agent got it.

- :attr:`~ServerVerdict.TRANSIENT`: no answer (connection refused or reset,
  a timeout), 408, 409, 429, any 5xx, or an answer the client could not read.
  The caller retries; then the episode is ``model_server``: not judged, rerun
  by a resume.
- :attr:`~ServerVerdict.CONFIGURATION`: 401, 403, 404 (a wrong key, no such
  model, a wrong URL), a 400 or 422 that is not the model's (below), any other
  4xx. Every episode would be refused alike: the episode is ``model_server``
  with :class:`~harbor_async.core.errors.ModelServerConfigError`, and the run stops
  at once.
- :attr:`~ServerVerdict.MODEL`: a 400 or 422 because the conversation outgrew
  the context (:func:`is_context_overflow`), or for a conversation holding a
  tool call the model produced whose arguments are no JSON object. The model's
  own outcome: the episode is scored (the verifier judges what it left).

Context overflow is read from the server's answer: OpenAI's structured
``code == "context_length_exceeded"``, else one narrow pattern
(:data:`CONTEXT_OVERFLOW`), because vLLM says so only inside a 400's message
text (its body's ``code`` is the HTTP status).

A request the model made unusable has no structured marker in vLLM's answer
(its body's ``param`` and ``code`` say nothing of it): vLLM parses the ``arguments`` of every assistant tool call in the
history (``json.loads``) and answers a malformed one with a bare 400 whose
message is Python's ``JSONDecodeError`` text. So that case is read from the
request instead, never from the answer's text: a 400 or 422 for a
conversation that holds a model-produced tool call whose arguments are no JSON
object is the model's (pass ``messages`` to :func:`classify`). Without the
conversation (Harbor's agents, which keep their own), only context overflow is
the model's and every other 400 or 422 is configuration.

``openai`` is the ``eval`` extra: it is imported lazily, and when it is not
importable nothing is a model-server error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from harbor_async.core.errors import ModelServerConfigError, ModelServerError

if TYPE_CHECKING:
    import openai

#: The only text pattern read from a server's answer: the server's own statement that the
#: conversation outgrew the model's context. Each branch needs a token count after a phrase only
#: a context-length refusal uses, so generic words ("invalid", "too long") never match alone.
CONTEXT_OVERFLOW = re.compile(
    # OpenAI ("This model's maximum context length is N tokens. However, your messages resulted in M
    # tokens") and vLLM's serving layer in each wording its versions used ("... However, you requested M
    # tokens (P in the messages, C in the completion)", "... However, your request has M input tokens",
    # "... you requested C output tokens and your prompt contains [at least] M input tokens", and
    # "'max_tokens' or 'max_completion_tokens' is too large: C. This model's maximum context length is N
    # tokens and your request has M input tokens").
    r"maximum context length is \d+"
    # vLLM's engine check: "The decoder prompt (length M) is longer than the maximum model length of N."
    r"|longer than the maximum model length of \d+"
    # vLLM-derived servers (NVIDIA NIM): "You passed M input tokens and requested C output tokens.
    # However, the model's context length is only N tokens, ..."
    r"|model's context length is only \d+",
    re.IGNORECASE,
)
#: OpenAI's structured ``code`` for a context overflow.
CONTEXT_LENGTH_CODE = "context_length_exceeded"

#: Statuses of a server that failed for now: worth another try (then not the model's episode).
_TRANSIENT_STATUSES = frozenset({408, 409, 429})
#: Statuses the model can cause with what it wrote (the server refused the request as invalid).
_REQUEST_STATUSES = frozenset({400, 422})


class ServerVerdict(StrEnum):
    """What a model-server error means for the episode (see the module docstring)."""

    TRANSIENT = "transient"
    """The server failed for now: retry, then the episode is ``model_server`` (rerun)."""
    CONFIGURATION = "configuration"
    """The server refused how it is called (key, model, URL, options): every episode would be; stop the run."""
    MODEL = "model"
    """The model's own doing (its context outgrown, its malformed tool call): the episode is scored."""


def find_server_error(exc: BaseException) -> openai.APIError | None:
    """The first ``openai.APIError`` (LiteLLM's included) in ``exc``'s ``__cause__``/``__context__`` chain.

    ``None`` when there is none, or when ``openai`` is not installed.
    """
    try:
        import openai
    except ImportError:  # the eval extra is not installed: no client could have raised one
        return None
    seen: set[int] = set()  # a chain can loop (an exception re-raised in its own handler)
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, openai.APIError):
            return current
        current = current.__cause__ or current.__context__
    return None


def status_of(error: BaseException) -> int | None:
    """The HTTP status a server error carries (``APIStatusError``'s, or LiteLLM's ``status_code`` attribute)."""
    status = getattr(error, "status_code", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


def is_context_overflow(exc: BaseException) -> bool:
    """Whether the server refused the request (400 or 422) because the conversation outgrew the context."""
    error = find_server_error(exc)
    if error is None or _connection_error(error) or status_of(error) not in _REQUEST_STATUSES:
        return False
    if getattr(error, "code", None) == CONTEXT_LENGTH_CODE:
        return True
    body = getattr(error, "body", None)
    return CONTEXT_OVERFLOW.search(f"{error}\n{body if body is not None else ''}") is not None


def has_malformed_tool_call(messages: Iterable[Mapping[str, Any]]) -> bool:
    """Whether an assistant message of ``messages`` holds a tool call whose arguments are no JSON object.

    Such a call is the model's: a server that parses the history's tool calls
    (vLLM does) refuses the next request with a 400 whatever it is configured with.
    """
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or ():
            arguments = (call.get("function") or {}).get("arguments") if isinstance(call, Mapping) else None
            if isinstance(arguments, Mapping):
                continue
            try:  # empty or absent arguments count too: older vLLM ran json.loads on them and refused
                parsed = json.loads(arguments)  # type: ignore[arg-type]  # None: the TypeError below
            except (TypeError, ValueError):
                return True
            if not isinstance(parsed, dict):
                return True
    return False


def classify(exc: BaseException, messages: Iterable[Mapping[str, Any]] | None = None) -> ServerVerdict | None:
    """What the model-server error behind ``exc`` means; ``None`` when ``exc`` is no model-server error.

    Args:
        exc: the exception raised by the call (or one wrapping it, as Harbor's and LiteLLM's do).
        messages: the conversation that was sent, when the caller has it: a 400 or 422 for a
            conversation holding the model's malformed tool call is the model's.
    """
    error = find_server_error(exc)
    if error is None:
        return None
    if _connection_error(error):
        return ServerVerdict.TRANSIENT  # nothing reached the server, or it did not answer in time
    status = status_of(error)
    if status is None or status < 400:
        return ServerVerdict.TRANSIENT  # an answer the client could not read: the server's, not the setup's
    if status >= 500 or status in _TRANSIENT_STATUSES:
        return ServerVerdict.TRANSIENT
    if status in _REQUEST_STATUSES and (
        is_context_overflow(error) or (messages is not None and has_malformed_tool_call(messages))
    ):
        return ServerVerdict.MODEL
    return ServerVerdict.CONFIGURATION  # 401, 403, 404 and every other refusal: the same for every episode


def model_server_error(
    exc: BaseException, model: str | None = None, verdict: ServerVerdict | None = None
) -> ModelServerError:
    """The episode's error for the model-server error behind ``exc``.

    :class:`ModelServerConfigError` when the ``verdict`` (default: :func:`classify`'s)
    is configuration (the run stops at once), else :class:`ModelServerError`. The
    message names the model, the HTTP status (or the error's type) and the server's error.
    """
    server = find_server_error(exc)
    error = server if server is not None else exc
    status = status_of(server) if server is not None and not _connection_error(server) else None
    what = f"HTTP {status}" if status else type(error).__name__
    where = f"model {model!r}: " if model else ""
    verdict = verdict if verdict is not None else classify(exc)
    cls = ModelServerConfigError if verdict is ServerVerdict.CONFIGURATION else ModelServerError
    return cls(f"{where}{what}: {error}", status=status)


def _connection_error(error: BaseException) -> bool:
    import openai  # only reached with an openai error in hand

    return isinstance(error, openai.APIConnectionError)  # includes APITimeoutError and LiteLLM's Timeout
