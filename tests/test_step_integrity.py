"""A multi-step task's reward cannot be raised by breaking a later step's tests (issue 44, item 2).

The attack is an oracle solution a model could write: it solves step one and
leaves a process that kills every ``test.sh`` it sees once step two has begun,
so that step two (which it got wrong) has no reward. Harbor leaves such a step out of the ``mean``
(1.0); here its tests ran and left no reward, so it scores 0 (0.5), as an
honest agent with the same answers scores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli_helpers import harbor_async, records

TOML = """schema_version = "1.4"
multi_step_reward_strategy = "mean"

[verifier]
timeout_sec = 20.0

[agent]
timeout_sec = 30.0

[[steps]]
name = "one"

[[steps]]
name = "two"
"""

# Each step's test: 1 when its answer file says "solved"; the sleep gives a killer time to act, as tests take time.
TEST = """#!/bin/bash
sleep 1
if grep -q solved /app/{step}.txt 2>/dev/null; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""

KILLER = """nohup sh -c 'while :; do
  [ -e /app/two.txt ] && for p in /proc/[0-9]*; do grep -qs "tes[t].sh" $p/cmdline && kill -9 ${p#/proc/} 2>/dev/null; done
  sleep 0.05
done' > /dev/null 2>&1 &
"""


def make_task(root: Path, name: str, *, killer: bool) -> None:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "task.toml").write_text(TOML)
    (task / "instruction.md").write_text("Two steps.\n")
    answers = {"one": "solved", "two": "wrong"}
    for step, answer in answers.items():
        folder = task / "steps" / step
        for sub in ("solution", "tests"):
            (folder / sub).mkdir(parents=True)
        (folder / "instruction.md").write_text(f"Write the answer of step {step} to /app/{step}.txt.\n")
        solve = f"#!/bin/bash\nmkdir -p /app && echo {answer} > /app/{step}.txt\n"
        if killer and step == "one":
            solve += KILLER
        (folder / "solution" / "solve.sh").write_text(solve)
        (folder / "tests" / "test.sh").write_text(TEST.format(step=step))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "no-strict"])
@pytest.mark.parametrize(
    "backend", ["local", pytest.param("docker", marks=[pytest.mark.slow, pytest.mark.docker])]
)
def test_killing_a_later_steps_tests_does_not_raise_the_mean(
    tmp_path: Path, backend: str, strict: bool, request: pytest.FixtureRequest
) -> None:
    """Strict (the default): the killer is ended before step two's tests, which judge its wrong answer 0.
    Not strict: the killer ends step two's tests, a step that left no reward, scored 0 all the same."""
    if backend == "docker":
        request.getfixturevalue("docker_daemon")  # fails (never skips) under CI when docker is missing
    suite = tmp_path / "suite"
    make_task(suite, "honest", killer=False)
    make_task(suite, "killer", killer=True)
    jobs = tmp_path / "jobs"
    strictness = "--strict-verify" if strict else "--no-strict-verify"
    done = harbor_async(
        "run", "-p", str(suite), "-e", backend, "--jobs-dir", str(jobs), "--job-name", "steps", strictness, timeout=600
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = {r["task"]: r for r in records(jobs / "steps")}
    assert found["honest"]["reward"] == 0.5
    killed = found["killer"]
    assert killed["reward"] == 0.5, json.dumps(killed)[:2000]
    assert killed["error_class"] is None  # the model's episode, judged: not rerun, not left out
    steps = {s["name"]: s for s in killed["steps"]}
    assert steps["one"]["reward"] == 1.0
    if strict:
        assert steps["two"]["reward"] == 0.0 and not steps["two"]["error"], steps["two"]
    else:
        assert steps["two"]["reward"] is None and steps["two"]["error"], steps["two"]


@pytest.mark.slow
def test_a_sandbox_the_agent_filled_is_its_failure_not_infrastructure(tmp_path: Path) -> None:
    """Step one fills the sandbox's disk: step two's files do not fit, a failed step scored 0, never rerun."""
    task = tmp_path / "suite" / "fill"
    make_task(tmp_path / "suite", "fill", killer=False)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml.replace("[[steps]]", "[environment]\nstorage_mb = 64\n\n[[steps]]", 1))
    one, two = task / "steps" / "one" / "solution", task / "steps" / "two" / "solution"
    (one / "solve.sh").write_text("#!/bin/bash\nmkdir -p /app && echo solved > /app/one.txt\nhead -c 200M /dev/zero > /fill; true\n")
    (two / "data.bin").write_bytes(bytes(range(256)) * 4096)  # 1 MiB that no longer fits
    jobs = tmp_path / "jobs"
    done = harbor_async("run", "-p", str(tmp_path / "suite"), "--jobs-dir", str(jobs), "--job-name", "fill", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]  # not infrastructure
    (record,) = records(jobs / "fill")
    assert record["error_class"] == "agent" and "No space left" in record["error"], record
    assert record["reward"] == 0.5  # step one judged 1, step two a failed step
