"""``harbor-async eval`` as a user runs it: a separate process, real sandboxes, real servers on 127.0.0.1.

Covers resume after a kill, a sweep's outputs, bad input (each a clear error
and no leaked sandbox or server process), a managed server dying mid-run, and
a real ``transformers serve`` of the tiny test model started through ``--serve-cmd``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from harbor_async.jobs.folder import JobFolder
from harbor_async.models.serve import free_port
from tests.scripted_server import ScriptedServer

pytestmark = pytest.mark.slow  # a real trainer, cluster, daemon, browser or wheel

REPO = Path(__file__).resolve().parent.parent
SCRIPTED = REPO / "tests" / "scripted_server.py"


def _cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harbor_async", "eval", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def _processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(marker in a for a in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _comparable(summary: dict) -> dict:
    return {
        k: summary[k] for k in ("episodes", "tasks", "completed", "failures", "mean_reward", "pass_at_k", "per_task")
    }


def test_resume_after_a_kill_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    args = ["-m", "slow", "-l", "6", "-n", "2", "-o", str(tmp_path)]
    with ScriptedServer(slow_seconds=1.0) as server:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harbor_async",
                "eval",
                *args,
                "--job-name",
                "killed",
                "--base-url",
                server.base_url,
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        episodes = tmp_path / "killed" / "episodes.jsonl"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if episodes.exists() and len(episodes.read_text().splitlines()) >= 2:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        assert b"resume with --resume" in proc.stderr.read()  # stopped cleanly (the leak check confirms)
        before = JobFolder(tmp_path / "killed").records()
        finished = [r.key for r in before if not r.rerun]
        assert 2 <= len(finished) < 6, "the kill came after the run ended"
        assert {r.error_class for r in before if r.rerun} <= {"cancelled"}  # the episodes in flight: recorded, cancelled
        requests_before = server.requests["slow"]

        resumed = _cli("--resume", str(tmp_path / "killed"), "--base-url", server.base_url)
        assert resumed.returncode == 0, resumed.stderr
        keys = [r.key for r in JobFolder(tmp_path / "killed").records() if not r.rerun]
        assert len(keys) == len(set(keys)) == 6  # no finished episode ran again
        assert keys[: len(finished)] == finished
        assert server.requests["slow"] - requests_before == 2 * (6 - len(finished))  # two replies an episode

    with ScriptedServer(slow_seconds=0.05) as server:
        whole = _cli(*args, "--job-name", "whole", "--base-url", server.base_url)
        assert whole.returncode == 0, whole.stderr
    killed = json.loads((tmp_path / "killed" / "summary.json").read_text())
    uninterrupted = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert _comparable(killed) == _comparable(uninterrupted)
    assert killed["mean_reward"] == 1.0 and killed["episodes"] == 6


def test_sweep_of_two_models_writes_table_paired_interval_and_plot(tmp_path: Path) -> None:
    with ScriptedServer() as server:
        result = _cli(
            "-m",
            "solver",
            "-m",
            "half",
            "-l",
            "4",
            "-n",
            "4",
            "-o",
            str(tmp_path),
            "--job-name",
            "sweep",
            "--base-url",
            server.base_url,
        )
    assert result.returncode == 0, result.stderr
    job = tmp_path / "sweep"
    summary = json.loads((job / "summary.json").read_text())
    assert summary["models"]["solver"]["mean_reward"] == 1.0 and summary["models"]["half"]["mean_reward"] == 0.5
    pair = summary["sweep"]["vs_first"][0]
    assert (pair["base"], pair["other"], pair["tasks"], pair["difference"]) == ("solver", "half", 4, -0.5)
    low, high = pair["ci"]
    assert -1.0 <= low <= -0.5 <= high <= 0.0
    table = (job / "sweep.csv").read_text().splitlines()
    assert table[0].startswith("model,step,episodes,mean_reward") and len(table) == 3
    assert table[2].startswith("half,,4,0.5,")
    assert (job / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "paired differences" in result.stdout and "-0.500" in result.stdout
    assert {r.model for r in JobFolder(job).records()} == {"solver", "half"}


def test_a_wrong_api_key_stops_the_eval_in_one_line_and_scores_nothing(tmp_path: Path) -> None:
    with ScriptedServer(api_key="right-key", slow_seconds=0) as server:
        result = _cli(
            "-m", "solver", "--base-url", server.base_url, "-l", "10", "-n", "2", "--model-retries", "0",
            "--max-model-server-failures", "3", "-o", str(tmp_path), "--job-name", "j",
            env={"OPENAI_API_KEY": "wrong-key"},
        )  # fmt: skip
        chats = server.requests["solver"]
    assert result.returncode == 3, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "HTTP 401" in lines[0] and server.base_url in lines[0], result.stderr
    assert "Incorrect API key" in lines[0] and f"harbor-async eval --resume {tmp_path / 'j'}" in lines[0]
    assert chats < 10  # it stopped: not every episode knocked on the door
    summary = json.loads((tmp_path / "j" / "summary.json").read_text())
    assert summary["complete"] is False and summary["planned_episodes"] == 10
    assert summary["mean_reward"] is None and summary["completed"] == 0  # nothing judged: no 0.000 headline
    # A refused key is a configuration error: the first one stops the eval (the other slot's episode is cancelled).
    assert summary["not_judged_by_class"]["model_server"] >= 1 and "refused" in summary["stopped_by"]
    assert chats <= 2


def test_a_killed_server_stops_the_eval_and_keeps_the_judged_episodes(tmp_path: Path) -> None:
    port = free_port()  # a server process of its own, killed as a crashed server would be
    server = subprocess.Popen([sys.executable, str(SCRIPTED), "--port", str(port), "--slow-seconds", "1"], cwd=REPO)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            assert time.monotonic() < deadline, "the scripted server did not come up"
            time.sleep(0.1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "harbor_async", "eval", "-m", "slow", "--base-url", url, "-l", "10", "-n", "1",
         "--model-retries", "0", "-o", str(tmp_path), "--job-name", "j"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    job = tmp_path / "j"
    deadline = time.monotonic() + 120
    while not (job / "episodes.jsonl").is_file() or not (job / "episodes.jsonl").read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "no episode"
        time.sleep(0.1)
    server.kill()  # mid-eval: every later request is refused
    server.wait()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 3, err
    assert "failed 5 episodes in a row" in err and f"--resume {job}" in err
    summary = json.loads((job / "summary.json").read_text())
    judged = [r for r in JobFolder(job).records() if not r.rerun]
    assert judged and all(r.reward == 1.0 for r in judged)  # what ran before the kill
    assert summary["mean_reward"] == 1.0  # the server's failures are not zeros
    assert summary["not_judged_by_class"].get("model_server", 0) >= 5 and summary["complete"] is False


def test_a_backend_whose_package_is_missing_is_one_line_before_the_server(tmp_path: Path) -> None:
    with ScriptedServer() as server:
        result = _cli(
            "-m", "solver", "--base-url", server.base_url, "-e", "e2b", "-l", "2", "-o", str(tmp_path / "jobs"),
            env={"PYTHONPATH": str(Path(__file__).parent / "missing_packages")},  # E2B's SDK hidden, as not installed
        )  # fmt: skip
        assert server.requests == {}
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "pip install 'harbor[e2b]'" in errors[0], result.stderr
    assert not (tmp_path / "jobs").exists()


def test_a_server_listing_no_model_is_used_when_the_model_answers_a_chat(tmp_path: Path) -> None:
    # transformers serve of a local folder lists nothing at /v1/models, yet serves it.
    with ScriptedServer(models="empty", slow_seconds=0) as server:
        result = _cli("-m", "solver", "--base-url", server.base_url, "-l", "1", "-o", str(tmp_path), "--job-name", "j")
    assert result.returncode == 0, result.stderr
    assert "model not listed by the server, but it answers a chat request" in result.stderr
    assert [r.reward for r in JobFolder(tmp_path / "j").records()] == [1.0]


def test_a_401_on_the_model_list_says_the_key_was_refused(tmp_path: Path) -> None:
    with ScriptedServer(models="401", api_key="right") as server:
        result = _cli("-m", "solver", "--base-url", server.base_url, "-l", "1", "-o", str(tmp_path), env={"OPENAI_API_KEY": "wrong"})
    assert result.returncode == 2
    assert "ServerAuthError" in result.stderr and "HTTP 401" in result.stderr and "--api-key-name" in result.stderr
    assert "ServerUnreachableError" not in result.stderr


def test_a_managed_server_answering_500_fails_fast_with_its_error_and_log(tmp_path: Path) -> None:
    serve = f"{sys.executable} {SCRIPTED} --port {{port}} --models 500"
    result = _cli(
        "-m", "solver", "--serve-cmd", serve, "--ready-error-timeout", "3", "-l", "1", "-o", str(tmp_path),
        "--job-name", "j", timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "ServerNotReadyError" in result.stderr and "kept failing for 3 s" in result.stderr
    assert "GET /v1/models: HTTP 500" in result.stderr and "hub cache not found" in result.stderr
    assert "scripted server on" in result.stderr  # the log's tail
    assert "scripted server on" in (tmp_path / "j" / "server.log").read_text()  # kept: the server said something


def test_without_vllm_the_error_names_the_cpu_way(tmp_path: Path) -> None:
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = _cli("-m", str(model), "-l", "1", "-o", str(tmp_path / "jobs"), env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert "cannot start the model server 'vllm'" in result.stderr and "transformers serve" in result.stderr
    assert not (tmp_path / "jobs").exists() or list((tmp_path / "jobs").iterdir()) == []  # no empty job folder


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    result = _cli("-m", "solver", "--base-url", f"http://127.0.0.1:{free_port()}/v1", "-l", "1", "-o", str(tmp_path))
    assert result.returncode == 2
    assert "ServerUnreachableError" in result.stderr and "unreachable" in result.stderr


def test_wrong_model_name_is_a_clear_error(tmp_path: Path) -> None:
    with ScriptedServer() as server:
        result = _cli("-m", "no-such-model", "--base-url", server.base_url, "-l", "1", "-o", str(tmp_path))
    assert result.returncode == 2
    assert "ModelNotServedError" in result.stderr and "'no-such-model' not served" in result.stderr
    assert "a chat request for it: HTTP 404" in result.stderr  # asked, as a server listing nothing would be
    assert server.requests.get("solver", 0) == 0  # refused before any episode


def test_empty_suite_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "suite" / "tasks").mkdir(parents=True)
    with ScriptedServer() as server:
        result = _cli("-m", "solver", "--base-url", server.base_url, "-p", str(tmp_path / "suite"), "-o", str(tmp_path))
    assert result.returncode == 2 and "EmptySuiteError" in result.stderr


def test_a_server_that_never_becomes_ready_is_stopped(tmp_path: Path) -> None:
    marker = f"never-ready-{uuid.uuid4().hex}"
    serve = f"{sys.executable} -c 'import time; time.sleep(600)' {marker} {{port}}"
    result = _cli(
        "-m", "solver", "--serve-cmd", serve, "--ready-timeout", "3", "-l", "1", "-o", str(tmp_path), "--job-name", "j"
    )
    assert result.returncode == 2 and "ServerNotReadyError" in result.stderr
    assert _processes_with(marker) == []
    assert marker in (tmp_path / "j" / "server.log").read_text()  # the command line heads the log


def test_a_managed_server_dying_mid_run_is_a_clear_error(tmp_path: Path) -> None:
    marker = f"dying-{uuid.uuid4().hex}"
    serve = f"{sys.executable} {SCRIPTED} --port {{port}} --die-after 3 --suite {REPO / 'harbor_async/suites/example/tasks'}"
    result = _cli(
        "-m",
        "solver",
        "--serve-cmd",
        f"{serve} --slow-seconds 0 --tag {marker}",
        "-l",
        "4",
        "-n",
        "2",
        "--model-retries",
        "1",
        "-o",
        str(tmp_path),
        "--job-name",
        "j",
    )
    assert result.returncode == 1, result.stderr
    assert "ServerDiedError" in result.stderr and "exited" in result.stderr
    assert _processes_with(marker) == []
    assert "scripted server on" in (tmp_path / "j" / "server.log").read_text()
    # the episodes that finished before the crash are kept; the others are recorded, not judged: a resume runs them
    records = JobFolder(tmp_path / "j").records()
    assert all(r.reward == 1.0 for r in records if r.judged)
    assert {r.error_class for r in records if not r.judged} <= {"model_server", "cancelled"}


def test_transformers_serve_of_the_tiny_model_through_serve_cmd(tmp_path: Path) -> None:
    from benchmarks.tiny_model import build_tiny_qwen3

    model_dir, _ = build_tiny_qwen3(tmp_path / "tiny-qwen3")
    transformers = Path(sys.executable).parent / "transformers"
    serve = f"{transformers} serve {{model}} --port {{port}} --host 127.0.0.1"
    result = _cli(
        "-m",
        str(model_dir),
        "--serve-cmd",
        serve,
        "-l",
        "1",
        "--max-tokens",
        "16",
        "--max-turns",
        "2",
        "--ready-timeout",
        "240",
        "-o",
        str(tmp_path),
        "--job-name",
        "j",
        timeout=600,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    (record,) = JobFolder(tmp_path / "j").records()
    assert record.error_class is None and record.reward is not None  # judged, whatever the model said
    assert record.model == str(model_dir) and record.transcript[1]["role"] == "assistant"
    assert record.usage["requests"] >= 1 and record.finish_reason in ("stop", "length", "max_turns")
    assert _processes_with(str(model_dir)) == []  # the server is gone
    assert "Uvicorn running" in (tmp_path / "j" / "server.log").read_text()


def test_sigterm_stops_the_managed_server_and_the_sandboxes(tmp_path: Path) -> None:
    marker = f"sigterm-{uuid.uuid4().hex}"
    serve = f"{sys.executable} {SCRIPTED} --port {{port}} --slow-seconds 1 --tag {marker}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harbor_async",
            "eval",
            "-m",
            "slow",
            "--serve-cmd",
            serve,
            "-l",
            "4",
            "-n",
            "2",
            "-o",
            str(tmp_path),
            "--job-name",
            "j",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    episodes = tmp_path / "j" / "episodes.jsonl"
    deadline = time.monotonic() + 180
    while not (episodes.exists() and episodes.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.1)
    assert _processes_with(marker)  # the server runs while episodes do
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert _processes_with(marker) == []  # and the leak check finds no sandbox


def test_ctrl_c_to_the_process_group_ends_a_managed_server_eval_at_once(tmp_path: Path) -> None:
    # What a terminal does: SIGINT to the whole group, the managed server included.
    marker = f"ctrl-c-{uuid.uuid4().hex}"
    serve = f"{sys.executable} {SCRIPTED} --port {{port}} --slow-seconds 3 --tag {marker}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "harbor_async", "eval", "-m", "slow", "-l", "4", "-n", "4", "--serve-cmd", serve,
         "-o", str(tmp_path), "--job-name", "j"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while "scripted server on" not in ((tmp_path / "j" / "server.log").read_text() if (tmp_path / "j" / "server.log").exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None, "the managed server did not come up"
        time.sleep(0.1)
    time.sleep(2)  # the episodes are mid-conversation
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == 130, err
    assert f"--resume {tmp_path / 'j'}" in err and (tmp_path / "j" / "summary.json").is_file()
    assert json.loads((tmp_path / "j" / "summary.json").read_text())["interrupted_by"] == "SIGINT"
    assert took < 4.5, f"{took:.1f} s: a stop that waited out its 5 s grace"  # measured 1.0-1.2 s here
    assert _processes_with(marker) == []


def test_step_from_reads_the_steps_of_checkpoints_of_another_trainers_naming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--step-from 'ckpt(\\d+)'``: ckpt7 is step 7 in the summary and sweep.csv; by default neither has a step."""
    from tests import scripted_server

    monkeypatch.setattr(scripted_server, "MODELS", (*scripted_server.MODELS, "ckpt7", "ckpt12"))
    with ScriptedServer() as server:
        common = ["-m", "ckpt12", "-m", "ckpt7", "-l", "1", "-e", "simulated", "--base-url", server.base_url, "-o", str(tmp_path)]
        named = _cli(*common, "--job-name", "named", "--step-from", r"ckpt(\d+)")
        plain = _cli(*common, "--job-name", "plain")
        bad = _cli(*common, "--job-name", "bad", "--step-from", "ckpt")
    assert named.returncode == 0, named.stderr[-3000:]
    summary = json.loads((tmp_path / "named" / "summary.json").read_text())
    assert {m: s["step"] for m, s in summary["models"].items()} == {"ckpt12": 12, "ckpt7": 7}
    rows = (tmp_path / "named" / "sweep.csv").read_text().splitlines()[1:]
    assert sorted(r.split(",")[:2] for r in rows) == [["ckpt12", "12"], ["ckpt7", "7"]]
    assert plain.returncode == 0, plain.stderr[-3000:]
    summary = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert {m: s["step"] for m, s in summary["models"].items()} == {"ckpt12": None, "ckpt7": None}
    assert bad.returncode == 2 and "--step-from" in bad.stderr and "no group" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
