"""Task suites: the bundled example suite's content, and load_suite / load_task.

The bundled tasks are run for real on the product's local backend, through the
engine, as `run` runs them: Harbor's oracle runs each solve.sh, Harbor's verifier
each tests/test.sh, and the rewards it reads are checked; so these fail when the
local backend breaks (its Dockerfile subset, ENV, COPY, uploads, verification).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import huggingface_hub
import pytest
from harbor.models.task.task import Task

import harbor_async
from harbor_async.backends.local.dockerfile import parse_dockerfile
from harbor_async.engine.engine import Engine
from harbor_async.engine.sandbox import Sandbox
from harbor_async.episodes.runner import run_oracle
from harbor_async.harnesses.bash import PROMPT_SUFFIX
from harbor_async.suites import example_suite_path
from harbor_async.tasks.suite import (
    HUB_ALLOW_PATTERNS,
    EmptySuiteError,
    InvalidTask,
    SuiteNotFoundError,
    TaskLoadError,
    TaskSuite,
    load_suite,
    load_task,
)

EXAMPLE_TASKS = example_suite_path() / "tasks"
EXAMPLE_NAMES = sorted(p.name for p in EXAMPLE_TASKS.iterdir() if (p / "task.toml").is_file())

# A plausible but wrong answer per answer-file task: each one hits a trap the
# instruction warns about, so the verifier must tell it apart from the gold answer.
PLAUSIBLE_WRONG = {
    "count-log-files": "6\n",  # counts error.log.bak
    "csv-column-sum": "915.17\n",  # off by a cent
    "csv-group-by": "tools,174.90\ngarden,166.00\nkitchen,60.98\noffice,186.40\n",  # unsorted
    "csv-max-price": "Paper Clips\nEspresso Machine\n",  # two lines
    "env-inventory-lookup": "5\n",  # <= instead of <
    "filter-error-lines": (
        "2024-05-01 10:00:09 ERROR database timeout query=orders ms=5000\n"
        "2024-05-01 10:00:10 INFO retrying after ERROR in upstream call\n"
        "2024-05-01 10:00:15 ERROR payment gateway returned 502\n"
        "2024-05-01 10:00:31 ERROR disk usage above 95% on /var\n"
    ),  # grep ERROR instead of the level field
    "number-stats": "min=-19 max=256 count=12\n",  # counts blank lines
    "word-frequency": "keeper\n",  # the runner-up
}


# ── the product's local backend runs each task ───────────────────────────────


@asynccontextmanager
async def local_sandbox(name: str, tmp_path: Path) -> AsyncIterator[Sandbox]:
    """The task's sandbox on the product's local backend, started through the engine (as `run` starts it)."""
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path)}) as engine:
        sandbox = engine.launch(load_task(EXAMPLE_TASKS / name), "local")
        try:
            await sandbox.wait_started()
            yield sandbox
        finally:
            await sandbox.stop()


async def _answer(sandbox: Sandbox, text: str) -> None:
    encoded = base64.b64encode(text.encode()).decode()
    done = await sandbox.exec(f"printf %s {encoded} | base64 -d > /workdir/answer.txt")
    assert done.exit_code == 0, done.output


def _metadata(name: str) -> dict:
    return tomllib.loads((EXAMPLE_TASKS / name / "task.toml").read_text()).get("metadata", {})


async def _verify(sandbox: Sandbox) -> dict[str, float]:
    """The rewards Harbor's verifier reads; a missing tool in the test script is a bug of the task."""
    result = await sandbox.verify()
    assert "not found" not in (result.output or ""), result.output
    assert result.rewards and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in result.rewards.values())
    return {k: float(v) for k, v in result.rewards.items()}


# ── the bundled suite ────────────────────────────────────────────────────────


@pytest.mark.range
def test_bundled_suite_loads_with_no_invalid_tasks():
    suite = load_suite()
    assert isinstance(suite, TaskSuite)
    assert len(suite) >= 8
    assert suite.invalid == []
    assert suite.names == EXAMPLE_NAMES
    assert all(isinstance(task, Task) for task in suite)
    assert suite.root == EXAMPLE_TASKS.resolve()
    assert suite.task_dirs == [EXAMPLE_TASKS.resolve() / n for n in EXAMPLE_NAMES]
    # Same order as TRL's HarborSpec: sorted(p.parent for p in root.glob("*/task.toml")).
    assert suite.task_dirs == sorted(p.parent for p in suite.root.glob("*/task.toml"))
    assert suite[0].name == EXAMPLE_NAMES[0]


def test_bundled_suite_is_package_data():
    package_dir = Path(harbor_async.__file__).resolve().parent
    assert example_suite_path().is_relative_to(package_dir)
    assert load_suite(example_suite_path()).names == load_suite().names
    assert load_suite(str(example_suite_path())).names == load_suite().names


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_bundled_task_content_follows_the_suite_rules(name):
    task_dir = EXAMPLE_TASKS / name
    task = load_task(task_dir)
    assert task.instruction.strip()
    assert task.config.verifier.timeout_sec <= 60
    assert task.config.agent.timeout_sec is not None and task.config.agent.timeout_sec <= 300
    meta = task.config.metadata
    assert meta.get("difficulty") in {"easy", "medium", "hard"}
    assert meta.get("category")

    dockerfile = parse_dockerfile((task_dir / "environment" / "Dockerfile").read_text())  # the local backend's reader
    assert dockerfile.base_image == "debian:bookworm-slim"
    assert dockerfile.workdir == "/workdir"
    assert dockerfile.ignored == [], "only FROM / WORKDIR / ENV / COPY lines are allowed"
    for step in dockerfile.copies:
        for src in step.sources:  # data stays inside environment/ (the build context)
            assert (task_dir / "environment" / src).resolve().is_relative_to(task_dir / "environment")
    # The data is also where the training prompt (TRL's bash harness text) says it is.
    work = sorted((tuple(s.sources), s.dest.replace("/workdir", "", 1)) for s in dockerfile.copies if s.dest.startswith("/workdir"))
    prompt = sorted((tuple(s.sources), s.dest.replace("/home/user/input", "", 1)) for s in dockerfile.copies if s.dest.startswith("/home/user/input"))
    assert "/home/user/input/" in PROMPT_SUFFIX and work == prompt

    for script in (task_dir / "solution" / "solve.sh", task_dir / "tests" / "test.sh"):
        text = script.read_text()
        assert text.startswith("#!/bin/sh\n"), f"{script} must be a POSIX sh script"
        for word in ("python", "bash", "apt-get", "jq "):
            assert word not in text, f"{script} uses {word!r}"
        syntax = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("name", EXAMPLE_NAMES)
async def test_bundled_task_solution_scores_one(name, tmp_path):
    async with local_sandbox(name, tmp_path) as sandbox:
        where = await sandbox.exec("pwd")  # commands run in the Dockerfile's WORKDIR, as the agent's would
        await run_oracle(sandbox, None, None)  # Harbor's oracle: the task's solution/solve.sh
        rewards = await _verify(sandbox)
        answer = await sandbox.exec("cat /workdir/answer.txt 2>/dev/null")
    assert where.output.strip() == "/workdir"
    assert rewards["reward"] == 1.0
    assert all(value == 1.0 for value in rewards.values()), rewards
    gold = _metadata(name).get("gold_answer")
    if gold is not None:  # the metadata's gold answer is what the solution submits
        assert answer.stdout.strip() == gold


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("name", EXAMPLE_NAMES)
async def test_bundled_task_untouched_garbage_and_wrong_answers_score_zero(name, tmp_path):
    answers = [None, "I think the answer is 42, probably.\n", PLAUSIBLE_WRONG.get(name)]
    for answer in [a for a in answers[1:] if a is not None] + [None]:
        async with local_sandbox(name, tmp_path) as sandbox:
            if answer is not None:
                await _answer(sandbox, answer)
            else:
                assert (await sandbox.exec("test -e /workdir/answer.txt")).exit_code != 0
            rewards = await _verify(sandbox)
        assert rewards["reward"] == 0.0, (answer, rewards)
        if answer is None:
            assert all(value == 0.0 for value in rewards.values()), rewards


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("name", [n for n in EXAMPLE_NAMES if _metadata(n).get("gold_answer")])
async def test_bundled_task_accepts_gold_answer_with_surrounding_whitespace(name, tmp_path):
    async with local_sandbox(name, tmp_path) as sandbox:
        await _answer(sandbox, f"{_metadata(name)['gold_answer']}  \n\n")
        assert (await _verify(sandbox))["reward"] == 1.0


@pytest.mark.range
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_multi_key_reward_scores_format_apart_from_correctness(tmp_path):
    async with local_sandbox("number-stats", tmp_path) as sandbox:
        await _answer(sandbox, "min=0 max=1 count=2\n")
        assert await _verify(sandbox) == {"reward": 0.0, "format": 1.0, "correct": 0.0}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_env_task_depends_on_dockerfile_env(tmp_path):
    async with local_sandbox("env-inventory-lookup", tmp_path) as sandbox:
        env = await sandbox.exec('echo "$INVENTORY_FILE $LOW_STOCK_THRESHOLD"')
        assert env.stdout.strip() == "/workdir/data/inventory.csv 5"  # the backend honours the Dockerfile's ENV
        await sandbox.upload(EXAMPLE_TASKS / "env-inventory-lookup" / "solution", "/solution")
        # Without the ENV (a backend that ignored it) the reference solution fails.
        unset = await sandbox.exec("env -u INVENTORY_FILE -u LOW_STOCK_THRESHOLD sh /solution/solve.sh")
        assert unset.exit_code != 0
        assert (await _verify(sandbox))["reward"] == 0.0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_verifier_ignores_stale_reward_and_rewrites_it(tmp_path):
    async with local_sandbox("count-log-files", tmp_path) as sandbox:
        assert (await sandbox.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")).exit_code == 0
        assert (await _verify(sandbox))["reward"] == 0.0


# ── suites built in tmp: layout, selection, invalid tasks ────────────────────

GOOD_TOML = '[metadata]\ndifficulty = "easy"\n\n[verifier]\ntimeout_sec = 10.0\n'


def make_task(
    parent: Path,
    name: str,
    *,
    toml: str | None = GOOD_TOML,
    instruction: str | None = "Write 1 to /workdir/answer.txt.\n",
    test: bool = True,
    environment: bool = True,
) -> Path:
    task_dir = parent / name
    task_dir.mkdir(parents=True)
    if toml is not None:
        (task_dir / "task.toml").write_text(toml)
    if instruction is not None:
        (task_dir / "instruction.md").write_text(instruction)
    if environment:
        (task_dir / "environment").mkdir()
        (task_dir / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /workdir\n")
    if test:
        (task_dir / "tests").mkdir()
        (task_dir / "tests" / "test.sh").write_text("#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
    return task_dir


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if anything tries to reach the Hugging Face Hub."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"unexpected Hub download: {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


def test_tasks_subfolder_layout_sorted_by_folder_name(tmp_path, no_hub):
    for name in ("zeta", "alpha", "Mid", "beta-2", "beta-10"):
        make_task(tmp_path / "tasks", name)
    (tmp_path / "README.md").write_text("suite readme")
    suite = load_suite(tmp_path)
    assert suite.names == ["Mid", "alpha", "beta-10", "beta-2", "zeta"]
    assert suite.root == (tmp_path / "tasks").resolve()
    assert suite.task_dirs == sorted(p.parent for p in suite.root.glob("*/task.toml"))
    assert load_suite(suite.root).names == suite.names  # root round-trips


def test_flat_layout_and_str_source(tmp_path, no_hub):
    make_task(tmp_path, "b")
    make_task(tmp_path, "a")
    (tmp_path / "notes").mkdir()  # neither task.toml nor instruction.md: not a task, not reported
    suite = load_suite(str(tmp_path))
    assert suite.names == ["a", "b"]
    assert suite.invalid == []
    assert list(iter(suite))[1].name == "b"


def test_task_name_comes_from_task_section_when_present(tmp_path):
    make_task(tmp_path, "folder-name", toml='[task]\nname = "acme/renamed"\n')
    assert load_suite(tmp_path).names == ["acme/renamed"]


def test_num_tasks_and_indices_select_from_sorted_tasks(tmp_path):
    for name in "edcba":
        make_task(tmp_path / "tasks", name)
    assert load_suite(tmp_path, num_tasks=2).names == ["a", "b"]
    assert load_suite(tmp_path, num_tasks=99).names == ["a", "b", "c", "d", "e"]
    assert load_suite(tmp_path, indices=[4, 0, 4, -2]).names == ["e", "a", "e", "d"]
    assert load_suite(indices=[1]).names == [EXAMPLE_NAMES[1]]


def test_num_tasks_and_indices_are_mutually_exclusive(tmp_path):
    make_task(tmp_path, "a")
    with pytest.raises(ValueError, match="num_tasks or indices"):
        load_suite(tmp_path, num_tasks=1, indices=[0])


def test_num_tasks_must_be_positive_and_indices_non_empty(tmp_path):
    make_task(tmp_path, "a")
    with pytest.raises(ValueError, match="at least 1"):
        load_suite(tmp_path, num_tasks=0)
    with pytest.raises(ValueError, match="indices is empty"):
        load_suite(tmp_path, indices=[])


@pytest.mark.parametrize("bad", [3, 10, -4])
def test_out_of_range_index_names_index_and_suite_size(tmp_path, bad):
    for name in "abc":
        make_task(tmp_path, name)
    with pytest.raises(IndexError) as info:
        load_suite(tmp_path, indices=[0, bad])
    assert f"task index {bad}" in str(info.value)
    assert "3 task(s)" in str(info.value)


@pytest.mark.range
def test_invalid_tasks_are_reported_logged_and_left_out(tmp_path, caplog):
    tasks = tmp_path / "tasks"
    make_task(tasks, "good")
    make_task(tasks, "no-toml", toml=None)
    make_task(tasks, "bad-toml", toml="[verifier\ntimeout_sec = ")
    make_task(tasks, "bad-config", toml='[verifier]\ntimeout_sec = "soon"\n')
    make_task(tasks, "no-tests", test=False)
    make_task(tasks, "no-instruction", instruction=None)
    make_task(tasks, "empty-instruction", instruction="  \n")
    make_task(tasks, "no-environment", environment=False)
    (tasks / "not-a-task").mkdir()  # no task.toml, no instruction.md: silently skipped

    with caplog.at_level("WARNING", logger="harbor_async"):
        suite = load_suite(tmp_path)

    assert suite.names == ["good"]
    reasons = {bad.path.name: bad.reason for bad in suite.invalid}
    assert sorted(reasons) == [
        "bad-config",
        "bad-toml",
        "empty-instruction",
        "no-environment",
        "no-instruction",
        "no-tests",
        "no-toml",
    ]
    assert all(isinstance(bad, InvalidTask) and bad.path.is_absolute() for bad in suite.invalid)
    assert reasons["no-toml"] == "missing task.toml"
    assert reasons["bad-toml"].startswith("invalid TOML in task.toml")
    assert "verifier.timeout_sec" in reasons["bad-config"]
    assert "tests/test.sh" in reasons["no-tests"]
    assert reasons["no-instruction"] == "missing instruction.md"
    assert reasons["empty-instruction"] == "instruction.md is empty"
    assert "environment/" in reasons["no-environment"]

    warnings = [r.event_dict for r in caplog.records if r.levelname == "WARNING"]
    assert {e["reason"] for e in warnings} == set(reasons.values())


def test_selected_invalid_task_is_left_out_but_positions_match_trl(tmp_path):
    for name in ("a", "c"):
        make_task(tmp_path, name)
    make_task(tmp_path, "b", test=False)
    suite = load_suite(tmp_path, indices=[1, 2])  # "b" is position 1, as in TRL's sorted dirs
    assert suite.names == ["c"]
    assert [bad.path.name for bad in suite.invalid] == ["b"]
    # Unselected tasks are not validated.
    assert load_suite(tmp_path, indices=[0]).invalid == []


def test_suite_with_only_invalid_tasks_lists_every_reason(tmp_path):
    make_task(tmp_path / "tasks", "one", test=False)
    make_task(tmp_path / "tasks", "two", toml="not = [valid")
    with pytest.raises(EmptySuiteError) as info:
        load_suite(tmp_path)
    message = str(info.value)
    assert "one:" in message and "tests/test.sh" in message
    assert "two:" in message and "invalid TOML" in message
    assert [bad.path.name for bad in info.value.invalid] == ["one", "two"]
    assert isinstance(info.value, ValueError)


def test_suite_without_any_task_is_an_error(tmp_path, no_hub):
    (tmp_path / "tasks").mkdir()
    with pytest.raises(EmptySuiteError, match="no tasks found"):
        load_suite(tmp_path)


def test_single_task_folder_as_suite_points_to_load_task(tmp_path):
    task_dir = make_task(tmp_path, "only")
    with pytest.raises(EmptySuiteError, match="load_task"):
        load_suite(task_dir)


@pytest.mark.parametrize(
    "source",
    ["./missing-suite", "missing-suite", "deeply/nested/missing", "~/no-such-suite-xyz", "/no/such/suite"],
)
def test_missing_local_suite_path_is_not_found_without_hub(source, no_hub, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SuiteNotFoundError) as info:
        load_suite(source)
    assert source in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_missing_path_object_is_not_found_without_hub(tmp_path, no_hub):
    with pytest.raises(SuiteNotFoundError, match="does not exist"):
        load_suite(tmp_path / "org" / "name")
    with pytest.raises(SuiteNotFoundError, match="does not exist"):
        load_suite(Path("org/name"))  # a Path is always local, even if shaped like a repo id


def test_suite_path_that_is_a_file_is_not_found(tmp_path, no_hub):
    (tmp_path / "suite.txt").write_text("x")
    with pytest.raises(SuiteNotFoundError, match="not a directory"):
        load_suite(tmp_path / "suite.txt")


def test_existing_local_path_shaped_like_repo_id_stays_local(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    make_task(tmp_path / "org" / "name" / "tasks", "t1")
    assert load_suite("org/name").names == ["t1"]


# ── Hugging Face datasets, with snapshot_download faked offline ──────────────


class FakeHub:
    """Stands in for huggingface_hub.snapshot_download: records calls, returns a tmp snapshot."""

    def __init__(self, snapshot: Path) -> None:
        self.snapshot = snapshot
        self.calls: list[tuple[tuple, dict]] = []

    def __call__(self, *args, **kwargs) -> str:
        self.calls.append((args, kwargs))
        return str(self.snapshot)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch) -> FakeHub:
    snapshot = tmp_path / "hub-snapshot"
    shutil.copytree(EXAMPLE_TASKS, snapshot / "tasks")
    hub = FakeHub(snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    return hub


@pytest.mark.range
def test_hub_dataset_downloads_only_the_tasks_tree(fake_hub):
    suite = load_suite("acme/harbor-tasks", num_tasks=3)
    assert suite.names == EXAMPLE_NAMES[:3]
    assert suite.root == (fake_hub.snapshot / "tasks").resolve()
    assert len(fake_hub.calls) == 1
    args, kwargs = fake_hub.calls[0]
    assert args == ("acme/harbor-tasks",)
    assert kwargs["repo_type"] == "dataset"
    assert kwargs["allow_patterns"] == ["tasks/**"] == HUB_ALLOW_PATTERNS
    assert kwargs.get("revision") is None


@pytest.mark.range
@pytest.mark.parametrize(
    ("source", "repo_id", "revision"),
    [
        ("acme/harbor-tasks@v1.2", "acme/harbor-tasks", "v1.2"),
        ("hf://acme/harbor-tasks", "acme/harbor-tasks", None),
        ("hf://datasets/acme/harbor-tasks@main", "acme/harbor-tasks", "main"),
    ],
)
def test_hub_source_forms(fake_hub, source, repo_id, revision):
    assert load_suite(source).names == EXAMPLE_NAMES
    args, kwargs = fake_hub.calls[-1]
    assert args == (repo_id,)
    assert kwargs["revision"] == revision


@pytest.mark.range
def test_hub_download_failure_is_suite_not_found(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(SuiteNotFoundError) as info:
        load_suite("acme/missing-suite")
    assert "acme/missing-suite" in str(info.value)
    assert "network is unreachable" in str(info.value)


def test_hub_snapshot_without_tasks_folder_is_not_found(tmp_path, monkeypatch):
    (tmp_path / "snap").mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub(tmp_path / "snap"))
    with pytest.raises(SuiteNotFoundError, match="no tasks/ folder"):
        load_suite("acme/empty")


def test_hub_suite_reports_invalid_tasks_too(tmp_path, monkeypatch):
    make_task(tmp_path / "snap" / "tasks", "ok")
    make_task(tmp_path / "snap" / "tasks", "broken", toml="= nope")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub(tmp_path / "snap"))
    suite = load_suite("acme/mixed")
    assert suite.names == ["ok"]
    assert [bad.path.name for bad in suite.invalid] == ["broken"]


# ── load_task ────────────────────────────────────────────────────────────────


@pytest.mark.range
def test_load_task_returns_harbor_task():
    task = load_task(EXAMPLE_TASKS / "word-frequency")
    assert isinstance(task, Task)
    assert task.name == "word-frequency"
    assert "stopwords.txt" in task.instruction
    assert task.config.metadata["gold_answer"] == "lantern"
    assert task.config.verifier.timeout_sec == 30.0


@pytest.mark.range
@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"toml": None}, "missing task.toml"),
        ({"toml": "[agent\n"}, "invalid TOML in task.toml"),
        ({"toml": "[agent]\ntimeout_sec = []\n"}, "agent.timeout_sec"),
        ({"test": False}, "tests/test.sh"),
        ({"instruction": None}, "missing instruction.md"),
    ],
)
def test_load_task_errors_carry_path_and_reason(tmp_path, kwargs, reason):
    task_dir = make_task(tmp_path, "broken", **kwargs)
    with pytest.raises(TaskLoadError) as info:
        load_task(task_dir)
    assert info.value.path == task_dir
    assert reason in info.value.reason
    assert str(task_dir) in str(info.value)


def test_load_task_missing_dir(tmp_path):
    with pytest.raises(TaskLoadError, match="no such directory"):
        load_task(tmp_path / "nope")


def test_task_load_error_pickles():
    import pickle

    err = pickle.loads(pickle.dumps(TaskLoadError(Path("/x"), "because")))
    assert (err.path, err.reason) == (Path("/x"), "because")


@pytest.mark.parametrize("entry", ["instruction.md", "tests"])
def test_a_task_entry_that_is_a_symlink_out_of_the_task_is_refused(tmp_path, entry):
    outside = tmp_path / "host-secret"
    outside.mkdir()
    (outside / "instruction.md").write_text("the host's file\n")
    (outside / "test.sh").write_text("#!/bin/sh\n")
    task = make_task(tmp_path / "tasks", "escape")
    target = task / entry
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    target.symlink_to(outside / "instruction.md" if entry == "instruction.md" else outside)
    with pytest.raises(TaskLoadError, match=f"{entry} leads out of the task folder"):
        load_task(task)


@pytest.mark.slow
def test_tasks_on_local_marks_a_from_image_the_host_does_not_match(tmp_path):
    task = make_task(tmp_path / "tasks", "alpine-task")
    (task / "environment" / "Dockerfile").write_text("FROM alpine:3.20\nWORKDIR /workdir\n")
    make_task(tmp_path / "tasks", "plain-task")
    result = subprocess.run(
        ["harbor-async", "tasks", "-p", str(tmp_path), "-e", "local"], capture_output=True, text=True,
        env={**os.environ, "COLUMNS": "250"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[2].strip(): line for line in result.stdout.splitlines() if "-task" in line}
    assert "alpine" in rows["alpine-task"] and rows["plain-task"].rstrip(" │").endswith("ok")


@pytest.mark.range
@pytest.mark.parametrize(
    "line, reason",
    [
        ("[verifier]\ntimeout_sec = inf", "[verifier] timeout_sec = inf"),
        ("[verifier]\ntimeout_sec = nan", "[verifier] timeout_sec = nan"),
        ("[verifier]\ntimeout_sec = 0.0", "[verifier] timeout_sec = 0.0"),
        ("[agent]\ntimeout_sec = 1e308", "[agent] timeout_sec = 1e+308"),
        ("[environment]\nmemory_mb = -1", "[environment] memory_mb = -1"),
        ("[environment]\ncpus = 0", "[environment] cpus = 0"),
    ],
)  # fmt: skip
def test_a_task_with_an_insane_timeout_or_resource_is_invalid(tmp_path, line, reason):
    task = make_task(tmp_path, "t", toml=line + "\n")
    with pytest.raises(TaskLoadError, match=re.escape(reason)):
        load_task(task)


@pytest.mark.slow
def test_a_budget_that_a_multiplier_overflows_is_refused_before_any_sandbox_starts(tmp_path):
    from tests.cli_helpers import harbor_async

    make_task(tmp_path / "suite", "big", toml="[verifier]\ntimeout_sec = 600000.0\n")
    result = harbor_async(
        "run", "-p", str(tmp_path / "suite"), "-e", "simulated", "--verifier-timeout-multiplier", "1e305",
        "-o", str(tmp_path / "jobs"),
    )  # fmt: skip
    assert result.returncode == 2 and "task big: timeout must be finite after the multiplier" in result.stderr
    assert not (tmp_path / "jobs").exists() or not any((tmp_path / "jobs").rglob("episodes.jsonl"))
