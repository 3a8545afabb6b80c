"""Harbor's own agents in ``run`` and ``eval``: terminus-2 against a scripted model server, real sandboxes.

The scripted server (tests/scripted_server.py, model ``terminus``) speaks
terminus-2's JSON protocol: it sends the keystrokes of the task's solution,
then marks the task complete twice (terminus-2 asks for a confirmation). The
fixture task's verifier gives 1 only if the command ran in the sandbox. Agents
that cannot run somewhere are refused before any sandbox starts, in one line.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from harbor_async.agents.harbor import (
    HarborAgentSpec,
    agent_class,
    is_harbor_agent,
    parse_agent_kwargs,
    served_model_name,
)
from harbor_async.agents.task_checks import (
    RUN,
    UnsupportedAgentError,
    check_tasks,
    driver_refusals,
)
from harbor_async.core.errors import AgentConfigError
from tests.cli_helpers import harbor_async, records
from tests.scripted_server import ScriptedServer

pytestmark = pytest.mark.slow  # real sandboxes, a real agent, CLI processes

INSTRUCTION = "Write the word ok into the file /app/answer.\n"
VERIFIER = """\
#!/bin/sh
mkdir -p /logs/verifier
if [ "$(cat {path} 2>/dev/null)" = "ok" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    path.chmod(mode)


def echo_suite(root: Path, *, multi_step: bool = False, agent_network: str | None = None, network: str | None = None) -> Path:
    """A suite of one task: reward 1 only if ``echo ok > /app/answer`` ran (each step: its own file)."""
    task = root / "tasks" / ("echo-steps" if multi_step else "echo-ok")
    agent = "[agent]\ntimeout_sec = 120.0\n" + (f'network_mode = "{agent_network}"\n' if agent_network else "")
    steps = ""
    if multi_step:
        steps = '\n[[steps]]\nname = "first"\n\n[[steps]]\nname = "second"\n'
        for name, path in (("first", "/app/answer"), ("second", "/app/second")):
            _write(task / "steps" / name / "instruction.md", f"Write the word ok into the file {path}.\n")
            _write(task / "steps" / name / "solution" / "solve.sh", f"#!/bin/sh\necho ok > {path}\n", 0o755)
            _write(task / "steps" / name / "tests" / "test.sh", VERIFIER.format(path=path), 0o755)
    else:
        _write(task / "instruction.md", INSTRUCTION)
        _write(task / "solution" / "solve.sh", "#!/bin/sh\necho ok > /app/answer\n", 0o755)
        _write(task / "tests" / "test.sh", VERIFIER.format(path="/app/answer"), 0o755)
    environment = f'[environment]\nnetwork_mode = "{network}"\n\n' if network else ""
    _write(task / "task.toml", f'schema_version = "1.4"\n\n{environment}[verifier]\ntimeout_sec = 60.0\n\n{agent}{steps}')
    _write(task / "environment" / "Dockerfile", "FROM debian:bookworm-slim\nWORKDIR /app\n")
    return root




def _job(root: Path) -> Path:
    (job,) = [p for p in root.iterdir() if p.is_dir()]
    return job


def _eval_terminus(tmp_path: Path, env: str) -> None:
    suite = echo_suite(tmp_path / "suite")
    with ScriptedServer(suite / "tasks") as server:
        result = harbor_async(
            "eval", "-p", str(suite), "-a", "terminus-2", "-m", "terminus", "--base-url", server.base_url,
            "-e", env, "-k", "2", "-o", str(tmp_path / "jobs"), timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert server.requests["terminus"] == 6  # per episode: the keystrokes, "complete", its confirmation
    found = records(_job(tmp_path / "jobs"))
    assert [(r["agent"], r["model"], r["reward"], r["error_class"]) for r in found] == [("terminus-2", "terminus", 1.0, None)] * 2
    for record in found:
        assert record["usage"]["n_input_tokens"] > 0 and record["usage"]["n_output_tokens"] > 0


@pytest.mark.range
def test_eval_runs_terminus2_on_local(tmp_path: Path, host_tmux: None) -> None:
    _eval_terminus(tmp_path, "local")


@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_eval_runs_terminus2_on_docker(tmp_path: Path) -> None:
    found = subprocess.run(
        ["docker", "run", "--rm", "--pull", "never", "--network", "none", "debian:bookworm-slim", "tmux", "-V"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert found.returncode == 0, "the base image lacks tmux: rerun `bash .ci/docker-setup` (it rebuilds it with tmux)"
    _eval_terminus(tmp_path, "docker")


def test_run_takes_terminus2_with_model_and_agent_kwargs(tmp_path: Path, host_tmux: None) -> None:
    """``-a terminus-2 -m hosted_vllm/NAME --ak api_base=URL`` as ``harbor run`` spells it; tokens and cost in the record."""
    suite = echo_suite(tmp_path / "suite")
    info = {"max_input_tokens": 32768, "max_output_tokens": 8192, "input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}
    with ScriptedServer(suite / "tasks") as server:
        result = harbor_async(
            "run", "-p", str(suite), "-a", "terminus-2", "-m", "hosted_vllm/terminus", "--ak", f"api_base={server.base_url}",
            "--ak", f"model_info={json.dumps(info)}", "-o", str(tmp_path / "jobs"),
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    job = _job(tmp_path / "jobs")
    (record,) = records(job)
    assert (record["agent"], record["model"], record["reward"]) == ("terminus-2", "hosted_vllm/terminus", 1.0)
    usage = record["usage"]
    expected_cost = usage["n_input_tokens"] * 1e-6 + usage["n_output_tokens"] * 2e-6
    assert usage["n_input_tokens"] > 0 and usage["cost_usd"] == pytest.approx(expected_cost)
    settings = json.loads((job / "harbor-async.json").read_text())
    assert settings["models"] == ["hosted_vllm/terminus"] and settings["agent_kwargs"]["model_info"] == info
    # Harbor's trial folder: the agent's own trajectory and logs, its tokens and cost in Harbor's result
    trial = job / record["trial"]
    assert json.loads((trial / "agent" / "trajectory.json").read_text())["steps"]
    harbor_result = json.loads((trial / "result.json").read_text())
    assert harbor_result["agent_info"]["model_info"] == {"name": "terminus", "provider": "hosted_vllm"}  # as Harbor splits it
    assert harbor_result["agent_result"]["n_input_tokens"] == usage["n_input_tokens"]
    assert harbor_result["agent_result"]["cost_usd"] == pytest.approx(expected_cost)
    summary = json.loads((job / "summary.json").read_text())  # and the job's totals
    assert summary["usage"]["n_input_tokens"] == usage["n_input_tokens"] and summary["usage"]["cost_usd"] == pytest.approx(expected_cost)


def test_terminus2_acts_on_each_step_of_a_multi_step_task(tmp_path: Path, host_tmux: None) -> None:
    suite = echo_suite(tmp_path / "suite", multi_step=True)
    with ScriptedServer(suite / "tasks") as server:
        result = harbor_async(
            "run", "-p", str(suite), "-a", "terminus-2", "-m", "hosted_vllm/terminus",
            "--base-url", server.base_url, "-o", str(tmp_path / "jobs"),
        )  # fmt: skip  # harbor run's --base-url: terminus-2's api_base
        assert server.requests["terminus"] == 6  # three answers per step
    assert result.returncode == 0, result.stderr
    (record,) = records(_job(tmp_path / "jobs"))
    assert record["reward"] == 1.0
    assert [(s["name"], s["reward"]) for s in record["steps"]] == [("first", 1.0), ("second", 1.0)]
    assert record["usage"]["n_input_tokens"] > 0


@pytest.mark.parametrize("command", ["run", "eval"])
def test_an_agent_that_installs_itself_is_refused_on_local_in_one_line(tmp_path: Path, command: str) -> None:
    suite = echo_suite(tmp_path / "suite")
    extra = ["-m", "anything", "--base-url", "http://127.0.0.1:9/v1"] if command == "eval" else []
    result = harbor_async(command, "-p", str(suite), "-a", "claude-code", *extra, "-o", str(tmp_path / "jobs"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "claude-code" in lines[0] and "no network" in lines[0], result.stderr
    assert not (tmp_path / "jobs").exists()  # refused before any job folder or sandbox


@pytest.mark.parametrize("command", ["run", "eval"])
def test_an_unknown_agent_is_one_line_listing_the_choices(tmp_path: Path, command: str) -> None:
    extra = ["-m", "anything", "--base-url", "http://127.0.0.1:9/v1"] if command == "eval" else []
    result = harbor_async(command, "-p", str(echo_suite(tmp_path / "suite")), "-a", "no-such-agent", *extra)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-agent" in lines[0] and "terminus-2" in lines[0] and "claude-code" in lines[0]


def test_bad_agent_options_fail_before_any_sandbox(tmp_path: Path) -> None:
    suite = echo_suite(tmp_path / "suite")
    missing = harbor_async("run", "-p", str(suite), "-a", "terminus-2", "-o", str(tmp_path / "jobs"))  # no -m
    assert missing.returncode == 2 and "model_name is required" in missing.stderr, missing.stderr
    malformed = harbor_async("run", "-p", str(suite), "-a", "terminus-2", "-m", "hosted_vllm/x", "--ak", "no-equals-sign")
    assert malformed.returncode == 2 and "--ak" in malformed.stderr and "key=value" in malformed.stderr
    assert not (tmp_path / "jobs").exists()


# ── in-process: the pieces the commands are made of ─────────────────────────


def test_agent_kwargs_are_parsed_as_harbor_run_parses_them() -> None:
    from harbor.cli.utils import parse_kwargs

    pairs = ["n=3", "flag=True", "items=[1, 2]", "info={\"a\": 1}", "text=hello world", "none=None"]
    assert parse_agent_kwargs(pairs) == parse_kwargs(pairs) == {
        "n": 3, "flag": True, "items": [1, 2], "info": {"a": 1}, "text": "hello world", "none": None,
    }  # fmt: skip
    with pytest.raises(AgentConfigError, match="key=value"):
        parse_agent_kwargs(["oops"])


def test_names_resolve_to_harbor_agents_or_harnesses() -> None:
    from harbor.agents.terminus_2 import Terminus2

    assert agent_class("terminus-2") is Terminus2
    assert agent_class("harbor.agents.terminus_2:Terminus2") is Terminus2
    assert is_harbor_agent("terminus-2") and is_harbor_agent("harbor.agents.terminus_2:Terminus2")
    assert not is_harbor_agent("bash") and not is_harbor_agent("harbor_async.harnesses:BashHarness")
    with pytest.raises(AgentConfigError, match="not a Harbor BaseAgent"):
        agent_class("harbor_async.harnesses:BashHarness")
    assert served_model_name("ckpt-400") == "hosted_vllm/ckpt-400"
    assert served_model_name("runs/ckpts/checkpoint-400") == "openai/runs/ckpts/checkpoint-400"


def test_eval_points_terminus2_at_the_server(tmp_path: Path) -> None:
    spec = HarborAgentSpec("terminus-2", kwargs={"max_turns": 5}).with_server("ckpt", "http://127.0.0.1:8000/v1", temperature=0.5)
    assert spec.model_name == "hosted_vllm/ckpt"
    assert spec.kwargs == {"api_base": "http://127.0.0.1:8000/v1", "temperature": 0.5, "max_turns": 5}
    agent = spec.build(tmp_path)
    assert agent.options.record_terminal_session is False  # asciinema would need a network install
    assert agent._llm._api_base == "http://127.0.0.1:8000/v1"
    path = HarborAgentSpec("terminus-2").with_server("ckpts/checkpoint-4", "http://127.0.0.1:8000/v1")
    assert path.model_name == "openai/ckpts/checkpoint-4"  # LiteLLM's vLLM provider takes no path
    assert path.kwargs["llm_kwargs"] == {"api_key": "EMPTY"}  # its OpenAI route wants a key; the server ignores it


def test_an_agent_that_installs_itself_needs_the_network_of_its_phase(tmp_path: Path) -> None:
    from harbor.agents.installed.claude_code import ClaudeCode
    from harbor.agents.terminus_2 import Terminus2

    from harbor_async.tasks.suite import load_task

    offline = load_task(echo_suite(tmp_path / "offline", agent_network="no-network") / "tasks" / "echo-ok")
    online = load_task(echo_suite(tmp_path / "online") / "tasks" / "echo-ok")
    refused = driver_refusals(offline, replace(RUN, agent=ClaudeCode))
    assert [r.feature for r in refused] == ["[agent] network_mode = 'no-network'"]
    assert "claude-code" in refused[0].reason
    assert driver_refusals(online, replace(RUN, agent=ClaudeCode)) == []
    assert driver_refusals(offline, replace(RUN, agent=Terminus2)) == []  # its commands need no network
    closed = load_task(echo_suite(tmp_path / "closed", network="no-network") / "tasks" / "echo-ok")
    assert [r.feature for r in driver_refusals(closed, replace(RUN, agent=ClaudeCode))] == [
        "[environment] network_mode = 'no-network'"  # its setup installs under the environment's policy
    ]


def test_terminus2_on_local_is_refused_without_tmux_on_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harbor.agents.terminus_2 import Terminus2

    from harbor_async.backends import resolve_backend
    from harbor_async.tasks.suite import load_task

    task = load_task(echo_suite(tmp_path) / "tasks" / "echo-ok")
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # a host without tmux
    with pytest.raises(UnsupportedAgentError, match="needs tmux") as caught:
        check_tasks([task], resolve_backend("local"), driver=replace(RUN, agent=Terminus2))
    assert len(str(caught.value).splitlines()) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # Harbor's agents run on asyncio
async def test_a_model_server_that_cannot_be_reached_is_not_the_models_failure(tmp_path: Path, host_tmux: None, monkeypatch) -> None:
    import tenacity
    from harbor.llms.lite_llm import LiteLLM

    from harbor_async.agents.harbor_episode import HarborAgentRunner
    from harbor_async.engine.engine import Engine
    from harbor_async.episodes.runner import run_episode
    from harbor_async.models.serve import free_port
    from harbor_async.tasks.suite import load_task

    task = load_task(echo_suite(tmp_path) / "tasks" / "echo-ok")
    spec = HarborAgentSpec("terminus-2").with_server("terminus", f"http://127.0.0.1:{free_port()}/v1")  # nothing listens
    monkeypatch.setattr(LiteLLM.call.retry, "wait", tenacity.wait_none())  # Harbor's 4-15 s backoff: retried at once here
    async with Engine() as engine:
        record = await run_episode(engine, task, "local", HarborAgentRunner(spec))
    assert (record.error_class, record.error_phase, record.reward) == ("model_server", "model", None)  # rerun, never scored


def test_a_harbor_agent_gets_the_tasks_mcp_servers_and_skills_as_in_harbors_trial(tmp_path: Path) -> None:
    """``[environment] mcp_servers`` and ``skills_dir`` reach the agent's constructor, as Harbor's trial passes them."""
    from harbor_async.tasks.suite import load_task

    task_dir = echo_suite(tmp_path) / "tasks" / "echo-ok"
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace(
        "[verifier]", '[environment]\nskills_dir = "/skills"\n\n[[environment.mcp_servers]]\nname = "files"\n'
        'transport = "stdio"\ncommand = "mcp-files"\n\n[verifier]', 1,
    ))  # fmt: skip
    agent = HarborAgentSpec("terminus-2", "hosted_vllm/x").build(tmp_path / "logs", load_task(task_dir))
    assert [server.name for server in agent.mcp_servers] == ["files"] and agent.skills_dir == "/skills"
    bare = HarborAgentSpec("terminus-2", "hosted_vllm/x").build(tmp_path / "logs2")
    assert bare.mcp_servers == [] and bare.skills_dir is None


def test_a_person_at_a_terminal_is_told_at_once_that_a_harbor_agent_is_loading(tmp_path: Path) -> None:
    """On a terminal the first line comes before Harbor's agent libraries load (seconds); piped, errors stay one line."""
    import os
    import pty
    import subprocess
    import sys

    from tests.cli_helpers import REPO

    leader, follower = pty.openpty()
    argv = [sys.executable, "-m", "harbor_async", "run", "-e", "simulated", "-l", "1", "-a", "terminus-2", "-m", "hosted_vllm/x",
            "--base-url", "http://127.0.0.1:9/v1", "-o", str(tmp_path / "jobs")]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    proc.wait(timeout=120)
    os.close(leader)
    import re

    text = " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode(errors="replace")).split())  # no styles, no wraps
    assert proc.returncode == 2
    assert text.index("loading: -a terminus-2") < text.index("unreachable"), text
