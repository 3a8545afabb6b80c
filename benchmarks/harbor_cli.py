"""``harbor-async run`` against Harbor's own ``harbor run``: one suite, agent, backend and ``-n``, rounds alternated.

Each round runs both CLIs as a user would (a fresh process each, into its own
job folder), the order flipping from round to round so that neither always
runs on a warmer machine. The wall time (and so episodes/s) is the process's,
start-up included, as a user waits for it; the trials' span, first start to
last end, is recorded beside it. The phases come from the trial
``result.json`` files both CLIs write in Harbor's layout, read the same way
for both so that one yardstick measures both: start = environment (and agent) setup, agent = agent execution,
verify = verifier, stop = from the verifier's end to the trial's end (Harbor
stops the environment before it stamps ``finished_at``).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.provenance import REPO

CLIS = ("harbor-async", "harbor")
PHASES = ("start", "agent", "verify", "stop")


class HarborBenchError(RuntimeError):
    """One of the two CLIs failed, or left no trial results to read."""


@dataclass
class SideRun:
    """One CLI's run of the suite in one round."""

    cli: str
    wall_s: float
    rewards: list[float | None]
    errors: int
    phases: dict[str, list[float]] = field(default_factory=dict)
    # First trial start to last trial end: the wall time less the CLI's start-up and exit.
    trials_span_s: float | None = None
    # Per task (its folder's name): each trial's (reward, Harbor's exception name or None, seconds).
    tasks: dict[str, list[tuple[float | None, str | None, float | None]]] = field(default_factory=dict)
    exit_code: int = 0

    @property
    def episodes(self) -> int:
        return len(self.rewards)

    @property
    def episodes_per_second(self) -> float:
        return self.episodes / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "episodes": self.episodes,
            "episodes_per_second": round(self.episodes_per_second, 3),
            "trials_span_s": None if self.trials_span_s is None else round(self.trials_span_s, 3),
            "reward_one": sum(1 for r in self.rewards if r == 1.0),
            "reward_mean": round(statistics.fmean(r or 0.0 for r in self.rewards), 4) if self.rewards else None,
            "errors": self.errors,
            "phases": _phase_stats(self.phases),
        }


def harbor_tasks_path(suite: Path) -> Path:
    """The folder ``harbor run -p`` wants: task folders directly under it (our suites may keep them in ``tasks/``)."""
    nested = suite / "tasks"
    return nested if not (suite / "task.toml").exists() and any(nested.glob("*/task.toml")) else suite


def commands(suite: Path, env: str, agent: str, n: int, n_tasks: int | None, jobs: Path, scratch: Path) -> dict[str, list[str]]:
    """Both command lines, the same options in the same dialect; only the backend's spelling differs."""
    bindir = Path(sys.executable).parent
    ours = bindir / "harbor-async"
    common = ["-a", agent, "-n", str(n), *(["-l", str(n_tasks)] if n_tasks else [])]
    built: dict[str, list[str]] = {}
    for cli in CLIS:
        if env == "local":  # Harbor takes this project's local backend by import path; each side its own root
            where = ["-e", "local" if cli == "harbor-async" else "harbor_async.backends.local:LocalEnvironment"]
            where += ["--ek", f"sandbox_root={scratch / ('sandboxes-' + cli)}"]
        else:
            where = ["-e", env]
        if cli == "harbor-async":
            head = [str(ours), "run"] if ours.exists() else [sys.executable, "-m", "harbor_async", "run"]
            built[cli] = [*head, "-p", str(suite), *where, *common, "-o", str(jobs / cli)]
        else:
            head = [str(bindir / "harbor"), "run", "-y"]
            built[cli] = [*head, "-p", str(harbor_tasks_path(suite)), *where, *common, "-o", str(jobs / cli)]
    return built


def _seconds(span: Any) -> float | None:
    if not isinstance(span, dict) or not span.get("started_at") or not span.get("finished_at"):
        return None
    return (_time(span["finished_at"]) - _time(span["started_at"])).total_seconds()


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def read_trials(jobs: Path) -> tuple[list[float | None], int, dict[str, list[float]], float | None, dict[str, list]]:
    """Rewards, error count, per-phase seconds, the span from the first trial's start to the last one's end, and
    per task (its folder's name) each trial's (reward, exception name, seconds).

    Read from every ``<job>/<trial>/result.json`` under ``jobs``: Harbor's layout, which both CLIs write.
    """
    rewards: list[float | None] = []
    errors = 0
    phases: dict[str, list[float]] = {p: [] for p in PHASES}
    ends: list[datetime] = []
    tasks: dict[str, list[tuple[float | None, str | None, float | None]]] = {}
    for path in sorted(jobs.glob("*/*/result.json")):
        trial = json.loads(path.read_text())
        ends += [_time(trial[k]) for k in ("started_at", "finished_at") if trial.get(k)]
        reward = ((trial.get("verifier_result") or {}).get("rewards") or {}).get("reward")
        rewards.append(reward)
        errors += trial.get("exception_info") is not None
        exception = (trial.get("exception_info") or {}).get("exception_type")
        task = str(trial.get("task_name") or path.parent.name).split("/")[-1]
        tasks.setdefault(task, []).append((reward, exception, _seconds(trial)))
        setup = [s for s in (_seconds(trial.get("environment_setup")), _seconds(trial.get("agent_setup"))) if s is not None]
        if setup:
            phases["start"].append(sum(setup))
        for phase, key in (("agent", "agent_execution"), ("verify", "verifier")):
            if (s := _seconds(trial.get(key))) is not None:
                phases[phase].append(s)
        last = trial.get("verifier") or trial.get("agent_execution") or {}
        if last.get("finished_at") and trial.get("finished_at"):
            phases["stop"].append((_time(trial["finished_at"]) - _time(last["finished_at"])).total_seconds())
    span = (max(ends) - min(ends)).total_seconds() if ends else None
    return rewards, errors, phases, span, tasks


def run_side(cli: str, command: list[str], jobs: Path, timeout_s: float) -> SideRun:
    """Run one CLI to the end and read its job folder."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=jobs.parent, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise HarborBenchError(f"{cli} ran past {timeout_s:g} s: {shlex.join(command)}") from exc
    wall = time.perf_counter() - t0
    if done.returncode not in (0, 1):  # 1: some episodes failed (recorded), the per-task table shows them
        raise HarborBenchError(f"{cli} exited {done.returncode}: {shlex.join(command)}\n{(done.stdout + done.stderr)[-3000:]}")
    rewards, errors, phases, span, tasks = read_trials(jobs / cli)
    if not rewards:
        raise HarborBenchError(f"{cli} wrote no trial result.json under {jobs / cli}")
    return SideRun(cli, wall, rewards, errors, phases, span, tasks, done.returncode)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _phase_stats(phases: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        p: {"p50": round(_percentile(v, 0.5), 4), "p99": round(_percentile(v, 0.99), 4), "n": len(v)}
        for p, v in phases.items()
        if v
    }


def portable(text: str, scratch: Path | str | None = None) -> str:
    """``text`` without this machine's paths: the round's scratch folder as ``$SCRATCH``, the checkout's
    as relative, the environment's scripts by name (a result file is committed; it must read the same anywhere)."""
    if scratch is not None:
        text = text.replace(str(scratch), "$SCRATCH")
    text = text.replace(f"{Path(sys.executable).parent}/", "")  # the venv's bin: harbor-async, harbor
    return text.replace(f"{REPO}/", "").replace(str(REPO), ".")


def task_table(rounds: list[dict[str, SideRun]]) -> dict[str, Any]:
    """Per task, over every round: each CLI's rewards, exception names (Harbor's, as both write them) and median
    seconds, and whether the rewards agree (the same sorted list)."""
    names = sorted({task for sides in rounds for side in sides.values() for task in side.tasks})
    table: dict[str, Any] = {}
    for task in names:
        row: dict[str, Any] = {}
        for cli in CLIS:
            trials = [trial for sides in rounds for trial in sides[cli].tasks.get(task, [])]
            seconds = [t[2] for t in trials if t[2] is not None]
            row[cli] = {
                "rewards": sorted((t[0] for t in trials), key=lambda r: (r is None, r or 0.0)),
                "exceptions": dict(sorted(Counter(t[1] for t in trials if t[1]).items())),
                "seconds_p50": round(statistics.median(seconds), 3) if seconds else None,
            }
        row["same_rewards"] = row["harbor"]["rewards"] == row["harbor-async"]["rewards"]
        table[task] = row
    return table


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def compare(
    suite: Path, env: str, agent: str, n: int, n_tasks: int | None, repeats: int,
    timeout_s: float = 3600.0, on_run: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """``repeats`` rounds of both CLIs, alternating which goes first; the figures for the result file."""
    rounds: list[dict[str, SideRun]] = []
    shown: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="harbor-vs-harbor-async-") as tmp:
        for i in range(repeats):
            scratch = Path(tmp) / f"round-{i}"
            jobs = scratch / "jobs"
            jobs.mkdir(parents=True)
            built = commands(suite, env, agent, n, n_tasks, jobs, scratch)
            shown = {cli: portable(shlex.join(c), tmp) for cli, c in built.items()}
            order = CLIS if i % 2 == 0 else CLIS[::-1]
            sides = {}
            for cli in order:
                sides[cli] = run_side(cli, built[cli], jobs, timeout_s)
                if on_run is not None:
                    on_run(i, sides[cli])
            rounds.append(sides)
    ratios = [r["harbor-async"].episodes_per_second / r["harbor"].episodes_per_second for r in rounds]
    per_cli: dict[str, Any] = {}
    for cli in CLIS:
        runs = [r[cli] for r in rounds]
        pooled: dict[str, list[float]] = {p: [x for run in runs for x in run.phases.get(p, [])] for p in PHASES}
        per_cli[cli] = {
            "wall_s": _spread([run.wall_s for run in runs]),
            "episodes_per_second": _spread([run.episodes_per_second for run in runs]),
            "trials_span_s": _spread([run.trials_span_s for run in runs if run.trials_span_s is not None] or [0.0]),
            "episodes": sum(run.episodes for run in runs),
            "reward_one": sum(1 for run in runs for x in run.rewards if x == 1.0),
            "errors": sum(run.errors for run in runs),
            "phases": _phase_stats(pooled),
        }
    return {
        "suite": portable(str(suite)),
        "env": env,
        "agent": agent,
        "n_concurrent": n,
        "n_tasks": n_tasks,
        "repeats": repeats,
        "commands": shown,  # the last round's; earlier rounds differ only in their scratch folders (round-N)
        "clis": per_cli,
        "ratio_episodes_per_second": {"of": "harbor-async / harbor", **_spread(ratios)},
        "tasks": task_table(rounds),
        "rounds": [
            {"round": i, "first": (CLIS if i % 2 == 0 else CLIS[::-1])[0], "ratio": round(ratio, 3),
             **{cli: r[cli].to_dict() for cli in CLIS}}
            for i, (r, ratio) in enumerate(zip(rounds, ratios, strict=True))
        ],
    }  # fmt: skip
