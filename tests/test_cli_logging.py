"""Logging set-up of the commands: ``eval`` reads its log flags and variables as ``run`` does; LiteLLM writes to the job's log.

Each case is a real process: a bad ``--log-level`` (or ``$HARBOR_ASYNC_LOG_LEVEL``)
is one line and exit 2, no traceback; once a command has configured logging,
LiteLLM's records (its own loggers, and a warning LiteLLM's own code logs) go
to the job folder's ``harbor-async.log`` and never to the terminal, where they
would print over the progress bar.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harbor_async.core.logs import JOB_LOG_NAME
from harbor_async.models.serve import free_port
from tests.cli_helpers import REPO, harbor_async


def _eval(tmp_path: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # never reached: the log settings are checked first
    return harbor_async("eval", "-m", "x", "--base-url", dead, "-o", str(tmp_path / "jobs"), *extra, env=env, timeout=120)


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("extra", "env", "expected"),
    [
        (["--log-level", "loud"], None, "log level 'loud' (given) is not one of"),
        (["--log-format", "xml"], None, "log format 'xml' (given) is not one of"),
        ([], {"HARBOR_ASYNC_LOG_LEVEL": "loud"}, "log level 'loud' (from $HARBOR_ASYNC_LOG_LEVEL) is not one of"),
        ([], {"HARBOR_ASYNC_LOG_FORMAT": "xml"}, "log format 'xml' (from $HARBOR_ASYNC_LOG_FORMAT) is not one of"),
    ],
)
def test_eval_answers_a_bad_log_setting_in_one_line_with_exit_2(tmp_path: Path, extra, env, expected) -> None:
    result = _eval(tmp_path, *extra, env=env)
    assert result.returncode == 2, result.stderr
    line = _one_line(result)
    assert line.startswith("error:") and expected in line, line
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slow
def test_evals_log_flag_wins_over_the_variable(tmp_path: Path) -> None:
    result = _eval(tmp_path, "--log-level", "warning", env={"HARBOR_ASYNC_LOG_LEVEL": "loud"})
    assert "log level" not in result.stderr and "unreachable" in result.stderr, result.stderr  # it went on to the server


# ── LiteLLM's output goes to the job's log ─────────────────────────────────

CHILD = textwrap.dedent(
    """
    import logging, os, sys
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from harbor_async.jobs.folder import JobFolder
    from harbor_async.core.logs import configure_logging

    mode, jobs = sys.argv[1], sys.argv[2]
    if mode != "library":  # a command's set-up (the library alone leaves LiteLLM's logging as it is)
        configure_logging()
    if mode != "late-import":
        import litellm
    job = JobFolder.create(jobs, "job", {})
    if mode == "late-import":  # LiteLLM imported after the job folder: its own stderr handler is added now
        import litellm
    logging.getLogger("LiteLLM").warning("marker-from-litellm-logger")
    logging.getLogger("LiteLLM Router").error("marker-from-litellm-router")
    # LiteLLM's own code logging a warning: custom pricing without the cache costs
    litellm.register_model({"marker-model": {
        "litellm_provider": "hosted_vllm", "mode": "chat", "max_input_tokens": 100, "max_output_tokens": 100,
        "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
    }})
    print("suppress_debug_info", litellm.suppress_debug_info)
    """
)


def _child(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    result = subprocess.run(
        [sys.executable, str(script), mode, str(tmp_path / "jobs")],
        capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result, tmp_path / "jobs" / "job" / JOB_LOG_NAME


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["imported-first", "late-import"])
def test_litellm_logs_into_the_job_log_not_the_terminal(tmp_path: Path, mode: str) -> None:
    result, log = _child(tmp_path, mode)
    terminal = result.stdout + result.stderr
    assert "marker" not in terminal, terminal
    text = log.read_text()
    assert "WARNING LiteLLM: marker-from-litellm-logger" in text
    assert "ERROR LiteLLM Router: marker-from-litellm-router" in text
    assert "marker-model" in text and "cache_creation_input_token_cost" in text  # LiteLLM's own warning
    assert "suppress_debug_info True" in result.stdout  # its printed "Give Feedback / Get Help" hints off


@pytest.mark.slow
def test_without_a_commands_set_up_litellm_keeps_its_own_output(tmp_path: Path) -> None:
    """The library never configures logging: LiteLLM prints as it always does, and no job log is made."""
    result, log = _child(tmp_path, "library")
    assert "marker-from-litellm-logger" in result.stderr and "marker-model" in result.stderr
    assert not log.exists()
