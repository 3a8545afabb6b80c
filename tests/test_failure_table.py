"""The failure table (``harbor_async.core.policy.ERROR_POLICY``): the one place that maps an outcome to a class, a retry and a grade.

The table is walked in order by ``rule_for`` and nothing else decides: the
cases that used to run before it (a task's own definition, a backend start
error's ``transient``, a full disk) are rows of it, and the engine's own
outcomes (an interruption, a harness setup that failed, a network policy that
could not be applied, a final step without a reward, a closed episode) are
typed errors that go through it. No module outside ``errors.py`` and
``policy.py`` names a failure class to set one. Docker's untyped start errors
are typed in ``backends/docker/errors.py`` from the exit status, the failed
subcommand and the daemon's own phrases (the real messages are below).
"""

from __future__ import annotations

import ast
import asyncio
import errno
import inspect
import shutil
import textwrap
import time
from pathlib import Path

import anyio
import pytest
from harbor.environments.base import SandboxBuildFailedError
from harbor.environments.capabilities import EnvironmentCapabilities

import harbor_async
import shim
from harbor_async.backends import resolve_backend
from harbor_async.backends.docker.errors import (
    DockerBuildError,
    DockerfileError,
    DockerImageError,
    DockerRefusedError,
    DockerStartError,
    compose_failure,
    pulled_image,
    typed_start_error,
)
from harbor_async.backends.local.errors import TaskPathEscapeError
from harbor_async.backends.simulated import (
    SimulatedEnvironment,
    SimulatedTransientError,
)
from harbor_async.core import policy
from harbor_async.core.errors import (
    AgentSetupError,
    BackendStartError,
    EpisodeClosedError,
    EpisodeDeadlineError,
    EpisodeInterruptedError,
    ExecError,
    FailureClass,
    FinalStepRewardError,
    InvalidTaskError,
    LaunchError,
    ModelServerError,
    NetworkPhaseError,
    Phase,
    SandboxCancelledError,
    SandboxClosedError,
    SandboxError,
    SandboxTimeout,
    StartError,
    StopError,
    TaskDefinitionError,
    VerifierFailure,
    VerifierPathError,
)
from harbor_async.core.policy import (
    ERROR_POLICY,
    ErrorRule,
    failure_class,
    is_transient,
    rule_for,
)
from harbor_async.engine.engine import Engine
from harbor_async.episodes.episode import Episode
from harbor_async.episodes.runner import run_episode
from harbor_async.episodes.tool_messages import describe_unavailable
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import load_task
from tests.requirements import needs_bwrap

CSV_SUM = example_suite_path() / "tasks" / "csv-column-sum"


def _declaring(base: type[BaseException], transient: object) -> BaseException:
    """An instance of a subclass of ``base`` whose type declares ``transient``."""
    kind = type(f"Declares{transient!r}", (base,), {"transient": transient})
    if issubclass(base, SandboxError):
        return kind(Phase.START, "t", "s")
    if issubclass(base, OSError):
        return kind(errno.ENOSPC, "x")
    return kind("x")


#: One error of every kind the engine meets, every phase for the sandbox errors.
ERRORS: list[BaseException] = [
    *(cls(phase, "t", "s", "d") for phase in Phase for cls in (
        SandboxError, SandboxTimeout, EpisodeDeadlineError, StartError, InvalidTaskError, ExecError, VerifierFailure,
        StopError, SandboxClosedError, SandboxCancelledError, EpisodeClosedError, FinalStepRewardError,
    )),
    DockerStartError("x"), DockerBuildError("x"), DockerfileError("x"), DockerImageError("x"), DockerRefusedError("x"),
    SimulatedTransientError("x"), BackendStartError("x"), TaskDefinitionError("x"),
    TaskPathEscapeError(Path("a"), Path("b")), SandboxBuildFailedError("x"), FileNotFoundError("x"),
    OSError(errno.ENOSPC, "x"), OSError(errno.EDQUOT, "x"), OSError(errno.EIO, "x"), ConnectionResetError(),
    TimeoutError(), RuntimeError("x"), ValueError("x"), KeyboardInterrupt(), SystemExit(), asyncio.CancelledError(),
    ModelServerError("x"), EpisodeInterruptedError(), AgentSetupError("x"), NetworkPhaseError("x"), LaunchError("x"),
    VerifierPathError("/tests"),
    *(_declaring(base, transient) for transient in (True, False, None, 1) for base in (
        Exception, BackendStartError, TaskDefinitionError, SandboxCancelledError, OSError, KeyboardInterrupt,
    )),
]  # fmt: skip


# ── the table ─────────────────────────────────────────────────────────────


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: f"{type(e).__name__}-{getattr(e, 'phase', '')}")
def test_the_rule_is_the_first_row_of_the_table_that_covers_the_error(exc):
    """No decision before the table: what rule_for says is what the table, read in order, says."""
    phase = exc.phase if isinstance(exc, SandboxError) else None
    first = next(row for row in ERROR_POLICY if row.covers(exc, phase))
    assert rule_for(exc) is first.rule


def test_rule_for_only_walks_the_table():
    (function,) = ast.parse(textwrap.dedent(inspect.getsource(policy.rule_for))).body
    loops = [node for node in function.body if isinstance(node, ast.For)]
    assert len(loops) == 1 and ast.unparse(loops[0].iter) == "ERROR_POLICY"
    assert not [node for node in function.body if isinstance(node, ast.If)]  # no case decided beside the table
    assert ast.unparse(loops[0].body[0].test) == "row.covers(exc, phase)"


def test_no_row_is_left_unreachable_by_an_earlier_one():
    def kinds(row):
        return row.kind if isinstance(row.kind, tuple) else (row.kind,)

    for at, row in enumerate(ERROR_POLICY):
        for earlier in ERROR_POLICY[:at]:
            if earlier.when is None and earlier.phase in (None, row.phase):
                covered = all(any(issubclass(kind, wider) for wider in kinds(earlier)) for kind in kinds(row))
                assert not covered, f"row {at} ({row}) is never reached: row {ERROR_POLICY.index(earlier)} covers it"


def test_a_rule_grades_as_its_class_or_is_refused():
    assert all(row.rule.graded is row.rule.failure.scored for row in ERROR_POLICY)
    with pytest.raises(ValueError, match="agent failure is graded"):
        ErrorRule(FailureClass.AGENT, retry=False, graded=False)
    with pytest.raises(ValueError, match="infrastructure failure is not graded"):
        ErrorRule(FailureClass.INFRASTRUCTURE, retry=True, graded=True)


@pytest.mark.parametrize(
    "exc, failure, retry",
    [
        # The task's own definition comes first, whatever else its type declares.
        (DockerfileError("x"), FailureClass.INVALID_TASK, False),
        (_declaring(TaskDefinitionError, True), FailureClass.INVALID_TASK, False),
        # A backend start error's type says whether another attempt may work.
        (BackendStartError("x"), FailureClass.INFRASTRUCTURE, True),
        (_declaring(BackendStartError, False), FailureClass.INFRASTRUCTURE, False),
        (DockerImageError("x"), FailureClass.INFRASTRUCTURE, False),
        # Another backend's typed error declaring the same attribute, even one that is otherwise a cancellation.
        (_declaring(Exception, False), FailureClass.INFRASTRUCTURE, False),
        (_declaring(SandboxCancelledError, True), FailureClass.INFRASTRUCTURE, True),
        (_declaring(Exception, "yes"), FailureClass.INFRASTRUCTURE, True),  # not a bool: not a declaration
        # A full disk or quota, by errno: not worth another attempt; another OSError is.
        (OSError(errno.ENOSPC, "x"), FailureClass.INFRASTRUCTURE, False),
        (OSError(errno.EDQUOT, "x"), FailureClass.INFRASTRUCTURE, False),
        (OSError(errno.EIO, "x"), FailureClass.INFRASTRUCTURE, True),
    ],
)
def test_the_rows_typed_predicates_decide(exc, failure, retry):
    assert (failure_class(exc), is_transient(exc)) == (failure, retry)


@pytest.mark.parametrize(
    "exc, failure, graded",
    [
        (EpisodeInterruptedError(), FailureClass.CANCELLED, False),
        (AgentSetupError("the harness broke"), FailureClass.AGENT, True),
        (NetworkPhaseError("sidecar unreachable"), FailureClass.INFRASTRUCTURE, False),
        (LaunchError("engine closed"), FailureClass.INFRASTRUCTURE, False),
        (EpisodeClosedError(Phase.START, "t", "-", "closed"), FailureClass.CANCELLED, False),
        (SandboxClosedError(Phase.START, "t", "-", "closed"), FailureClass.INFRASTRUCTURE, False),
        (FinalStepRewardError(Phase.VERIFY, "t", "s", "no reward"), FailureClass.VERIFIER, True),
        (StopError(Phase.STOP, "t", "s", "left behind"), FailureClass.INFRASTRUCTURE, False),
    ],
)
def test_the_engines_own_outcomes_are_typed_errors_the_table_decides(exc, failure, graded):
    rule = rule_for(exc)
    assert (rule.failure, rule.graded, rule.retry) == (failure, graded, False)


# ── no module outside the table names a failure class to set one ─────────────

#: Modules other engineers own right now, where a failure class is still named (see the report of this change).
#: The count may only go down.
NOT_YET_MOVED: dict[str, int] = {}


def _decisions(path: Path) -> list[int]:
    """Lines naming a ``FailureClass`` member other than to read a record's class (``x.failure is FailureClass.X``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    reads: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            left, right = node.left, node.comparators[0]
            for record, member in ((left, right), (right, left)):
                if isinstance(record, ast.Attribute) and record.attr == "failure":
                    reads.add(id(member))
    return [
        node.lineno for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id == "FailureClass" and node.attr.isupper() and id(node) not in reads
    ]  # fmt: skip


@pytest.mark.slow
def test_no_module_outside_the_table_names_a_failure_class():
    root = Path(harbor_async.__file__).parent.parent
    found = {}
    for package in ("harbor_async", "shim"):
        for path in sorted((root / package).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            if name in ("harbor_async/core/errors.py", "harbor_async/core/policy.py"):
                continue
            if lines := _decisions(path):
                found[name] = lines
    assert all(len(lines) <= NOT_YET_MOVED.get(name, 0) for name, lines in found.items()), found
    for name in ("harbor_async/episodes/episode.py", "harbor_async/episodes/steps.py", "harbor_async/engine/sandbox.py", "shim/episode.py"):
        assert name not in found, (name, found[name])


def test_the_scan_finds_a_failure_class_set_by_hand(tmp_path: Path):
    path = tmp_path / "m.py"
    path.write_text(
        "episode.fail(FailureClass.AGENT, exc)\n"
        "record.set_error(FailureClass.VERIFIER, exc)\n"
        "if failure_class(exc) is FailureClass.INFRASTRUCTURE: pass\n"
        "if record.failure is FailureClass.MODEL_SERVER: pass\n"  # reading a record's class: fine
    )
    assert _decisions(path) == [1, 2, 3]


# ── end to end, on real backends ─────────────────────────────────────────────


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_interrupted_episode_is_cancelled_and_not_judged():
    done = []
    async with Engine(backend_kwargs={"exec_latency": 30}) as engine:
        with anyio.move_on_after(1):
            await run_episode(engine, load_task(CSV_SUM), "simulated", "oracle", on_done=done.append)
    (record,) = done
    assert (record.error_class, record.error_type, record.reward) == ("cancelled", "EpisodeInterruptedError", None)
    assert record.rerun


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("how", ["raises", "own timeout", "start budget"])
async def test_a_harness_setup_that_fails_is_the_agents(how: str):
    async def setup() -> None:
        if how == "raises":
            raise RuntimeError("the harness broke")
        if how == "own timeout":
            with anyio.fail_after(0.01):
                await anyio.sleep(1)
        await anyio.sleep(5)

    async with Engine(timeouts=policy.Timeouts(start=1.0)) as engine:
        episode = Episode(engine, load_task(CSV_SUM), resolve_backend("simulated"))
        episode.launch()
        assert not await episode.start(setup)
        await episode.verify()
        record = await episode.stop()
    assert (record.error_class, record.error_phase, record.error_type) == ("agent", "start", "AgentSetupError")
    assert record.reward == 0.0  # the model's side of the episode: scored 0
    assert isinstance(episode.error, TimeoutError if how != "raises" else RuntimeError)
    if how == "start budget":
        assert record.error == "the harness setup ran past the start budget"
    else:
        assert record.error.startswith("TimeoutError" if how == "own timeout" else "RuntimeError: the harness broke")


class RefusingNetworkEnvironment(SimulatedEnvironment):
    """A simulated backend that says it switches network policies while running, and cannot."""

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return super().capabilities.model_copy(update={"dynamic_network_policy": True})

    async def _apply_network_policy(self, network_policy) -> None:
        raise RuntimeError("egress sidecar unreachable")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_network_policy_the_backend_cannot_apply_is_the_infrastructures(tmp_path: Path):
    task = tmp_path / "offline-agent"
    shutil.copytree(CSV_SUM, task)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml.replace("[agent]\n", '[agent]\nnetwork_mode = "no-network"\n'))
    backend = resolve_backend(f"{__name__}:RefusingNetworkEnvironment")
    async with Engine() as engine:
        record = await run_episode(engine, load_task(task), backend, "oracle")
    assert (record.error_class, record.error_phase, record.error_type) == ("infrastructure", "start", "NetworkPhaseError")
    assert "egress sidecar unreachable" in record.error and record.reward is None  # no agent ran unconfined


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_sandbox_that_could_not_be_stopped_is_the_infrastructures():
    async with Engine(backend_kwargs={"stop_failure_rate": 1.0}) as engine:
        record = await run_episode(engine, load_task(CSV_SUM), "simulated", "oracle")
    assert (record.error_class, record.error_phase) == ("infrastructure", "stop")
    assert record.rerun


def _two_steps(root: Path, last_writes_a_reward: bool) -> Path:
    task = root / "two-steps"
    files = {
        "task.toml": 'schema_version = "1.4"\nmulti_step_reward_strategy = "final"\n\n'
        '[[steps]]\nname = "first"\n[steps.agent]\ntimeout_sec = 30\n\n[[steps]]\nname = "last"\n',
        "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
        "tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
        "steps/first/instruction.md": "Do nothing.\n",
        "steps/first/solution/solve.sh": "#!/bin/bash\ntrue\n",
        "steps/last/instruction.md": "Do nothing again.\n",
        "steps/last/solution/solve.sh": "#!/bin/bash\ntrue\n",
        "steps/last/tests/test.sh": "#!/bin/bash\n" + ("echo 1 > /logs/verifier/reward.txt\n" if last_writes_a_reward else "true\n"),
    }
    for name, text in files.items():
        (task / name).parent.mkdir(parents=True, exist_ok=True)
        (task / name).write_text(text)
        if name.endswith(".sh"):
            (task / name).chmod(0o755)
    return task


@needs_bwrap
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("last_writes_a_reward", [True, False])
async def test_a_final_step_without_a_reward_is_the_verifiers(tmp_path: Path, last_writes_a_reward: bool):
    task = load_task(_two_steps(tmp_path / "suite", last_writes_a_reward))
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "sb")}) as engine:
        record = await run_episode(engine, task, "local", "oracle")
    assert [step["reward"] for step in record.steps] == [1.0, 1.0 if last_writes_a_reward else None]
    if last_writes_a_reward:
        assert record.error_class is None and record.reward == 1.0
    else:
        assert (record.error_class, record.error_phase, record.error_type) == ("verifier", "verify", "FinalStepRewardError")
        assert record.reward == 0.0 and "'last', the final one, has no reward" in record.error


#: What an agent can do to the verifier's folders (as root in its sandbox).
REPLACED = [
    "rm -rf /tests; echo x > /tests", "rm -rf /tests; ln -s /nowhere /tests", "rm -rf /logs/verifier; echo x > /logs/verifier",
    "rm -rf /logs; ln -s /nowhere /logs", "rm -rf /logs; ln -s /logs /logs",
]


@needs_bwrap
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("solve", REPLACED)
async def test_a_verifier_folder_the_agent_replaced_is_a_failed_verification(tmp_path: Path, solve: str):
    """Not the infrastructure's (rerun, never scored): the agent cannot void its own episode by breaking /tests."""
    task = tmp_path / "breaks-tests"
    shutil.copytree(example_suite_path() / "tasks" / "count-log-files", task)
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{solve}\n")
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "sb")}) as engine:
        record = await run_episode(engine, load_task(task), "local", "oracle")
    assert (record.error_class, record.error_phase, record.error_type) == ("verifier", "verify", "VerifierFailure")
    assert "is not a folder" in record.error and record.reward == 0.0 and not record.rerun


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("solve", REPLACED)
async def test_on_docker_too_a_verifier_folder_the_agent_replaced_is_a_failed_verification(
    tmp_path: Path, solve: str, docker_daemon: str
):
    """Harbor's upload of /tests fails (AddTestsDirError) or the tests run on what is there: the agent's 0 either way."""
    task = tmp_path / "breaks-tests"
    shutil.copytree(example_suite_path() / "tasks" / "count-log-files", task)
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{solve}\n")
    async with Engine() as engine:
        record = await run_episode(engine, load_task(task), "docker", "oracle")
    assert record.reward == 0.0 and record.judged and not record.rerun, record  # never None: never left out
    assert record.error_class in (None, "verifier"), record


@pytest.mark.slow
@needs_bwrap
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("megabytes", [300, 1])
async def test_a_judge_filled_by_the_agents_artifacts_is_a_failed_verification(tmp_path: Path, megabytes: int):
    """Out of space in a separate verifier because of what the agent left: its 0; for less, not the agent's."""
    task = tmp_path / "fills-the-judge"
    shutil.copytree(Path(__file__).parent / "corpus" / "separate-verifier", task)
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n[verifier]\nenvironment_mode = "separate"\n[environment]\nstorage_mb = 64\n'
    )
    (task / "solution" / "solve.sh").write_text(
        f"#!/bin/bash\nmkdir -p /logs/artifacts && truncate -s {megabytes}M /logs/artifacts/big\n"
    )
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "sb")}) as engine:
        record = await run_episode(engine, load_task(task), "local", "oracle")
    assert record.reward == 0.0 and record.judged and not record.rerun, record
    if megabytes == 300:  # a sparse file counts in full: it is written in full into the judge
        assert (record.error_class, record.error_type) == ("verifier", "VerifierFailure")
        assert "do not fit the verifier's environment (64 MB)" in record.error
    else:  # it fits: the tests ran (and failed: no answer)
        assert record.error_class is None


@pytest.mark.parametrize(
    "backend", [pytest.param("local", marks=needs_bwrap), pytest.param("docker", marks=[pytest.mark.slow, pytest.mark.docker])]
)
def test_a_shim_rollout_that_replaced_tests_scores_0_and_stays_in_the_loss(backend: str, request: pytest.FixtureRequest):
    """One tool call cannot turn the rollout's 0.0 into None (left out of its group, counted as infrastructure)."""
    if backend == "docker":
        request.getfixturevalue("docker_daemon")
    env = shim.HarborBashEnv(backend)
    try:
        env.reset(task_dir=str(example_suite_path() / "tasks" / "count-log-files"))
        env.bash("rm -rf /tests; echo x > /tests")
        assert env.reward == 0.0 and not env.infrastructure_failure, env.record
        assert env.record.error_class in (None, "verifier")
    finally:
        env.close()


def test_a_shim_rollout_closed_before_its_sandbox_was_ready_is_cancelled():
    env = shim.HarborBashEnv("simulated", environment_kwargs={"start_latency": 5})
    env.reset(task_dir=str(CSV_SUM))
    episode = env._episode
    time.sleep(0.2)
    env.close()
    deadline = time.monotonic() + 10
    while episode.record.finished_at is None and time.monotonic() < deadline:
        time.sleep(0.05)
    record = episode.record
    assert (record.error_class, record.error_phase, record.reward) == ("cancelled", "start", None)
    assert type(episode.error) is EpisodeClosedError and failure_class(episode.error) is FailureClass.CANCELLED
    assert isinstance(episode.error, SandboxClosedError)  # a tool call is told the sandbox is not there
    assert describe_unavailable(episode.error).startswith("Error: the sandbox of this episode is no longer available")


# ── docker's start errors: typed from the exit status, the subcommand and the daemon's own phrases ──


def _harbor_failure(command: list[str], output: str, code: int = 1) -> RuntimeError:
    """Harbor's failed-compose error (``environments/docker/docker.py``), for a command as Harbor builds it."""
    full = [
        "docker", "compose", "--project-name", "hb__x", "--project-directory", "/srv/task dir/environment",
        "-f", "/venv/harbor/environments/docker/docker-compose-build.yaml",
        "-f", "/tmp/trial 1/harbor-async-compose.json", *command,
    ]  # fmt: skip
    return RuntimeError(
        f"Docker compose command failed for environment hb__x. Command: {' '.join(full)}. "
        f"Return code: {code}. Stdout: {output}. Stderr: None. "
    )


#: What docker printed, as users report it (quoted from public issue and documentation texts).
DAEMON_SAID = [
    # builds: the Dockerfile's own fault
    (["build"], "failed to solve: dockerfile parse error on line 2: unknown instruction: BOGUS", DockerfileError),
    (["build"], 'ERROR: failed to solve: failed to compute cache key: failed to calculate checksum of ref '
                'eb356f46-ebef-426c-8bca-9feff0d9748a::akta2ioo31arw0iyptez3f66z: "/html": not found', DockerfileError),
    (["build"], "COPY failed: file not found in build context or excluded by .dockerignore: stat x.txt: file does not "
                "exist", DockerfileError),
    (["build"], 'failed to solve: process "/bin/sh -c apt-get install -y nope" did not complete successfully: exit '
                "code: 100", DockerBuildError),
    # the image
    (["up", "-d"], "Error response from daemon: pull access denied for nope, repository does not exist or may require "
                   "'docker login': denied: requested access to the resource is denied", DockerImageError),
    (["up", "-d"], 'Error response from daemon: failed to resolve reference "docker.io/library/centos:latest": '
                   "docker.io/library/centos:latest: not found", DockerImageError),
    (["up", "-d"], "Error response from daemon: manifest for repo1-api:latest not found: manifest unknown: manifest "
                   "unknown", DockerImageError),
    (["up", "-d"], "Error response from daemon: No such image: hb__task:latest", DockerImageError),
    # refused, for a reason the next attempt has too
    (["up", "-d"], "unauthorized: authentication required", DockerRefusedError),
    (["up", "-d"], 'failed to resolve reference "ghcr.io/o/private:v1": unexpected status from HEAD request to '
                   "https://ghcr.io/v2/o/private/manifests/v1: 403 Forbidden", DockerRefusedError),
    (["up", "-d"], "unable to get image 'prom/prometheus:latest': permission denied while trying to connect to the "
                   "docker API at unix:///var/run/docker.sock", DockerRefusedError),
    (["up", "-d"], "Got permission denied while trying to connect to the Docker daemon socket at "
                   "unix:///var/run/docker.sock: Get \"http://%2Fvar%2Frun%2Fdocker.sock/v1.24/containers/json\": "
                   "dial unix /var/run/docker.sock: connect: permission denied", DockerRefusedError),
    (["up", "-d"], 'Error response from daemon: invalid mount config for type "bind": bind source path does not '
                   "exist: /srv/media", DockerRefusedError),
    (["up", "-d"], "Error response from daemon: error while creating mount source path '/path/to/data': chown "
                   "/path/to/data: permission denied", DockerRefusedError),
    (["up", "-d"], "invalid reference format: repository name must be lowercase", DockerRefusedError),
    (["up", "-d"], "Error response from daemon: failed to create shim task: write /var/lib/docker/tmp/x: no space "
                   "left on device", DockerRefusedError),
    (["up", "-d"], "Error response from daemon: mkdir /var/lib/docker/overlay2/x: disk quota exceeded",
     DockerRefusedError),
    # a hiccup: another attempt may work
    (["up", "-d"], "Error response from daemon: i/o timeout", DockerStartError),
    (["up", "-d"], 'Error response from daemon: failed to resolve reference "docker.io/library/busybox:1.36.1": '
                   'failed to do request: Head "https://registry-1.docker.io/v2/library/busybox/manifests/1.36.1": '
                   "dial tcp 108.160.169.181:443: i/o timeout", DockerStartError),
    (["up", "-d"], "unexpected status from HEAD request to https://registry-1.docker.io/v2/library/python/manifests/"
                   "3.13-slim: 429 Too Many Requests", DockerStartError),
    (["up", "-d"], "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?",
     DockerStartError),
]  # fmt: skip


@pytest.mark.parametrize("command, said, expected", DAEMON_SAID, ids=lambda v: v if isinstance(v, str) else None)
def test_docker_start_errors_are_typed_from_what_the_daemon_said(command, said, expected):
    raised = _harbor_failure(command, said)
    typed = typed_start_error(raised)
    assert type(typed) is expected and typed.__cause__ is raised and str(typed).endswith(str(raised))
    image = pulled_image(said)
    if image is not None:  # the first line says which image could not be had, in the daemon's words
        first = str(typed).splitlines()[0]
        assert first.startswith(f"image {image} could not be pulled: ") and first != str(raised), first
    else:
        assert str(typed) == str(raised)
    assert is_transient(typed) is (expected is DockerStartError)
    assert failure_class(typed) is (FailureClass.INVALID_TASK if expected is DockerfileError else FailureClass.INFRASTRUCTURE)
    assert resolve_backend("docker").typed_error(raised).__class__ is expected


def test_an_unreachable_registry_is_infrastructure_naming_the_image():
    said = ('Error response from daemon: failed to resolve reference "docker.io/library/busybox:1.36.1": failed to do '
            'request: Head "https://registry-1.docker.io/v2/library/busybox/manifests/1.36.1": dial tcp '
            "108.160.169.181:443: i/o timeout")  # fmt: skip
    typed = typed_start_error(_harbor_failure(["up", "-d"], said))
    first = str(typed).splitlines()[0]
    assert first.startswith("image docker.io/library/busybox:1.36.1 could not be pulled: ") and "i/o timeout" in first
    assert type(typed) is DockerStartError and failure_class(typed) is FailureClass.INFRASTRUCTURE
    rate = "unexpected status from HEAD request to https://registry-1.docker.io/v2/library/python/manifests/3.13-slim: 429"
    assert pulled_image(rate) == "registry-1.docker.io/library/python:3.13-slim"
    assert pulled_image("Error response from daemon: i/o timeout") is None


@pytest.mark.parametrize(
    "name",
    ["invalid", "forbidden", "quota", "permission-denied", "unauthorized", "no-such-image", "invalid-reference"],
)
def test_a_word_in_a_task_or_project_name_types_nothing(name: str):
    """Compose's output names the project, its containers and images: no pattern is a word such a name can hold."""
    said = f" Image hb__{name} Building\n Container {name}-main-1  Creating\nError response from daemon: i/o timeout"
    assert type(typed_start_error(_harbor_failure(["up", "-d"], said))) is DockerStartError


def test_a_killed_compose_is_worth_another_attempt_whatever_it_printed():
    said = "failed to solve: dockerfile parse error on line 2"  # cut short: says nothing about the task
    for code, expected in ((-9, DockerStartError), (1, DockerfileError)):
        typed = typed_start_error(_harbor_failure(["build"], said, code))
        assert type(typed) is expected
    assert compose_failure(_harbor_failure(["up", "-d"], "x", -15)).killed


def test_the_subcommand_is_read_from_harbors_command_line():
    found = compose_failure(_harbor_failure(["down", "--remove-orphans"], "Error response from daemon: i/o timeout"))
    assert (found.subcommand, found.return_code, found.output) == ("down", 1, "Error response from daemon: i/o timeout")
    # a build failure is the image's only when the subcommand is build, not a word "build" in a path
    path_build = _harbor_failure(["up", "-d"], "failed to solve: x").args[0].replace("/tmp/trial 1", "/tmp/a build")
    assert compose_failure(RuntimeError(path_build)).subcommand == "up"
    assert type(typed_start_error(RuntimeError(path_build))) is DockerStartError
    other = RuntimeError("something else")
    assert typed_start_error(other) is other and compose_failure(ValueError(str(path_build))) is None
