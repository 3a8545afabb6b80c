"""One model-server classifier (harbor_async/models/model_server.py), by type and HTTP status, for every agent.

First the verdicts, on real ``openai`` and LiteLLM exception objects (wrapped as
Harbor and LiteLLM wrap them); then end to end: the harnesses' ``ToolLoop`` and
Harbor's terminus-2 against the scripted OpenAI-compatible server, which
answers each model name with the status under test.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from harbor_async.core.errors import (
    FailureClass,
    ModelServerConfigError,
    ModelServerError,
    SandboxError,
)
from harbor_async.models.model_server import (
    CONTEXT_OVERFLOW,
    ServerVerdict,
    classify,
    find_server_error,
    has_malformed_tool_call,
    is_context_overflow,
    model_server_error,
)
from tests import scripted_server
from tests.scripted_server import ScriptedServer
from tests.test_harbor_agents import echo_suite

openai = pytest.importorskip("openai")  # the eval extra
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # as harbor_agents sets it: no network lookup at import

URL = "http://127.0.0.1:9/v1/chat/completions"

#: vLLM's context-length refusals, word for word, across its versions (and OpenAI's).
VLLM_CONTEXT_MESSAGES = [
    # vLLM 0.2-0.6 serving layer
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, "
    "1000 in the completion). Please reduce the length of the messages or completion.",
    "This model's maximum context length is 4096 tokens. However, you requested 4100 tokens in the messages, "
    "Please reduce the length of the messages.",
    # newer vLLM, no max_tokens on the request
    "This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. "
    "Please reduce the length of the input messages.",
    # vLLM with max_tokens on the request
    "'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length is 4096 tokens "
    "and your request has 3500 input tokens (1000 > 4096 - 3500).",
    "This model's maximum context length is 32768 tokens. However, you requested 512 output tokens and your prompt "
    "contains at least 32257 input tokens, for a total of at least 32769 tokens. Please reduce the length of the "
    "input prompt or the number of requested output tokens. (parameter=input_tokens, value=32257)",
    # vLLM's engine check
    "The decoder prompt (length 8825) is longer than the maximum model length of 8192. Make sure that `max_model_len` "
    "is no smaller than the number of text tokens.",
    # vLLM-derived servers (NVIDIA NIM)
    "You passed 1200064 input tokens and requested 1 output tokens. However, the model's context length is only "
    "1048576 tokens, resulting in a maximum input length of 1048575 tokens. Please reduce the length of the input prompt",
    # OpenAI
    "This model's maximum context length is 128000 tokens. However, your messages resulted in 200000 tokens.",
]

#: vLLM's answer to a request with tools when it was started without a tool-call parser.
NO_PARSER = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'

#: 400s that are not context overflow: generic words the pattern must not take for one.
NOT_CONTEXT_MESSAGES = [
    NO_PARSER,
    "Invalid 'messages[1].content': string too long. Expected a string with maximum length 10485760.",
    "context_length must be a positive integer",
    "The prompt is too long for this request; invalid input",
    "maximum context length exceeded",  # no token count: not the server's statement of an overflow
]


def _response(status: int) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("POST", URL))


def status_error(status: int, message: str = "refused", *, code: Any = None) -> openai.APIStatusError:
    """The exception the ``openai`` client raises for ``status`` (its own class for the status), vLLM's body shape."""
    body = {"message": message, "type": "BadRequestError", "param": None, "code": status if code is None else code}
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9/v1")
    error = client._make_status_error(f"Error code: {status} - {body}", body=body, response=_response(status))
    assert isinstance(error, openai.APIStatusError) and error.status_code == status
    return error


def wrapped(error: BaseException) -> SandboxError:
    """``error`` two wrappers deep, as Harbor's agent phase reaches us: raised from, then raised while handling."""
    try:
        try:
            raise error
        except Exception as inner:
            raise RuntimeError("terminus-2 failed") from inner
    except RuntimeError:
        try:
            raise SandboxError("agent", "task", "sandbox-1", "the agent failed")  # __context__: the RuntimeError
        except SandboxError as outer:
            return outer


# ── verdicts by type and status ──────────────────────────────────────────────


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504, 529])
def test_busy_or_failing_servers_are_transient(status: int) -> None:
    assert classify(status_error(status)) is ServerVerdict.TRANSIENT
    assert classify(wrapped(status_error(status))) is ServerVerdict.TRANSIENT


def test_no_answer_is_transient() -> None:
    request = httpx.Request("POST", URL)
    assert classify(openai.APIConnectionError(request=request)) is ServerVerdict.TRANSIENT
    assert classify(openai.APITimeoutError(request=request)) is ServerVerdict.TRANSIENT
    assert classify(wrapped(openai.APIConnectionError(request=request))) is ServerVerdict.TRANSIENT


@pytest.mark.parametrize("status", [401, 403, 404, 402, 405, 413, 415])
def test_refused_configuration_is_configuration(status: int) -> None:
    assert classify(status_error(status)) is ServerVerdict.CONFIGURATION
    assert classify(wrapped(status_error(status))) is ServerVerdict.CONFIGURATION


@pytest.mark.parametrize("status", [400, 422])
@pytest.mark.parametrize("message", NOT_CONTEXT_MESSAGES)
def test_a_400_or_422_that_is_not_the_models_is_configuration(status: int, message: str) -> None:
    error = status_error(status, message)
    assert not is_context_overflow(error)
    assert classify(error) is ServerVerdict.CONFIGURATION
    # with a conversation whose tool calls are well formed, still the server's setup
    calls = [{"role": "assistant", "tool_calls": [_call('{"command": "ls"}')]}]
    assert classify(error, calls) is ServerVerdict.CONFIGURATION


@pytest.mark.parametrize("status", [400, 422])
@pytest.mark.parametrize("message", VLLM_CONTEXT_MESSAGES)
def test_context_overflow_is_the_models(status: int, message: str) -> None:
    error = status_error(status, message)
    assert CONTEXT_OVERFLOW.search(message)
    assert is_context_overflow(error) and is_context_overflow(wrapped(error))
    assert classify(error) is ServerVerdict.MODEL
    assert classify(wrapped(error)) is ServerVerdict.MODEL


def test_openais_structured_code_is_context_overflow() -> None:
    error = status_error(400, "Your input exceeds the context window of this model.", code="context_length_exceeded")
    assert error.code == "context_length_exceeded" and CONTEXT_OVERFLOW.search(str(error)) is None
    assert is_context_overflow(error) and classify(error) is ServerVerdict.MODEL


def test_the_status_decides_before_the_text() -> None:
    text = VLLM_CONTEXT_MESSAGES[0]
    assert classify(status_error(500, text)) is ServerVerdict.TRANSIENT
    assert classify(status_error(401, text)) is ServerVerdict.CONFIGURATION
    assert classify(status_error(413, text)) is ServerVerdict.CONFIGURATION
    assert not is_context_overflow(status_error(500, text))


def test_the_pattern_is_narrow() -> None:
    for text in ("invalid", "too long", "prompt is too long", "context length", "maximum context", *NOT_CONTEXT_MESSAGES):
        assert CONTEXT_OVERFLOW.search(text) is None, text


def _call(arguments: Any) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": arguments}}


def test_a_malformed_tool_call_of_the_model_makes_a_400_or_422_the_models() -> None:
    malformed = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [_call('{"command": "ls')]}]
    not_an_object = [{"role": "assistant", "tool_calls": [_call("[1, 2]")]}]
    fine = [{"role": "assistant", "tool_calls": [_call('{"command": "ls"}'), _call({"command": "ls"})]}]
    user_text = [{"role": "user", "content": '{"broken', "tool_calls": [_call("{")]}]  # only the assistant's count
    assert has_malformed_tool_call(malformed) and has_malformed_tool_call(not_an_object)
    assert not has_malformed_tool_call(fine) and not has_malformed_tool_call(user_text)
    # vLLM's answer to such a history: a bare 400 with Python's JSONDecodeError text
    vllm = status_error(400, "Unterminated string starting at: line 1 column 13 (char 12)")
    assert classify(vllm, malformed) is ServerVerdict.MODEL
    assert classify(status_error(422, "unprocessable"), not_an_object) is ServerVerdict.MODEL
    assert classify(vllm) is ServerVerdict.CONFIGURATION  # without the conversation: not the model's
    assert classify(vllm, fine) is ServerVerdict.CONFIGURATION
    assert classify(status_error(401), malformed) is ServerVerdict.CONFIGURATION  # a key is a key
    assert classify(status_error(500), malformed) is ServerVerdict.TRANSIENT


def test_not_a_server_error_is_none() -> None:
    assert classify(ValueError("boom")) is None
    assert classify(wrapped(ValueError("boom"))) is None
    assert find_server_error(KeyError("x")) is None


def test_a_cyclic_chain_ends() -> None:
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__context__, second.__context__ = second, first
    assert classify(first) is None
    third = RuntimeError("c")
    third.__cause__ = first
    second.__cause__ = status_error(429)  # the cause wins over the context, cycle or not
    assert classify(third) is ServerVerdict.TRANSIENT


def test_without_openai_nothing_is_a_server_error(monkeypatch: pytest.MonkeyPatch) -> None:
    error = status_error(500)
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` raises ImportError: the eval extra is absent
    assert find_server_error(error) is None and classify(error) is None and not is_context_overflow(error)


def test_the_episodes_error_names_model_status_and_server() -> None:
    refused = model_server_error(wrapped(status_error(401, "Incorrect API key provided")), "ckpt")
    assert type(refused) is ModelServerConfigError and refused.status == 401
    assert str(refused).startswith("model 'ckpt': HTTP 401: Error code: 401") and "Incorrect API key" in str(refused)
    again = pickle.loads(pickle.dumps(refused))  # records and errors cross process boundaries (Ray)
    assert type(again) is ModelServerConfigError and again.status == 401 and str(again) == str(refused)
    busy = model_server_error(status_error(503), "ckpt")
    assert type(busy) is ModelServerError and busy.status == 503
    lost = model_server_error(openai.APIConnectionError(request=httpx.Request("POST", URL)), "ckpt")
    assert type(lost) is ModelServerError and lost.status is None and "APIConnectionError" in str(lost)


# ── LiteLLM's exceptions (Harbor's agents) ───────────────────────────────────

def _litellm_cases(litellm: Any) -> dict[str, tuple[BaseException, ServerVerdict]]:
    m, p = "hosted_vllm/ckpt", "hosted_vllm"
    request = httpx.Request("POST", URL)
    context = VLLM_CONTEXT_MESSAGES[2]
    return {
        "rate limit": (litellm.RateLimitError("slow down", llm_provider=p, model=m), ServerVerdict.TRANSIENT),
        "timeout": (litellm.Timeout("timed out", model=m, llm_provider=p), ServerVerdict.TRANSIENT),
        "connection": (litellm.APIConnectionError("refused", llm_provider=p, model=m, request=request), ServerVerdict.TRANSIENT),
        "503": (litellm.ServiceUnavailableError("down", llm_provider=p, model=m), ServerVerdict.TRANSIENT),
        "500": (litellm.InternalServerError("oops", llm_provider=p, model=m), ServerVerdict.TRANSIENT),
        "APIError 502": (litellm.APIError(502, "bad gateway", llm_provider=p, model=m), ServerVerdict.TRANSIENT),
        "401": (litellm.AuthenticationError("Incorrect API key", llm_provider=p, model=m), ServerVerdict.CONFIGURATION),
        "404": (litellm.NotFoundError("The model `x` does not exist.", model=m, llm_provider=p), ServerVerdict.CONFIGURATION),
        "APIError 401": (litellm.APIError(401, "unauthorized", llm_provider=p, model=m), ServerVerdict.CONFIGURATION),
        "400": (litellm.BadRequestError(NO_PARSER, model=m, llm_provider=p), ServerVerdict.CONFIGURATION),
        "422": (litellm.UnprocessableEntityError("field required", model=m, llm_provider=p, response=_response(422)), ServerVerdict.CONFIGURATION),
        "context": (litellm.ContextWindowExceededError(f"Hosted_vllmException - {context}", model=m, llm_provider=p), ServerVerdict.MODEL),
        "context as 400": (litellm.BadRequestError(f"Hosted_vllmException - {context}", model=m, llm_provider=p), ServerVerdict.MODEL),
    }  # fmt: skip


LITELLM_CASES = ["rate limit", "timeout", "connection", "503", "500", "APIError 502", "401", "404", "APIError 401",
                 "400", "422", "context", "context as 400"]  # fmt: skip


@pytest.mark.parametrize("name", LITELLM_CASES)
def test_litellms_exceptions_by_type_and_status(name: str) -> None:
    litellm = pytest.importorskip("litellm")  # comes with harbor
    error, verdict = _litellm_cases(litellm)[name]
    assert isinstance(error, openai.APIError)  # LiteLLM's derive from the openai client's
    assert classify(error) is verdict
    assert classify(wrapped(error)) is verdict  # as a Harbor agent's failure reaches the episode


def test_harbors_context_length_error_keeps_litellms_as_its_context() -> None:
    litellm = pytest.importorskip("litellm")
    from harbor.llms.base import ContextLengthExceededError

    overflow = litellm.ContextWindowExceededError(VLLM_CONTEXT_MESSAGES[0], model="hosted_vllm/x", llm_provider="hosted_vllm")
    try:
        try:
            raise overflow
        except Exception:
            raise ContextLengthExceededError  # what Harbor's LiteLLM wrapper raises: LiteLLM's is its __context__
    except ContextLengthExceededError as harbor_error:
        assert classify(harbor_error) is ServerVerdict.MODEL
        assert classify(wrapped(harbor_error)) is ServerVerdict.MODEL


# ── end to end: the harnesses' ToolLoop against the scripted server ─────────────

EXTRA_MODELS = ("refuse-400", "refuse-422")


class RefusingServer(ScriptedServer):
    """The scripted server, plus two refusals a misconfigured server gives, and vLLM's parse of tool-call history.

    - ``refuse-400``: vLLM without ``--tool-call-parser`` (400, every request);
    - ``refuse-422``: FastAPI's request validation (422, every request);
    - every model: a conversation holding an assistant tool call whose arguments
      are no JSON gets vLLM's 400 (it ``json.loads`` them to render the template).
    """

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        model = body.get("model")
        if model == "refuse-400":
            return 400, {"error": {"message": NO_PARSER, "type": "BadRequestError", "param": None, "code": 400}}
        if model == "refuse-422":
            detail = [{"type": "missing", "loc": ["body", "messages", 0, "role"], "msg": "Field required"}]
            return 422, {"detail": detail}
        assistant = [m for m in body.get("messages") or [] if m.get("role") == "assistant"]
        for message in assistant:
            for call in message.get("tool_calls") or []:
                try:
                    json.loads(call["function"]["arguments"])
                except ValueError as exc:
                    return 400, {"error": {"message": str(exc), "type": "BadRequestError", "param": None, "code": 400}}
        return super().chat(body)


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(scripted_server, "MODELS", (*scripted_server.MODELS, *EXTRA_MODELS))  # listed and served
    with RefusingServer() as server:
        yield server


class Shell:
    """A harness with one tool; it only answers (the classifier is under test, not the sandbox)."""

    def bash(self, command: str) -> str:
        """
        Run a command.

        Args:
            command: The command.
        """
        return "ok"


def _run_agent(server: ScriptedServer, model: str, *, api_key: str = "EMPTY", retries: int = 2):
    from harbor_async.agents.tool_loop import AgentLimits, ToolLoop

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=api_key, max_retries=0) as client:
            agent = ToolLoop(client, model, limits=AgentLimits(retries=retries, retry_max_wait=0.05))
            return await agent.run(Shell(), server.solutions[0][0])  # a task the scripted models know

    return anyio.run(main)


def test_agent_401_is_a_refused_configuration_not_retried(tmp_path: Path) -> None:
    with RefusingServer(api_key="right") as server:
        result = _run_agent(server, "solver", api_key="wrong")
        assert server.requests["solver"] == 1  # not retried: a wrong key stays wrong
    assert result.finish_reason == "model_server"
    assert type(result.error) is ModelServerConfigError and result.error.status == 401
    assert "HTTP 401" in str(result.error) and "Incorrect API key" in str(result.error)


@pytest.mark.parametrize("model", EXTRA_MODELS)
def test_agent_400_or_422_that_is_not_the_models_is_a_refused_configuration(refusing, model: str) -> None:
    result = _run_agent(refusing, model)
    assert result.finish_reason == "model_server" and type(result.error) is ModelServerConfigError
    assert result.error.status == int(model[-3:]) and result.usage["requests"] == 1 and result.usage.get("retries", 0) == 0


def test_agent_context_overflow_is_the_models_scored_outcome(refusing) -> None:
    result = _run_agent(refusing, "context")
    assert result.finish_reason == "context_length" and result.error is None
    assert result.tool_calls == 1 and result.usage["requests"] == 2


def test_agent_500_is_retried_then_a_model_server_failure(refusing) -> None:
    result = _run_agent(refusing, "always-500", retries=2)
    assert refusing.requests["always-500"] == 3 and result.usage["retries"] == 2
    assert result.finish_reason == "model_server"
    assert type(result.error) is ModelServerError and result.error.status == 500 and "HTTP 500" in str(result.error)


def test_agent_malformed_tool_call_refused_by_the_server_is_the_models(refusing) -> None:
    # "misbehave" first calls bash with arguments that are no JSON; vLLM refuses the next request for it
    result = _run_agent(refusing, "misbehave")
    assert result.finish_reason == "invalid_tool_call" and result.error is None
    assert result.tool_failures == 1 and result.usage["requests"] == 2 and result.usage.get("retries", 0) == 0


@pytest.mark.range
def test_eval_records_a_refused_configuration_and_stops_the_run(refusing, tmp_path: Path) -> None:
    """Through ``evaluate``: the record the run-level rule reads (``error_type``), and the stop at the first."""
    from harbor_async import evaluate_sync
    from harbor_async.core.errors import ModelServerRefusedError
    from harbor_async.jobs.folder import JobFolder

    with pytest.raises(ModelServerRefusedError, match="HTTP 422"):
        evaluate_sync(
            ["refuse-422"], None, base_url=refusing.base_url, jobs_dir=tmp_path, job_name="job", n_tasks=1, n_concurrent=1
        )
    (record,) = JobFolder.open(tmp_path / "job").records()
    assert record.error_class == FailureClass.MODEL_SERVER.value and record.error_type == "ModelServerConfigError"
    assert record.reward is None and record.error_phase == "model"


# ── end to end: Harbor's terminus-2 (LiteLLM) against the scripted server ────

def _terminus_episode(tmp_path: Path, server: ScriptedServer, model: str, **agent_kwargs: Any):
    import tenacity
    from harbor.llms.lite_llm import LiteLLM

    from harbor_async.agents.harbor import HarborAgentSpec
    from harbor_async.agents.harbor_episode import HarborAgentRunner
    from harbor_async.engine.engine import Engine
    from harbor_async.episodes.runner import run_episode
    from harbor_async.tasks.suite import load_task

    task = load_task(echo_suite(tmp_path) / "tasks" / "echo-ok")
    spec = HarborAgentSpec("terminus-2", kwargs=agent_kwargs).with_server(model, server.base_url)  # kwargs: --ak

    async def main():
        async with Engine() as engine:
            return await run_episode(engine, task, "local", HarborAgentRunner(spec))

    original = LiteLLM.call.retry.wait
    LiteLLM.call.retry.wait = tenacity.wait_none()  # Harbor's 4-15 s backoff between its own retries
    try:
        return anyio.run(main, backend="asyncio")  # Harbor's agents run on asyncio
    finally:
        LiteLLM.call.retry.wait = original


@pytest.mark.slow
@pytest.mark.usefixtures("host_tmux")  # terminus-2 on local runs the host's tmux
def test_terminus2_meets_the_same_verdicts(refusing, tmp_path: Path) -> None:
    """A 422 and a 401 are refused configurations for Harbor's agents as for the harnesses; a 500 is transient."""
    refused = _terminus_episode(tmp_path / "a", refusing, "refuse-422")
    assert (refused.error_class, refused.error_phase, refused.reward) == ("model_server", "model", None)
    assert refused.error_type == "ModelServerConfigError" and "HTTP 422" in refused.error

    failing = _terminus_episode(tmp_path / "b", refusing, "always-500")
    assert (failing.error_class, failing.error_type, failing.reward) == ("model_server", "ModelServerError", None)
    assert "HTTP 500" in failing.error

    with RefusingServer(echo_suite(tmp_path / "c") / "tasks", api_key="right") as keyed:
        unauthorized = _terminus_episode(tmp_path / "d", keyed, "terminus", llm_kwargs={"api_key": "wrong"})
        assert keyed.auth == {"Bearer wrong"}
    assert (unauthorized.error_class, unauthorized.error_type) == ("model_server", "ModelServerConfigError")
    assert "HTTP 401" in unauthorized.error and unauthorized.reward is None
