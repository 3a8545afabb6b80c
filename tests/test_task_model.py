"""Harbor's task model beyond one instruction: multi-step tasks, users, network policies, heredocs, refusals.

Multi-step tasks run through ``harbor-async run`` and through Harbor's own
``harbor run`` (with this project's local backend as its environment) on the
same tasks: the rewards of each step and of the task agree. Tasks that ask for
what a backend or a driver cannot honour are refused before any sandbox starts,
one line per feature; missing host variables come back as one table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harbor_async.agents.task_checks import (
    EVAL,
    RUN,
    TRL,
    MissingVariablesError,
    UnsupportedTaskError,
    check_tasks,
)
from harbor_async.backends import resolve_backend
from harbor_async.backends.local.dockerfile import (
    parse_dockerfile,
    unsupported_instructions,
)
from harbor_async.tasks.suite import load_task
from tests.cli_helpers import REPO, harbor_async, records
from tests.scripted_server import ScriptedServer

# `range` (every version the ranges allow): the parity runs against Harbor's CLI on local; docker's in the main suite.

SHARED_TEST = """#!/bin/bash
# the task's shared test: /app/out.txt must hold $EXPECTED, and the heredoc file must exist
if [ "$(cat /app/out.txt)" = "$EXPECTED" ] && [ "$(cat /app/notes.txt)" = "built by a heredoc" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    path.chmod(mode)


def make_multi_step(
    suite: Path, name: str, *, first_right: bool = True, strategy: str = "mean", min_reward: bool = True,
    heredoc: bool = True,
) -> Path:
    """Two steps: 'write' (its input comes from its workdir/, a setup.sh runs) and 'append' (its own tests/).

    The shared tests/test.sh checks ``$EXPECTED``, which each step's
    ``[verifier.env]`` sets; the Dockerfile writes a file with a COPY heredoc.
    """
    task = suite / name
    gate = "min_reward = 1.0\n" if min_reward else ""
    write(task / "task.toml", f"""\
        schema_version = "1.4"
        multi_step_reward_strategy = "{strategy}"

        [[steps]]
        name = "write"
        {gate}
        [steps.agent]
        timeout_sec = 30
        [steps.verifier]
        env = {{ EXPECTED = "one" }}

        [[steps]]
        name = "append"
        [steps.verifier]
        env = {{ EXPECTED = "one two" }}
        """)  # fmt: skip
    if heredoc:
        write(task / "environment" / "Dockerfile", """\
            FROM debian:bookworm-slim
            WORKDIR /app
            COPY <<EOF /app/notes.txt
            built by a heredoc
            EOF
            """)  # fmt: skip
    else:  # Docker's built-in Dockerfile frontend reads heredocs only with a newer frontend (from Docker Hub)
        write(task / "environment" / "notes.txt", "built by a heredoc\n")
        write(task / "environment" / "Dockerfile", "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY notes.txt /app/notes.txt\n")
    write(task / "tests" / "test.sh", SHARED_TEST, 0o755)
    write(task / "steps" / "append" / "tests" / "test.sh", SHARED_TEST.replace("shared", "step 'append'"), 0o755)
    write(task / "steps" / "write" / "instruction.md", "Copy seed.txt to /app/out.txt.\n")
    write(task / "steps" / "append" / "instruction.md", "Append ' two' to the line in /app/out.txt.\n")
    seed = "cat /app/seed.txt > /app/out.txt" if first_right else "echo wrong > /app/out.txt"
    write(task / "steps" / "write" / "solution" / "solve.sh", f"#!/bin/bash\ntest -f /app/setup-ran && {seed}\n", 0o755)
    write(task / "steps" / "write" / "workdir" / "seed.txt", "one\n")
    write(task / "steps" / "write" / "workdir" / "setup.sh", "touch /app/setup-ran\n")
    write(task / "steps" / "append" / "solution" / "solve.sh", '#!/bin/bash\necho "one two" > /app/out.txt\n', 0o755)
    return task


def harbor_cli(suite: Path, tmp_path: Path, backend: str = "local") -> subprocess.CompletedProcess:
    """Harbor's own ``harbor run`` with the oracle, on this project's local backend or on ``docker``."""
    harbor = Path(sys.executable).with_name("harbor")
    where = ["-e", "docker"] if backend == "docker" else [
        "-e", "harbor_async.backends.local:LocalEnvironment", "--ek", f"sandbox_root={tmp_path / 'harbor-sandboxes'}",
    ]  # fmt: skip
    command = [str(harbor), "run", "-p", str(suite), *where, "-a", "oracle", "-o", str(tmp_path / "harbor-jobs"), "-y", "-n", "10"]
    environment = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(REPO)}
    return subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)


def harbor_cli_rewards(suite: Path, tmp_path: Path, backend: str = "local") -> dict[str, tuple[float | None, list]]:
    """:func:`harbor_cli`'s rewards: task -> (reward, step rewards); a trial Harbor could not run has ``None``."""
    done = harbor_cli(suite, tmp_path, backend)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {}
    for path in (tmp_path / "harbor-jobs").glob("*/*__*/result.json"):
        trial = json.loads(path.read_text())
        reward = (trial["verifier_result"] or {}).get("rewards", {}).get("reward")
        steps = [(s["step_name"], (s["verifier_result"] or {}).get("rewards", {}).get("reward")) for s in trial["step_results"] or []]
        found[trial["task_name"]] = (reward, steps)
    return found


# ── multi-step tasks ─────────────────────────────────────────────────────────


@pytest.mark.range
@pytest.mark.slow
def test_multi_step_tasks_score_as_harbor_scores_them(tmp_path: Path) -> None:
    """Per-step instructions, solutions, tests, env, workdir uploads, setup.sh; min_reward; mean and final."""
    suite = tmp_path / "suite"
    make_multi_step(suite, "both-right")
    make_multi_step(suite, "gate-stops", first_right=False)  # step 1 under min_reward: step 2 never runs
    make_multi_step(suite, "final-only", first_right=False, strategy="final", min_reward=False)
    make_multi_step(suite, "mean-half", first_right=False, min_reward=False)

    done = harbor_async("run", "-p", str(suite), "-a", "oracle", "-o", str(tmp_path / "jobs"), "--ek", f"sandbox_root={tmp_path / 'sb'}")
    assert done.returncode == 0, done.stderr[-3000:]
    ours = {r["task"]: r for r in records(next((tmp_path / "jobs").iterdir()))}
    assert {name: r["reward"] for name, r in ours.items()} == {
        "both-right": 1.0, "gate-stops": 0.0, "final-only": 1.0, "mean-half": 0.5,
    }  # fmt: skip
    assert [s["name"] for s in ours["gate-stops"]["steps"]] == ["write"]
    assert "below min_reward" in ours["gate-stops"]["steps"][0]["error"]
    assert [(s["name"], s["reward"]) for s in ours["mean-half"]["steps"]] == [("write", 0.0), ("append", 1.0)]
    assert all(r["error_class"] is None for r in ours.values())

    theirs = harbor_cli_rewards(suite, tmp_path)
    assert {name: (r["reward"], [(s["name"], s["reward"]) for s in r["steps"]]) for name, r in ours.items()} == theirs


def test_trl_refuses_a_multi_step_task_before_training(tmp_path: Path) -> None:
    """One reset, one reward: TRL's environment_factory cannot give a task several instructions."""
    from shim import HarborSpec

    make_multi_step(tmp_path / "suite", "multi")
    with pytest.raises(UnsupportedTaskError, match=r"task multi: \[\[steps\]\] \(2 steps\): TRL's environment_factory"):
        HarborSpec(dataset=str(tmp_path / "suite"), environment_type="local", preflight=False)


# ── refused before any sandbox ───────────────────────────────────────────────


def plain_task(suite: Path, name: str, toml: str = "", dockerfile: str = "FROM debian:bookworm-slim\n") -> Path:
    task = suite / name
    write(task / "task.toml", 'schema_version = "1.4"\n' + textwrap.dedent(toml))
    write(task / "environment" / "Dockerfile", dockerfile)
    write(task / "instruction.md", "Write hi to /app/answer.txt.\n")
    write(task / "solution" / "solve.sh", "#!/bin/bash\nmkdir -p /app && echo hi > /app/answer.txt\n", 0o755)
    write(task / "tests" / "test.sh", '#!/bin/bash\n[ "$(cat /app/answer.txt)" = hi ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n', 0o755)
    return task


@pytest.mark.slow
@pytest.mark.range
def test_features_local_cannot_honour_are_refused_up_front_one_line_each(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    plain_task(suite, "own-verifier-image", '[verifier.environment]\ndocker_image = "debian:bookworm-slim"\n')
    plain_task(suite, "agent-user", '[agent]\nuser = "agent"\n')
    plain_task(suite, "needs-internet", '[environment]\nnetwork_mode = "public"\n')
    plain_task(suite, "legacy-internet", "[environment]\nallow_internet = true\n")
    plain_task(suite, "allowlist", '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["example.com"]\n')
    plain_task(suite, "copy-from", dockerfile="FROM debian:bookworm-slim AS b\nFROM debian:bookworm-slim\nCOPY --from=b /etc/hostname /x\n")
    plain_task(suite, "gpu", "[environment]\ngpus = 1\n")
    plain_task(suite, "fine")

    expected = (
        "task own-verifier-image: [verifier] environment: a verifier image of its own needs a backend that builds images",
        "task agent-user: [agent] user = 'agent': local sandboxes run every command as their root",
        "task needs-internet: network_mode = 'public': local sandboxes have no network",
        "task legacy-internet: network_mode = 'public'",
        "task allowlist: network_mode: network_mode='allowlist' is not supported by local environment",
        "task copy-from: environment/Dockerfile line 3: COPY --from=b /etc/hostname /x",
        "task gpu: [environment] gpus",
    )
    # Each refused task alone, listed first; the rest runs (as Harbor runs the rest); the exit status says so.
    jobs = tmp_path / "jobs"
    done = harbor_async("run", "-p", str(suite), "-a", "oracle", "-o", str(jobs), "--job-name", "run", "--ek", f"sandbox_root={tmp_path / 'sb'}")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.index("refused: 7 task(s)") < done.stderr.index("job folder")
    for line in expected:
        assert line in done.stderr, done.stderr
    assert "task fine" not in done.stderr and "7 task(s) were not run" in done.stderr
    assert [(r["task"], r["reward"]) for r in records(jobs / "run")] == [("fine", 1.0)]
    refused = json.loads((jobs / "run" / "summary.json").read_text())["refused"]
    assert len({r["task"] for r in refused}) == 7 and {"task", "feature", "reason"} <= set(refused[0])
    # eval: the same tasks left out, the same summary (one path)
    with ScriptedServer(suite) as server:
        evaluated = harbor_async(
            "eval", "-p", str(suite), "-m", "solver", "--base-url", server.base_url, "-o", str(jobs), "--job-name", "eval",
            "--ek", f"sandbox_root={tmp_path / 'sb'}",
        )  # fmt: skip
    assert evaluated.returncode == 1, evaluated.stderr[-3000:]
    assert {r["task"] for r in json.loads((jobs / "eval" / "summary.json").read_text())["refused"]} == {r["task"] for r in refused}
    assert [r["task"] for r in records(jobs / "eval")] == ["fine"]
    # every task refused: nothing to run, bad input, no job folder and no sandbox
    shutil.rmtree(suite / "fine")
    none_left = harbor_async("run", "-p", str(suite), "-a", "oracle", "-o", str(tmp_path / "none"), "--ek", f"sandbox_root={tmp_path / 'sb2'}")
    assert none_left.returncode == 2, none_left.stderr[-3000:]
    assert all(line in none_left.stderr for line in expected)
    assert not (tmp_path / "none").exists() and not (tmp_path / "sb2").exists()


@pytest.mark.slow
def test_a_task_that_asks_for_the_network_runs_offline_on_local_when_allowed(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    plain_task(suite, "needs-internet", '[environment]\nnetwork_mode = "public"\n')
    done = harbor_async(
        "run", "-p", str(suite), "-a", "oracle", "-o", str(tmp_path / "jobs"),
        "--ek", f"sandbox_root={tmp_path / 'sb'}", "--ek", "allow_offline=true",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["reward"] for r in records(next((tmp_path / "jobs").iterdir()))] == [1.0]


@pytest.mark.slow
def test_missing_variables_of_the_whole_suite_are_one_table(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    plain_task(suite, "a", '[environment.env]\nTOKEN_A = "${HA_TEST_UNSET_A}"\n')
    plain_task(suite, "b", '[verifier.env]\nJUDGE = "${HA_TEST_UNSET_B}"\n[solution.env]\nOK = "${HA_TEST_UNSET_C:-x}"\n')
    done = harbor_async("run", "-p", str(suite), "-a", "oracle", "-o", str(tmp_path / "jobs"), "--ek", f"sandbox_root={tmp_path / 'sb'}")
    assert done.returncode == 2
    rows = [line.split() for line in done.stderr.splitlines() if line.strip().startswith(("a ", "b "))]
    assert rows == [["a", "[environment.env]", "TOKEN_A", "HA_TEST_UNSET_A"], ["b", "[verifier.env]", "JUDGE", "HA_TEST_UNSET_B"]]
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").iterdir())


def test_each_driver_refuses_what_it_cannot_give_the_model(tmp_path: Path) -> None:
    """MCP servers: Harbor's oracle ignores them (run), a tool harness cannot wire them (eval, TRL)."""
    task = load_task(plain_task(tmp_path, "mcp", '[[environment.mcp_servers]]\nname = "docs"\nurl = "http://localhost:1/sse"\n'))
    local = resolve_backend("local")
    check_tasks([task], local, driver=RUN)
    for driver in (EVAL, TRL):
        with pytest.raises(UnsupportedTaskError, match="mcp_servers"):
            check_tasks([task], local, driver=driver)
    with pytest.raises(MissingVariablesError):
        check_tasks([load_task(plain_task(tmp_path, "v", '[verifier.env]\nX = "${HA_TEST_UNSET_X}"\n'))], local, driver=RUN)


def test_dockerfile_heredocs_and_copy_from(tmp_path: Path) -> None:
    spec = parse_dockerfile(
        "FROM debian:bookworm-slim\nARG WHO=world\nWORKDIR /app\n"
        "COPY <<EOF greeting.txt\nhello $WHO\nEOF\n"
        "COPY <<'EOT' /raw.sh\necho $WHO\nEOT\n"
        "COPY <<-EOF /tabs.txt\n\tindented\n\tEOF\n"
    )
    assert [(c.dest, c.content) for c in spec.copies] == [
        ("/app/greeting.txt", "hello world\n"), ("/raw.sh", "echo $WHO\n"), ("/tabs.txt", "indented\n"),
    ]  # fmt: skip
    assert spec.ignored == []
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM a AS build\nFROM debian:bookworm-slim\nCOPY --from=build /x /y\n")
    assert unsupported_instructions(dockerfile) == ["line 3: COPY --from=build /x /y"]


# ── on docker ────────────────────────────────────────────────────────────────

PROBE = """#!/bin/bash
# reach a TCP server on the host through the sandbox's default gateway, if it has one
gw=$(awk '$2 == "00000000" {print $3; exit}' /proc/net/route)
if [ -z "$gw" ]; then echo no-route > /tmp/answer.txt; exit 0; fi
ip=$(printf '%d.%d.%d.%d' 0x${gw:6:2} 0x${gw:4:2} 0x${gw:2:2} 0x${gw:0:2})
if timeout 5 bash -c "echo hi > /dev/tcp/$ip/$PROBE_PORT" 2>/dev/null; then echo reached > /tmp/answer.txt; else echo blocked > /tmp/answer.txt; fi
"""


def probe_task(suite: Path, name: str, network: str, want: str) -> None:
    task = suite / name
    write(task / "task.toml", f"""\
        schema_version = "1.4"
        [environment]
        {network}
        [solution.env]
        PROBE_PORT = "${{PROBE_PORT}}"
        [verifier.env]
        WANT = "{want}"
        """)  # fmt: skip
    write(task / "environment" / "Dockerfile", "FROM debian:bookworm-slim\nWORKDIR /tmp\n")
    write(task / "instruction.md", "Probe the network.\n")
    write(task / "solution" / "solve.sh", PROBE, 0o755)
    write(task / "tests" / "test.sh", '#!/bin/bash\ncat /tmp/answer.txt\ngrep -qx "$WANT" /tmp/answer.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n', 0o755)


@pytest.fixture
def host_server():
    """A TCP server on every host address: what a sandbox with a network can reach."""
    import socket
    import threading

    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(0.5)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_docker_honours_network_mode_users_and_multi_step_tasks(tmp_path: Path, host_server: int, request) -> None:
    """A separate verifier judges the artifacts in a fresh container; a no-network task has no route out (Harbor's egress sidecar needs Docker Hub: Compose's ``network_mode: none``
    honours a task that is offline in every phase); a public one reaches the host where allowed (host_access); ``[agent] user`` runs the agent,
    the verifier stays root; a multi-step task's steps each see only their own tests."""
    suite = tmp_path / "suite"
    verifier_image = f"harbor-async-test-verifier:{os.getpid()}"
    probe_task(suite, "offline", 'network_mode = "no-network"', "no-route")
    probe_task(suite, "legacy-offline", "allow_internet = false", "no-route")
    probe_task(suite, "online", "", "reached")
    task = suite / "as-nobody"
    write(task / "task.toml", 'schema_version = "1.4"\n[agent]\nuser = "nobody"\n')
    write(task / "environment" / "Dockerfile", "FROM debian:bookworm-slim\nWORKDIR /tmp\n")
    write(task / "instruction.md", "Say who you are.\n")
    write(task / "solution" / "solve.sh", "#!/bin/bash\nid -un > /tmp/who\n", 0o755)
    write(task / "tests" / "test.sh", '#!/bin/bash\n[ "$(cat /tmp/who)" = nobody ] && [ "$(id -un)" = root ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n', 0o755)
    separate_task(suite)
    for name, image in (("own-image", True), ("tests-image", False)):  # the verifier's own environment
        task = separate_task(suite, name)
        if image:
            write(tmp_path / "verifier-image" / "Dockerfile", "FROM debian:bookworm-slim\nCOPY test.sh /tests/test.sh\n")
            shutil.copy(task / "tests" / "test.sh", tmp_path / "verifier-image" / "test.sh")
        write(task / "environment" / "agent-only.txt", "only in the agent's image\n")
        write(task / "environment" / "Dockerfile", "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY agent-only.txt /agent-only.txt\n")
        test = task / "tests" / "test.sh"
        test.write_text(test.read_text().replace("]; then", "] && [ ! -e /agent-only.txt ]; then"))
        if image:  # [verifier.environment]: a prebuilt image, which holds the tests (Harbor's rule)
            toml = (task / "task.toml").read_text()
            (task / "task.toml").write_text(toml + f'[verifier.environment]\ndocker_image = "{verifier_image}"\n')
        else:  # tests/Dockerfile: the tests are built into the verifier's image
            write(task / "tests" / "Dockerfile", "FROM debian:bookworm-slim\nCOPY test.sh /tests/test.sh\n")
    compose = suite / "compose"  # a second container beside the agent's: reachable by name, stopped at once
    write(compose / "task.toml", 'schema_version = "1.4"\n')
    write(compose / "environment" / "Dockerfile", "FROM debian:bookworm-slim\nWORKDIR /tmp\n")
    write(compose / "environment" / "docker-compose.yaml", """\
        services:
          main:
            depends_on: [helper]
          helper:
            image: debian:bookworm-slim
            command: ["bash", "-c", "exec sleep infinity"]
        """)  # fmt: skip
    write(compose / "instruction.md", "Find the helper.\n")
    write(compose / "solution" / "solve.sh", "#!/bin/bash\ngetent hosts helper > /tmp/helper.txt\n", 0o755)
    write(compose / "tests" / "test.sh", "#!/bin/bash\n[ -s /tmp/helper.txt ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n", 0o755)
    multi = make_multi_step(suite, "multi", heredoc=False)
    write(multi / "steps" / "write" / "tests" / "test.sh", SHARED_TEST, 0o755)  # the step's own tests ...
    write(multi / "steps" / "write" / "tests" / "write-only.txt", "step 1's grading file\n")
    write(multi / "steps" / "append" / "tests" / "test.sh", SHARED_TEST.replace(  # ... are gone by step 2's verifier
        "]; then", "] && [ ! -e /tests/write-only.txt ]; then"), 0o755)  # fmt: skip
    solve = multi / "steps" / "append" / "solution" / "solve.sh"  # and by step 2's agent
    solve.write_text("#!/bin/bash\n[ -e /tests/test.sh ] && exit 1\n" + solve.read_text().split("\n", 1)[1])

    shutil.copy(suite / "own-image" / "tests" / "test.sh", tmp_path / "verifier-image" / "test.sh")
    built = subprocess.run(["docker", "build", "-q", "-t", verifier_image, str(tmp_path / "verifier-image")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    request.addfinalizer(lambda: subprocess.run(["docker", "rmi", "-f", verifier_image], capture_output=True))
    done = harbor_async(
        "run", "-p", str(suite), "-e", "docker", "-a", "oracle", "-o", str(tmp_path / "jobs"), "--env-allow", "PROBE_PORT",
        "--ek", "host_access=true",  # the probe's server is the host's: a public task reaches it only when allowed
        env={"PROBE_PORT": str(host_server)}, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = {r["task"]: r for r in records(next((tmp_path / "jobs").iterdir()))}
    assert {name: r["reward"] for name, r in found.items()} == {
        "offline": 1.0, "legacy-offline": 1.0, "online": 1.0, "as-nobody": 1.0, "multi": 1.0, "separate": 1.0,
        "compose": 1.0, "own-image": 1.0, "tests-image": 1.0,
    }, {name: (r["error"], r["verifier_output"]) for name, r in found.items()}  # fmt: skip
    assert [(s["name"], s["reward"]) for s in found["multi"]["steps"]] == [("write", 1.0), ("append", 1.0)]
    # the helper (PID 1 'sleep infinity', deaf to SIGTERM) got the init too: no 10 s wait for Docker's grace period
    assert found["compose"]["seconds"]["stop"] < 8.0, found["compose"]["seconds"]
    job = next((tmp_path / "jobs").iterdir())
    assert files_under(job / found["separate"]["trial"] / "artifacts") == [
        "app/outdir/keep.txt", "app/report.json", "logs/artifacts/answer.txt", "manifest.json",
    ]  # fmt: skip


# ── separate verifiers and artifacts ─────────────────────────────────────────


def separate_task(suite: Path, name: str = "separate") -> Path:
    """A separate verifier judges what the agent published: declared artifacts and /logs/artifacts, nothing else."""
    task = suite / name
    write(task / "task.toml", """\
        schema_version = "1.4"
        artifacts = ["/app/report.json", { source = "/app/outdir", exclude = ["*.tmp"] }]
        [verifier]
        environment_mode = "separate"
        """)  # fmt: skip
    write(task / "environment" / "Dockerfile", "FROM debian:bookworm-slim\nWORKDIR /app\n")
    write(task / "instruction.md", "Write a report.\n")
    write(task / "solution" / "solve.sh", """\
        #!/bin/bash
        mkdir -p /logs/artifacts /app/outdir
        echo '{"ok": true}' > /app/report.json
        echo kept > /app/outdir/keep.txt; echo dropped > /app/outdir/junk.tmp
        echo 42 > /logs/artifacts/answer.txt
        touch /app/agent-was-here
        """, 0o755)  # fmt: skip
    write(task / "tests" / "test.sh", """\
        #!/bin/bash
        # a fresh sandbox: the agent's files are not there, its artifacts are
        if [ "$(cat /logs/artifacts/answer.txt)" = 42 ] && [ -f /app/report.json ] && [ ! -e /app/agent-was-here ] \\
           && [ -f /app/outdir/keep.txt ] && [ ! -e /app/outdir/junk.tmp ]; then
          echo 1 > /logs/verifier/reward.txt
        else
          echo 0 > /logs/verifier/reward.txt
        fi
        """, 0o755)  # fmt: skip
    return task


def files_under(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.mark.range
@pytest.mark.slow
def test_separate_verifier_and_artifacts_as_harbor_runs_them(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    separate_task(suite)
    done = harbor_async("run", "-p", str(suite), "-a", "oracle", "-o", str(tmp_path / "jobs"), "--ek", f"sandbox_root={tmp_path / 'sb'}")
    assert done.returncode == 0, done.stderr[-3000:]
    job = next((tmp_path / "jobs").iterdir())
    (record,) = records(job)
    assert record["reward"] == 1.0, record["verifier_output"]
    ours = job / record["trial"] / "artifacts"  # in the episode's trial folder, where Harbor keeps them
    assert files_under(ours) == [
        "app/outdir/keep.txt", "app/report.json", "logs/artifacts/answer.txt", "manifest.json",
    ]  # fmt: skip
    assert (ours / "logs" / "artifacts" / "answer.txt").read_text() == "42\n"

    theirs = harbor_cli_rewards(suite, tmp_path)
    assert theirs == {"separate": (1.0, [])}
    (trial,) = (tmp_path / "harbor-jobs").glob("*/separate__*/artifacts")
    assert files_under(trial) == files_under(ours)


@pytest.mark.slow
def test_artifacts_are_collected_within_the_transfer_budget(tmp_path: Path) -> None:
    """A sandbox cannot fill the host through its artifacts: a sparse 4 GiB file and links out are not brought over."""
    suite = tmp_path / "suite"
    task = plain_task(suite, "bomb", 'artifacts = ["/app/big.bin", "/app/dir"]\n')
    write(task / "solution" / "solve.sh", """\
        #!/bin/bash
        mkdir -p /app/dir /logs/artifacts && echo hi > /app/answer.txt
        truncate -s 4G /app/big.bin
        ln -s / /app/dir/host-root; ln -s /etc/passwd /logs/artifacts/passwd; echo small > /app/dir/ok.txt
        """, 0o755)  # fmt: skip
    done = harbor_async(
        "run", "-p", str(suite), "-a", "oracle", "-o", str(tmp_path / "jobs"),
        "--ek", f"sandbox_root={tmp_path / 'sb'}", "--ek", "transfer_limit_mb=1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    job = next((tmp_path / "jobs").iterdir())
    (record,) = records(job)
    assert record["reward"] == 1.0  # collection is best effort: the episode is unharmed
    folder = job / record["trial"] / "artifacts"
    assert files_under(folder) == ["app/dir/ok.txt", "manifest.json"]
    assert not any(p.is_symlink() for p in folder.rglob("*"))
    manifest = json.loads((folder / "manifest.json").read_text())
    failed = [e for e in manifest if e["status"] != "ok"]
    assert [e["source"] for e in failed] == ["/app/big.bin"], manifest


def test_trl_refuses_a_separate_verifier(tmp_path: Path) -> None:
    task = load_task(separate_task(tmp_path))
    with pytest.raises(UnsupportedTaskError, match="cannot start a second sandbox per rollout"):
        check_tasks([task], resolve_backend("local"), driver=TRL)
    check_tasks([task], resolve_backend("local"), driver=RUN)


# ── network policies that change between phases ─────────────────────────────


@pytest.mark.anyio
async def test_each_phase_gets_its_network_policy_on_a_backend_that_can_switch(tmp_path: Path) -> None:
    """Harbor's phase switch: the agent's policy before the agent acts, the verifier's before it judges (each step's)."""
    from harbor_async.engine.engine import Engine
    from harbor_async.episodes.runner import run_episode
    from tests import network_backend

    backend = resolve_backend("tests.network_backend:RecordingNetworkEnvironment")
    single = load_task(plain_task(tmp_path / "suite", "single", """\
        [environment]
        network_mode = "no-network"
        [verifier]
        network_mode = "allowlist"
        allowed_hosts = ["example.com"]
        """))  # fmt: skip
    multi = make_multi_step(tmp_path / "suite", "multi")
    toml = (multi / "task.toml").read_text()
    (multi / "task.toml").write_text(toml.replace("[steps.agent]\ntimeout_sec = 30", '[steps.agent]\ntimeout_sec = 30\nnetwork_mode = "no-network"'))
    network_backend.SWITCHES.clear()
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "sb")}) as engine:
        first = await run_episode(engine, single, backend, "oracle")
        switched_single = [mode for _, mode in network_backend.SWITCHES]
        network_backend.SWITCHES.clear()
        second = await run_episode(engine, load_task(multi), backend, "oracle")
    assert first.reward == 1.0 and switched_single == ["allowlist"]  # built no-network; the verifier's allowlist
    assert second.reward == 1.0
    # step 'write': its agent is offline (the environment is public); its verifier, 'append''s agent and verifier public
    assert [mode for _, mode in network_backend.SWITCHES] == ["no-network", "public"]


@pytest.mark.slow
def test_eval_drives_a_model_through_each_step(tmp_path: Path) -> None:
    """``eval``: each step's instruction is a new conversation with the model, in the same sandbox."""
    from harbor_async import evaluate_sync
    from tests.scripted_server import ScriptedServer

    suite = tmp_path / "suite"
    make_multi_step(suite, "multi")
    with ScriptedServer(suite=suite) as server:
        result = evaluate_sync(
            ["solver"], str(suite), base_url=server.base_url, jobs_dir=tmp_path / "jobs", job_name="job",
            environment_kwargs={"sandbox_root": str(tmp_path / "sb")},
        )  # fmt: skip
    (record,) = result.records
    assert record.reward == 1.0 and record.error_class is None, (record.error, record.steps)
    assert [(s["name"], s["reward"]) for s in record.steps] == [("write", 1.0), ("append", 1.0)]
    prompts = [m["content"] for m in record.transcript if m["role"] == "user"]
    assert [p.splitlines()[0] for p in prompts] == ["Copy seed.txt to /app/out.txt.", "Append ' two' to the line in /app/out.txt."]
    assert record.usage["tool_calls"] == 2


@pytest.mark.slow
def test_a_task_that_cannot_be_built_is_an_invalid_task_not_the_infrastructure(tmp_path: Path) -> None:
    """Found only at its start (a COPY source that is not there): not judged, not retried, named, rerun by a resume."""
    suite = tmp_path / "suite"
    plain_task(suite, "missing-source", dockerfile="FROM debian:bookworm-slim\nCOPY not-there.txt /app/\n")
    plain_task(suite, "fine")
    done = harbor_async("run", "-p", str(suite), "-a", "oracle", "-o", str(tmp_path / "jobs"), "--ek", f"sandbox_root={tmp_path / 'sb'}")
    assert done.returncode == 1, done.stderr[-2000:]
    job = next((tmp_path / "jobs").iterdir())
    found = {r["task"]: r for r in records(job)}
    bad = found["missing-source"]
    assert (bad["error_class"], bad["error_type"], bad["reward"], bad["start_attempts"]) == ("invalid_task", "InvalidTaskError", None, 1)
    assert "not-there.txt" in bad["error"]
    assert found["fine"]["reward"] == 1.0
    summary = json.loads((job / "summary.json").read_text())
    assert summary["not_judged_by_class"] == {"invalid_task": 1} and summary["mean_reward"] == 1.0
    assert "1 not judged (1 invalid_task: rerun by --resume; fix invalid tasks first)" in " ".join(done.stdout.split())


def test_only_the_tasks_own_definition_errors_are_invalid_tasks() -> None:
    """A backend's build failure (a missing bubblewrap, a cloud builder's error) stays the infrastructure's."""
    from harbor.environments.base import SandboxBuildFailedError

    from harbor_async.backends.local.errors import TaskPathEscapeError
    from harbor_async.core.errors import FailureClass, TaskDefinitionError
    from harbor_async.core.policy import failure_class, is_transient

    assert failure_class(TaskDefinitionError("Dockerfile line 3: bad")) is FailureClass.INVALID_TASK
    assert failure_class(TaskPathEscapeError(Path("/t/tests"), Path("/etc"))) is FailureClass.INVALID_TASK
    assert not is_transient(TaskDefinitionError("x"))
    assert failure_class(SandboxBuildFailedError("bubblewrap is not installed")) is FailureClass.INFRASTRUCTURE


@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_docker_enforces_an_allowlist_or_refuses_it_as_harbor_does(tmp_path: Path) -> None:
    """Harbor's docker class enforces an allowlist with its egress sidecar where it can start one; else the run
    refuses the task before any sandbox, in Harbor's words. A task offline in every phase is honoured either way."""
    from harbor.environments.docker.docker import DockerEnvironment

    allowlist = load_task(plain_task(tmp_path, "allowlist", '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["example.com"]\n'))
    offline = load_task(plain_task(tmp_path, "offline", '[environment]\nnetwork_mode = "no-network"\n'))
    docker = resolve_backend("docker")
    check_tasks([offline], docker, driver=RUN)
    if DockerEnvironment._egress_control_kernel_support():
        check_tasks([allowlist], docker, driver=RUN)
    else:
        with pytest.raises(UnsupportedTaskError, match=r"task allowlist: network_mode: network_mode='allowlist' is not supported by (?i:\S*docker)"):
            check_tasks([allowlist], docker, driver=RUN)


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_a_dockerfile_docker_cannot_build_is_an_invalid_task_tried_once(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    plain_task(suite, "bogus", dockerfile="FROM debian:bookworm-slim\nBOGUS instruction\n")
    done = harbor_async("run", "-p", str(suite), "-e", "docker", "-a", "oracle", "-o", str(tmp_path / "jobs"), timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    (record,) = records(next((tmp_path / "jobs").iterdir()))
    assert (record["error_class"], record["start_attempts"], record["reward"]) == ("invalid_task", 1, None)
    assert "unknown instruction: BOGUS" in record["error"]


def test_the_local_refusal_of_a_compose_file_says_what_it_holds(tmp_path: Path) -> None:
    from harbor_async.backends.local.dockerfile import unsupported_instructions

    only_main = plain_task(tmp_path, "only-main")
    write(only_main / "environment" / "docker-compose.yaml", "services:\n  main:\n    environment:\n      A: '1'\n    mem_limit: 1g\n")
    (said,) = unsupported_instructions(only_main / "environment" / "Dockerfile")
    assert said == "docker-compose.yaml (its settings of the main service: environment, mem_limit; a local sandbox runs the Dockerfile alone)"
    sidecar = plain_task(tmp_path, "sidecar")
    write(sidecar / "environment" / "docker-compose.yaml", "services:\n  main: {}\n  db:\n    image: postgres\n  cache:\n    image: redis\n")
    (said,) = unsupported_instructions(sidecar / "environment" / "Dockerfile")
    assert said == "docker-compose.yaml (services besides the main one: cache, db)"
