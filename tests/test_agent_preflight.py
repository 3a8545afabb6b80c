"""``run -a terminus-2`` checks the agent's model server before any job folder or sandbox.

A real ``harbor-async run`` process against a port nothing listens on, and
against the scripted OpenAI-compatible server (tests/scripted_server.py) when
it refuses ``GET /v1/models`` (401): exit 2 in one line naming the server's
URL and what it answered, before any episode (no job folder: no LiteLLM
retries in every episode). In-process, the probe
(:func:`harbor_async.agents.harbor.check_model_server`) sends the key Harbor
resolves for the agent, and skips an agent with no base URL of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_async.agents.harbor import HarborAgentSpec, check_model_server
from harbor_async.models.serve import ServerAuthError, ServerUnreachableError, free_port
from harbor_async.suites import example_suite_path
from tests.cli_helpers import harbor_async
from tests.scripted_server import ScriptedServer

SUITE = example_suite_path()
REPO = Path(__file__).resolve().parent.parent


def _run_terminus(tmp_path: Path, base_url: str, *extra: str, env: dict | None = None):
    return harbor_async(
        "run", "-p", str(SUITE), "-l", "1", "-a", "terminus-2", "-m", "hosted_vllm/terminus",
        "--ak", f"api_base={base_url}", "-e", "local", "-o", str(tmp_path / "jobs"), *extra, env=env, timeout=120,
    )  # fmt: skip


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.slow
def test_run_refuses_a_model_server_nothing_answers_at_before_any_job_folder(tmp_path: Path, host_tmux: None) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    result = _run_terminus(tmp_path, url)
    assert result.returncode == 2, result.stderr
    line = _one_line(result.stderr)
    assert line.startswith("error:") and url in line and "unreachable" in line, line
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "jobs").exists()  # no job folder, so no sandbox either


@pytest.mark.slow
def test_run_refuses_a_model_server_that_answers_401_on_models(tmp_path: Path, host_tmux: None) -> None:
    with ScriptedServer(api_key="the-right-key", models="401") as server:
        result = _run_terminus(tmp_path, server.base_url)
        assert server.requests == {}  # refused before any chat request
    assert result.returncode == 2, result.stderr
    line = _one_line(result.stderr)
    assert server.base_url in line and "HTTP 401" in line, line
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_eval_probes_the_server_a_harbor_agent_calls_not_only_base_url(tmp_path: Path, host_tmux: None) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # --ak api_base wins over --base-url: the agent would call this
    with ScriptedServer() as server:
        result = subprocess.run(
            [sys.executable, "-m", "harbor_async", "eval", "-m", "terminus", "--base-url", server.base_url,
             "-a", "terminus-2", "--ak", f"api_base={dead}", "-p", str(SUITE), "-l", "1", "-e", "local",
             "-o", str(tmp_path / "jobs")],
            capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        assert server.requests == {}  # no episode asked the server that does answer
    assert result.returncode == 2, result.stderr
    assert dead in result.stderr and "Traceback" not in result.stderr


# ── in-process: the probe ──────────────────────────────────────────────────


@pytest.mark.slow
def test_the_probe_sends_the_key_harbor_resolves_for_the_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HA_PREFLIGHT_KEY", "the-right-key")
    with ScriptedServer(api_key="the-right-key", models="401") as server:
        with_key = HarborAgentSpec(
            "terminus-2", "hosted_vllm/terminus", {"api_base": server.base_url, "model_api_key_name": "HA_PREFLIGHT_KEY"}
        )
        assert check_model_server(with_key) == server.base_url
        in_llm_kwargs = HarborAgentSpec(
            "terminus-2", "hosted_vllm/terminus", {"api_base": server.base_url, "llm_kwargs": {"api_key": "the-right-key"}}
        )
        assert check_model_server(in_llm_kwargs) == server.base_url
        without = HarborAgentSpec("terminus-2", "hosted_vllm/terminus", {"api_base": server.base_url})
        with pytest.raises(ServerAuthError, match="HTTP 401"):
            check_model_server(without)


def test_the_probe_refuses_a_server_error_and_takes_harbors_base_url_spelling() -> None:
    with ScriptedServer(models="500") as server:
        spec = HarborAgentSpec("terminus-2", "hosted_vllm/terminus", {"base_url": server.base_url})  # --base-url's spelling
        with pytest.raises(ServerUnreachableError, match="HTTP 500") as caught:
            check_model_server(spec)
    assert server.base_url in str(caught.value)


def test_an_agent_without_an_openai_server_of_its_own_is_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hosted provider's default endpoint (``openai/gpt-x``): nothing local to check, no request made."""
    for name in ("OPENAI_BASE_URL", "OPENAI_API_BASE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-used")
    assert check_model_server(HarborAgentSpec("terminus-2", "openai/gpt-4o")) is None
    # a server of another API than OpenAI's (Anthropic's messages): no /models of OpenAI's to ask
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-not-used")
    assert check_model_server(HarborAgentSpec("terminus-2", "anthropic/claude-sonnet-4", {"api_base": dead})) is None
    # the provider's variable naming a local server makes it the agent's: probed
    url = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setenv("OPENAI_BASE_URL", url)
    with pytest.raises(ServerUnreachableError, match=url.replace(".", r"\.")):
        check_model_server(HarborAgentSpec("terminus-2", "openai/gpt-4o"))
