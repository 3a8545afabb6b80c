"""One fault, every entry point, one record: `run`, `eval`, a cluster worker and the shim (issue 43's first check).

Each row is a fault; each column an entry point, driven as a user drives it:

- ``run``: the CLI (``harbor-async run``, the oracle agent);
- ``eval``: the CLI against the scripted OpenAI-compatible server (tests/scripted_server.py, plus the
  models below) with the bash harness;
- ``cluster``: ``eval --ray`` (``run --ray`` where the row has no model) on the session's Ray cluster
  (tests/conftest.py), whose worker runs the episode;
- ``shim``: ``HarborBashEnv`` driven as TRL drives it (``reset``, tool calls, ``reward``, ``close``), its
  records in ``job_dir``.

Per row, every column present must record the same error class, reward and judged flag, the same judged and
not-judged counts (``summary.json``; the shim's job folder summarized by the same function) and the same first
and last phase, and the same exit status where there is a process; and that shared outcome must be the one
the failure table (:data:`harbor_async.core.policy.ERROR_POLICY`) gives the row's error, so that a feature
removed anywhere fails here. A column the fault cannot reach by construction is left out with its reason
(``Row.absent``); one whose outcome differs by design says so (``Row.differs``) and is checked against its own.

Faults are injected by the simulated backend (start, verifier latency), by a task (its verifier timeout, a
slow solution), by the harness's exec budget, or by the scripted server (HTTP 500, 401, 422, a context
overflow); real local (bubblewrap) sandboxes where the command or the verifier must really run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from harbor_async.core.errors import (
    EpisodeInterruptedError,
    ModelServerConfigError,
    ModelServerError,
    SandboxCancelledError,
    SandboxTimeout,
    VerifierFailure,
)
from harbor_async.core.policy import rule_for
from harbor_async.core.records import EpisodeRecord
from harbor_async.jobs.folder import JobFolder
from harbor_async.jobs.scoring import summarize
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_suite
from harbor_async.verification.disk_bounds import AgentDiskLimitError, JobDiskLimitError
from tests import scripted_server
from tests.fault_harness import EXEC_TIMEOUT
from tests.scripted_server import ScriptedServer, _call, _error, _reply

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TASK = load_suite(example_suite_path()).tasks[0]
COLUMNS = ("run", "eval", "cluster", "shim")

#: (error class, reward, judged) of one record.
Outcome = tuple[str | None, float | None, bool]

#: The context-overflow refusal vLLM gives (a 400 the classifier reads as the model's, tests/test_server_errors.py).
OVERFLOW = "This model's maximum context length is 64 tokens. However, you requested 9000 tokens."
#: FastAPI's request validation: a 422 that is not a context overflow (a configuration refused).
UNPROCESSABLE = {"detail": [{"type": "missing", "loc": ["body", "messages", 0, "role"], "msg": "Field required"}]}
EXTRA_MODELS = ("sleeper", "overflow", "refuse-422")


class FaultServer(ScriptedServer):
    """The scripted server with the models of the rows below (the scripted ones work as documented there).

    - ``sleeper``: first a tool call that outlives the harness's exec budget (``sleep 30``), then, once
      the timeout's text is back, the task's solution, then done: an episode that goes on after a timeout;
    - ``overflow``: every request refused as longer than the context (the model's outcome, scored);
    - ``refuse-422``: every request refused by FastAPI's validation (configuration: the eval stops).
    """

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        model, messages = body.get("model"), body.get("messages") or []
        if model not in EXTRA_MODELS:
            return super().chat(body)
        with self._lock:
            self.requests[model] += 1
        if model == "refuse-422":
            return 422, UNPROCESSABLE
        if model == "overflow":
            return 400, _error(OVERFLOW, "BadRequestError", 400)
        tool_turns = sum(1 for m in messages if m.get("role") == "tool")
        if tool_turns == 0:
            return 200, _reply(body, messages, [_call("bash", json.dumps({"command": "sleep 30"}))])
        if tool_turns == 1:
            _, solution = self._task(messages[0].get("content") or "")
            return 200, _reply(body, messages, [_call("bash", json.dumps({"command": solution}))])
        return 200, _reply(body, messages, None, "Done.")


@dataclass(frozen=True)
class Row:
    """One fault and how each entry point meets it.

    Attributes:
        expected: what every present column records for each episode the fault hits.
        table: the error the failure table must map to ``expected``'s class and grade (``None``: no failure).
        absent: columns the fault cannot reach by construction, each with the reason.
        differs: a column whose outcome differs by design: its own expected outcome and table error.
        task: the task (a name of the row suite, else the bundled suite's first task); run_task: run's, if other.
        run, eval: the command's flags (the cluster column: eval's, or run's without a model, plus ``--ray``).
        shim: ``HarborBashEnv``'s backend, options and tool commands (``{solve}``: the task's solution).
        server: the scripted server's keyword arguments; env: the commands' extra environment.
        episodes: how many records the fault must leave failed as ``expected`` (a stop after N: N).
        signal: sent to the command once its agent is at work (its tool command runs); the shim is then
            interrupted by ``shim_interrupt``: ``close`` (what a trainer stopped mid-rollout does).
        exit_code: every command's exit status.
        on_uvloop: run again in .ci/run's uvloop pass (marker ``uvloop_pass``): the rows whose outcome hangs on
            the event loop (timeouts, cancellation, signals, the client's retries); the others classify an error
            the loop does not shape.
    """

    expected: Outcome
    table: Callable[[], BaseException] | None
    exit_code: int
    absent: dict[str, str] = field(default_factory=dict)
    differs: dict[str, tuple[Outcome, Callable[[], BaseException] | None, str]] = field(default_factory=dict)
    task: str | None = None
    run_task: str | None = None
    run: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    shim: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    episodes: int = 1
    signal: signal.Signals | None = None
    shim_interrupt: str | None = None
    on_uvloop: bool = False


NO_MODEL_SERVER = {
    "run": "run's agent (the oracle) calls no model server",
    "shim": "the shim has no model server: TRL generates, the env only runs the tools",
}
NO_TRIAL_FOLDERS = "the shim keeps no trial folders: nothing of a rollout is copied to the host but its bounded output"
SIMULATED_START_FAILS = ["-e", "simulated", "--ek", "start_permanent_failure_rate=1.0"]
#: Three tasks, one at a time: a stop after N failures leaves the rest unrun.
STOPPING = ["-e", "simulated", "-l", "3", "-n", "1", "--model-retries", "0", "--max-model-server-failures", "2"]

ROWS: dict[str, Row] = {
    "start fails for good": Row(
        ("infrastructure", None, False), lambda: _start_error(), exit_code=1,
        run=SIMULATED_START_FAILS, eval=["-m", "solver", *SIMULATED_START_FAILS],
        shim={"type": "simulated", "kwargs": {"start_permanent_failure_rate": 1.0}, "commands": ["{solve}"]},
    ),
    "exec timeout": Row(
        # The harness's tool call timed out: its text goes back to the model, which goes on and solves.
        (None, 1.0, True), None, exit_code=0,
        differs={"run": (
            ("agent", 0.0, True), lambda: SandboxTimeout("agent", TASK.name, "s", "timed out"),
            "the oracle's agent phase is one command: its timeout is the agent's failure, scored 0",
        )},
        # The oracle's solve.sh (a long sleep first) is bounded by the agent's budget (the task's 120 s x 0.01),
        # not the exec budget; the verifier then finds no answer.
        run=["-e", "local", "--agent-timeout-multiplier", "0.01"], run_task="slow-solution",
        eval=["-m", "sleeper", "-e", "local", "-a", "tests.fault_harness:ShortExecBash"],
        shim={"type": "local", "options": {"exec_timeout": EXEC_TIMEOUT}, "commands": ["sleep 30", "{solve}"]},
        on_uvloop=True,
    ),
    "verifier times out": Row(
        ("verifier", 0.0, True), lambda: VerifierFailure("verify", "slow-verifier", "s", "timed out"), exit_code=0, task="slow-verifier",
        run=["-e", "simulated", "--ek", "verify_latency=30"],
        eval=["-m", "solver", "-e", "simulated", "--ek", "verify_latency=30"],
        shim={"type": "simulated", "kwargs": {"verify_latency": 30}, "commands": ["{solve}"]},
        on_uvloop=True,
    ),
    "server answers 500 N times": Row(
        ("model_server", None, False), lambda: ModelServerError("HTTP 500", 500), exit_code=3,
        absent=NO_MODEL_SERVER, eval=["-m", "always-500", *STOPPING], episodes=2,
        on_uvloop=True,
    ),
    "server answers 401": Row(
        ("model_server", None, False), lambda: ModelServerConfigError("HTTP 401", 401), exit_code=3,
        # No --api-key-name: the client's placeholder key, which this server refuses (see the test at the end).
        absent=NO_MODEL_SERVER, eval=["-m", "solver", *STOPPING], server={"api_key": "right"},
    ),
    "server answers 422": Row(
        ("model_server", None, False), lambda: ModelServerConfigError("HTTP 422", 422), exit_code=3,
        absent=NO_MODEL_SERVER, eval=["-m", "refuse-422", *STOPPING],
    ),
    "context overflow": Row(
        # The model's own outcome: the verifier judges what it did (nothing), 0.
        (None, 0.0, True), None, exit_code=0, absent=NO_MODEL_SERVER, eval=["-m", "overflow", "-e", "local"],
    ),
    "SIGINT mid-agent": Row(
        ("cancelled", None, False), lambda: EpisodeInterruptedError("SIGINT"), exit_code=130, task="slow-solution",
        run=["-e", "local"], eval=["-m", "solver", "-e", "local"], shim={"type": "local", "commands": ["{solve}"]},
        signal=signal.SIGINT,
        on_uvloop=True,
    ),
    "an episode past its disk bound": Row(
        # Three sparse artifacts of 6 MiB (each within its transfer budget) against an 8 MiB episode: the agent's 0.
        ("agent", 0.0, True), lambda: AgentDiskLimitError("agent", "disk-dumper", "s", "past the bound"), exit_code=0,
        task="disk-dumper", run=["-e", "local", "--episode-disk-limit-mb", "8"],
        eval=["-m", "solver", "-e", "local", "--episode-disk-limit-mb", "8"],
        absent={"shim": NO_TRIAL_FOLDERS},
    ),
    "a job folder past its disk bound": Row(
        # The same 18 MiB against a 4 MiB job folder: not judged, the job stops (exit 1), resumable.
        ("cancelled", None, False), lambda: JobDiskLimitError("job", 4 * 2**20), exit_code=1,
        task="disk-dumper", run=["-e", "local", "--job-disk-limit-mb", "4"],
        eval=["-m", "solver", "-e", "local", "--job-disk-limit-mb", "4"],
        absent={"shim": NO_TRIAL_FOLDERS},
    ),
    "cancellation mid-agent": Row(
        ("cancelled", None, False), lambda: SandboxCancelledError("agent", "slow-solution", "s", "closed"), exit_code=143, task="slow-solution",
        run=["-e", "local"], eval=["-m", "solver", "-e", "local"], shim={"type": "local", "commands": ["{solve}"]},
        signal=signal.SIGTERM, shim_interrupt="close",
        on_uvloop=True,
    ),
}  # fmt: skip


def _start_error() -> BaseException:
    from harbor.environments.base import SandboxBuildFailedError

    return SandboxBuildFailedError("simulated permanent start failure")


# ── the row suite: the bundled first task, with a verifier that outlives its budget, and a slow solution ──


@pytest.fixture(scope="module")
def row_suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(a suite with the rows' tasks, the slow solution's sleep argument: unique, so its process is ours)."""
    root = tmp_path_factory.mktemp("fault-suite")
    tasks = root / "tasks"
    tag = f"{3000 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"
    for name in ("slow-verifier", "slow-solution", "disk-dumper"):
        shutil.copytree(TASK.task_dir, tasks / name)
    with (tasks / "disk-dumper" / "instruction.md").open("a") as instruction:  # the scripted server tells tasks by it
        instruction.write("\nLeave nothing else behind.\n")
    with (tasks / "disk-dumper" / "solution" / "solve.sh").open("a") as dumper:
        dumper.write("\nmkdir -p /logs/artifacts && truncate -s 6M /logs/artifacts/a.bin /logs/artifacts/b.bin /logs/artifacts/c.bin\n")
    toml = tasks / "slow-verifier" / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]\ntimeout_sec = 30.0", "[verifier]\ntimeout_sec = 1.0"))
    assert "timeout_sec = 1.0" in toml.read_text()
    solve = tasks / "slow-solution" / "solution" / "solve.sh"
    first, *rest = solve.read_text().splitlines(keepends=True)
    solve.write_text(first + f"sleep {tag}\n" + "".join(rest))
    return root, tag


def _sleepers(tag: str) -> set[int]:
    """The pids running the slow solution's command (in sandboxes of this test session: the tag is its own)."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.info["cmdline"] == ["sleep", tag]:
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _agent_at_work(tag: str, before: set[int]) -> bool:
    """Whether a slow solution's command not among ``before`` runs now: an earlier column's sandbox (a Ray worker
    stops it after its driver has exited) must not pass for this column's, which would be signalled too soon."""
    return bool(_sleepers(tag) - before)


# ── the columns ───────────────────────────────────────────────────────────────


@dataclass
class Seen:
    """What one column recorded."""

    records: list[EpisodeRecord]
    summary: dict[str, Any]
    exit_code: int | None = None
    texts: list[str] = field(default_factory=list)  # the tool outputs the model (or TRL) read


def _command(
    argv: list[str], job: Path, row: Row, tag: str | None, env: dict[str, str] | None = None
) -> Seen:
    """Run ``harbor-async ARGV`` to its end, or until the agent is at work and then send the row's signal."""
    from tests.cluster_helpers import child_env

    before = _sleepers(tag) if tag is not None else set()
    proc = subprocess.Popen(
        [sys.executable, "-m", "harbor_async", *argv, "-o", str(job.parent), "--job-name", job.name],
        cwd=REPO, env=child_env(COLUMNS="200", **row.env, **(env or {})),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if row.signal is not None:
        assert tag is not None
        _wait_for(lambda: _agent_at_work(tag, before), proc, " ".join(argv))
        proc.send_signal(row.signal)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == row.exit_code, f"{' '.join(argv)} exited {proc.returncode}: {err[-3000:]}"
    folder = JobFolder.open(job)
    return Seen(folder.records(), folder.read_json("summary.json"), proc.returncode)


def _wait_for(ready: Callable[[], bool], proc: subprocess.Popen | None, what: str) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what} ended before its agent was at work: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"{what}: the agent never started its command"
        time.sleep(0.05)


def _where(row: Row, suite: tuple[Path, str]) -> list[str]:
    if row.task is None:
        return ["-p", str(example_suite_path()), "-i", TASK.name] if "-l" not in row.eval else []
    return ["-p", str(suite[0]), "-i", row.task]


def _shim(row: Row, job: Path, suite: tuple[Path, str], server_solutions: dict[str, str]) -> Seen:
    """``HarborBashEnv`` as TRL drives it: reset, the tool calls, the reward (or the row's interruption)."""
    import shim

    task_dir = TASK.task_dir if row.task is None else suite[0] / "tasks" / row.task
    solve = (Path(task_dir) / "solution" / "solve.sh").read_text()
    commands = [c.replace("{solve}", solve) for c in row.shim["commands"]]
    if row.signal is not None:  # the process training with the shim is interrupted mid-rollout
        return _shim_in_a_trainer_process(row.shim, Path(task_dir), commands, job, suite[1])
    spec = row.shim
    env = shim.HarborBashEnv(
        spec["type"], environment_kwargs=spec.get("kwargs", {}), job_dir=job, **spec.get("options", {})
    )
    texts: list[str] = []
    try:
        env.reset(task_dir=str(task_dir))
        if row.shim_interrupt == "close":
            assert env.bash(command="true") == "(empty output, rc=0)"  # the sandbox is ready: the agent is at work
            tool = threading.Thread(target=lambda: texts.append(env.bash(command=commands[0])))
            before = _sleepers(suite[1])
            tool.start()
            _wait_for(lambda: _agent_at_work(suite[1], before), None, "the shim")
            env.close()  # what a trainer stopped mid-rollout does
            tool.join(timeout=60)
            assert not tool.is_alive() and texts  # the tool call came back (with an error text), nothing hangs
        else:
            texts = [env.bash(command=c) for c in commands]
            reward = env.reward
            assert reward == env.record.reward  # what TRL reads is what the record says
    finally:
        env.close()
    (written,) = JobFolder.open(job).records()
    assert written.to_dict() == env.record.to_dict()  # the job folder has the record TRL's env holds
    return Seen([written], summarize([written]), None, texts)


SHIM_TRAINER = """
import sys
import shim
env = shim.HarborBashEnv(sys.argv[1], job_dir=sys.argv[2])
env.reset(task_dir=sys.argv[3])
print(env.bash(command=sys.argv[4]), flush=True)  # interrupted here, as a trainer by Ctrl-C mid-rollout
"""


def _shim_in_a_trainer_process(spec: dict[str, Any], task_dir: Path, commands: list[str], job: Path, tag: str) -> Seen:
    """SIGINT to a process training with the shim while a tool command runs (Ctrl-C in the trainer)."""
    from tests.cluster_helpers import child_env

    before = _sleepers(tag)
    proc = subprocess.Popen(
        [sys.executable, "-c", SHIM_TRAINER, spec["type"], str(job), str(task_dir), commands[0]],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _wait_for(lambda: _agent_at_work(tag, before), proc, "the shim's trainer")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert "KeyboardInterrupt" in err, err[-3000:]  # the trainer's own interruption
    records = JobFolder.open(job).records()
    return Seen(records, summarize(records), None)


# ── the check ─────────────────────────────────────────────────────────────────


def _outcome(record: EpisodeRecord) -> Outcome:
    return record.error_class, record.reward, record.judged


def _hit(seen: Seen, expected: Outcome) -> list[EpisodeRecord]:
    """The records the fault hit (a stop after N leaves the others cancelled, if they had begun)."""
    return [r for r in seen.records if _outcome(r) == expected]


def _table_says(error: Callable[[], BaseException] | None, expected: Outcome) -> None:
    """The failure table gives ``error`` the expected class and grade (a scored failure: reward 0; else none)."""
    if error is None:
        assert expected[0] is None and expected[2]
        return
    rule = rule_for(error())
    assert (rule.failure.value, rule.graded) == (expected[0], expected[2])
    assert expected[1] == (0.0 if rule.graded else None)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "fault", [pytest.param(name, marks=[pytest.mark.uvloop_pass] if row.on_uvloop else []) for name, row in ROWS.items()]
)
def test_a_fault_gives_one_record_through_every_entry_point(
    fault: str, row_suite: tuple[Path, str], ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = ROWS[fault]
    present = [c for c in COLUMNS if c not in row.absent]
    assert len(present) >= 2 and set(row.absent) <= set(COLUMNS) and set(row.differs) <= set(present)
    _table_says(row.table, row.expected)
    for outcome, error, _why in row.differs.values():
        _table_says(error, outcome)

    monkeypatch.setattr(scripted_server, "MODELS", (*scripted_server.MODELS, *EXTRA_MODELS))  # listed and served
    where, tag = _where(row, row_suite), row_suite[1]
    cluster = ["--ray", "--ray-address", ray_cluster.address]
    seen: dict[str, Seen] = {}
    with FaultServer(row_suite[0] / "tasks" if row.task else scripted_server.EXAMPLE_SUITE, **row.server) as server:
        model = ["--base-url", server.base_url]
        if "run" in present:
            run_where = _where(replace(row, task=row.run_task), row_suite) if row.run_task else where
            seen["run"] = _command(["run", *run_where, *row.run, "-q"], tmp_path / "run", row, tag)
        seen["eval"] = _command(["eval", *where, *row.eval, *model], tmp_path / "eval", row, tag)
        cluster_argv = ["eval", *where, *row.eval, *model] if row.eval else ["run", *where, *row.run, "-q"]
        seen["cluster"] = _command([*cluster_argv, *cluster], tmp_path / "cluster", row, tag)
    if "shim" in present:
        seen["shim"] = _shim(row, tmp_path / "shim", row_suite, {})

    def expected_of(column: str) -> Outcome:
        return row.differs[column][0] if column in row.differs else row.expected

    for column, s in seen.items():
        expected = expected_of(column)
        hit = _hit(s, expected)
        assert row.episodes <= len(hit) <= row.episodes + _in_flight_at_a_stop(row, column), (
            column, [_outcome(r) for r in s.records]
        )
        # every other record is one a stop cancelled before its agent's work (none, with one task)
        assert all(r.error_class == "cancelled" for r in s.records if r not in hit), (column, s.records)
        assert s.summary["completed"] == (len(hit) if expected[2] else 0), (column, s.summary)
        assert s.summary["not_judged"] == len(s.records) - s.summary["completed"], (column, s.summary)
        for r in hit:
            assert (r.phases[0].phase, r.phases[-1].phase) == ("start", "stop"), (column, r.phases)
            if row.signal is not None or row.shim_interrupt:  # interrupted mid-agent: the agent had begun
                assert "agent" in [p.phase for p in r.phases], (column, r.phases)

    # The columns agree with each other: class, reward, judged, the counts and the phases of what the fault hit.
    def comparable(s: Seen, column: str) -> tuple:
        hit = _hit(s, expected_of(column))
        return (
            tuple(sorted({_outcome(r) for r in hit}, key=str)), min(len(hit), row.episodes), s.summary["completed"],
            tuple(sorted({(r.phases[0].phase, r.phases[-1].phase) for r in hit})), r_types(hit),
        )  # fmt: skip

    alike = {c: comparable(s, c) for c, s in seen.items() if c not in row.differs}
    assert len(set(alike.values())) == 1, alike
    commands = {c: s.exit_code for c, s in seen.items() if s.exit_code is not None}
    assert set(commands.values()) == {row.exit_code}, commands
    _row_specifics(fault, row, seen, server)


#: The session cluster's episode workers (one per node: the head and one worker node), one episode each at -n 1.
CLUSTER_WORKERS = 2


def _in_flight_at_a_stop(row: Row, column: str) -> int:
    """Episodes beyond the row's that a stop may find already failing the same way: the cluster's other workers'.

    A local run at ``-n 1`` has one episode at a time; the cluster has one per
    worker, and an episode whose request failed before its cancel arrived is
    recorded as it failed (the failure budget's rule, not a disagreement).
    """
    return CLUSTER_WORKERS - 1 if column == "cluster" and row.exit_code == 3 else 0


def r_types(records: list[EpisodeRecord]) -> tuple[str | None, ...]:
    """The error types (a refused configuration is ``ModelServerConfigError``, a failing server ``ModelServerError``)."""
    return tuple(sorted({r.error_type for r in records}, key=str))


def _row_specifics(fault: str, row: Row, seen: dict[str, Seen], server: FaultServer) -> None:
    """What only some rows have: the timeout's text the model read, the stop's reason, the requests sent."""
    if fault == "exec timeout":
        timed_out = f"Error: the command timed out after {EXEC_TIMEOUT:g}"
        for column in ("eval", "cluster"):
            (record,) = seen[column].records
            tool_texts = [str(m.get("content")) for m in record.transcript or [] if m.get("role") == "tool"]
            assert len(tool_texts) == 2 and tool_texts[0].startswith(timed_out), (column, tool_texts)
        assert seen["shim"].texts[0].startswith(timed_out), seen["shim"].texts
        (ran,) = seen["run"].records
        assert ran.error_phase == "agent", ran
    if fault.startswith("server answers"):
        stops = {c: seen[c].summary.get("stopped_by") for c in ("eval", "cluster")}
        assert len(set(stops.values())) == 1 and stops["eval"], stops
    if fault in ("server answers 401", "server answers 422"):
        assert all(r.error_type == "ModelServerConfigError" for c in ("eval", "cluster") for r in _hit(seen[c], row.expected))
    if fault == "server answers 500 N times":
        assert all(r.error_type == "ModelServerError" for c in ("eval", "cluster") for r in _hit(seen[c], row.expected))
    if fault == "context overflow":
        for column in ("eval", "cluster"):
            (record,) = seen[column].records
            assert record.finish_reason == "context_length", (column, record.finish_reason)


# ── what the matrix does not show ───────────────────────────────────────────────────────────────────────────


def test_an_api_key_named_for_eval_on_ray_reaches_the_workers(ray_cluster, tmp_path: Path) -> None:
    """The driver reads --api-key-name's variable, as a local eval does; the workers get its value."""
    row = Row((None, 1.0, True), None, exit_code=0, env={"HA_FAULT_KEY": "right"})
    with FaultServer(api_key="right") as server:
        argv = ["eval", "-p", str(example_suite_path()), "-i", TASK.name, "-e", "simulated", "-m", "solver",
                "--api-key-name", "HA_FAULT_KEY", "--base-url", server.base_url]  # fmt: skip
        local = _command(argv, tmp_path / "local", row, None)
        sharded = _command([*argv, "--ray", "--ray-address", ray_cluster.address], tmp_path / "ray", row, None)
    assert [_outcome(r) for r in local.records] == [_outcome(r) for r in sharded.records] == [row.expected]
