"""terminus-2 on the same tasks through OpenEnv's Harbor rollout and through harbor-async, side by side.

Both sides run Harbor's own terminus-2 on the bundled suite's tasks, on the
same backend (docker), against the same scripted model server
(``tests/scripted_server.py``, model ``terminus``: it speaks terminus-2's JSON
and returns vLLM-style token ids and logprobs), and both capture every model
call through a proxy of their own:

- OpenEnv: ``openenv.harbor.runner.run_batch`` (``benchmarks/openenv_child.py``,
  in a venv with ``openenv[harbor]``), which runs its rollouts one after
  another;
- harbor-async: ``harbor-async run -a terminus-2 --capture``, once with
  ``-n 1`` (one episode at a time, as OpenEnv runs them) and once with its
  default concurrency.

Per episode: the reward, the model calls and the captured completion tokens
(OpenEnv's ``n_trainable_tokens``; ours summed from ``agent/capture.json``)
must agree; per run: episodes per second over the command's wall time (each
side's start-up included, as a user waits for it). ``--repeats`` rounds, the order of
the three rotating; the figures are medians of the rounds' ratios.

    python -m benchmarks.openenv_side --openenv-python /path/to/venv/bin/python [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.provenance import REPO, begin
from benchmarks.report import write_json

SUITE = REPO / "harbor_async" / "suites" / "example" / "tasks"
MODEL = "terminus"
#: Both sides read LiteLLM's bundled model cost map instead of fetching it (no network here: each fetch retries ~8 s).
QUIET_LITELLM = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "scripted_server.py"), "--port", str(port), "--suite", str(SUITE)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the scripted model server did not start")


def run_openenv(python: str, url: str, work: Path) -> dict[str, Any]:
    """OpenEnv's batch of every task; per episode and the batch's seconds."""
    out = work / "openenv.jsonl"
    command = [python, str(REPO / "benchmarks" / "openenv_child.py"), "--llm-url", url, "--dataset", str(SUITE),
               "--model", MODEL, "--out", str(out), "--port", str(_free_port()), "--trials", str(work / "openenv-trials")]  # fmt: skip
    begin_at = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **QUIET_LITELLM}, timeout=3600)
    wall = time.perf_counter() - begin_at
    if done.returncode != 0:
        raise RuntimeError(f"OpenEnv's batch failed: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    batch = rows.pop()
    episodes = {
        row["task_name"]: {"reward": row["reward"], "calls": row["n_turns"], "tokens": row["n_trainable_tokens"],
                           "capture_ok": row["ok"], "findings": row["findings"]}
        for row in rows
    }  # fmt: skip
    return {"episodes": episodes, "seconds": wall, "batch_seconds": batch["batch_seconds"]}


def run_ours(url: str, work: Path, concurrency: int | None) -> dict[str, Any]:
    """``harbor-async run -a terminus-2 --capture`` of every task; per episode and the run's seconds."""
    jobs = work / f"ours-{concurrency or 'default'}"
    command = [sys.executable, "-m", "harbor_async", "run", "-p", str(SUITE), "-e", "docker", "-a", "terminus-2",
               "-m", f"hosted_vllm/{MODEL}", "--ak", f"api_base={url}", "--capture", "-o", str(jobs), "--quiet"]  # fmt: skip
    if concurrency is not None:
        command += ["-n", str(concurrency)]
    begin_at = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **QUIET_LITELLM}, cwd=REPO, timeout=3600)
    wall = time.perf_counter() - begin_at
    if done.returncode != 0:
        raise RuntimeError(f"harbor-async run failed: {done.stderr[-2000:]}")
    (job,) = [p for p in jobs.iterdir() if p.is_dir()]
    summary = json.loads((job / "summary.json").read_text())
    episodes = {}
    for line in (job / "episodes.jsonl").read_text().splitlines():
        record = json.loads(line)
        capture = json.loads((job / record["trial"] / "agent" / "capture.json").read_text())
        episodes[record["task"]] = {
            "reward": record["reward"], "calls": len(capture["calls"]),
            "tokens": sum(len(call["completion_token_ids"] or []) for call in capture["calls"]),
            "capture_ok": record["capture"]["rollout_details"]["mismatches"] == 0,
        }  # fmt: skip
    return {"episodes": episodes, "seconds": wall, "sandbox_seconds": summary.get("sandbox_seconds"), "concurrency": concurrency}


def compare(openenv: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """Where the two sides' episodes differ (reward, calls, captured tokens), task by task."""
    differences = []
    for task in sorted(set(openenv["episodes"]) | set(ours["episodes"])):
        a, b = openenv["episodes"].get(task), ours["episodes"].get(task)
        if a is None or b is None:
            differences.append({"task": task, "missing_from": "openenv" if a is None else "harbor-async"})
            continue
        for key in ("reward", "calls", "tokens"):
            if a[key] != b[key]:
                differences.append({"task": task, "field": key, "openenv": a[key], "harbor-async": b[key]})
    return {"same_episodes": not differences, "differences": differences}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openenv-python", required=True, help="python of a venv with openenv[harbor] installed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "openenv-side.json")
    args = parser.parse_args()
    begin()
    version = subprocess.run([args.openenv_python, "-c", "import importlib.metadata as m; print(m.version('openenv'), m.version('harbor'))"],
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    server, url = _server()
    rounds = []
    try:
        for repeat in range(args.repeats):
            sides = ["openenv", "ours-1", "ours"]
            sides = sides[repeat % 3 :] + sides[: repeat % 3]  # the order rotates: none always runs first
            with tempfile.TemporaryDirectory(prefix="openenv-side-") as folder:
                work = Path(folder)
                found: dict[str, dict[str, Any]] = {}
                for side in sides:
                    if side == "openenv":
                        found[side] = run_openenv(args.openenv_python, url, work)
                    else:
                        found[side] = run_ours(url, work, 1 if side == "ours-1" else None)
                    print(f"round {repeat + 1} {side}: {len(found[side]['episodes'])} episodes in {found[side]['seconds']:.1f} s",
                          file=sys.stderr)  # fmt: skip
            episodes = len(found["openenv"]["episodes"])
            rounds.append({
                "order": sides,
                "openenv_eps": round(episodes / found["openenv"]["seconds"], 4),
                "ours_one_at_a_time_eps": round(episodes / found["ours-1"]["seconds"], 4),
                "ours_eps": round(episodes / found["ours"]["seconds"], 4),
                "same_as_ours_one_at_a_time": compare(found["openenv"], found["ours-1"]),
                "same_as_ours": compare(found["openenv"], found["ours"]),
                "openenv": found["openenv"], "ours_one_at_a_time": found["ours-1"], "ours": found["ours"],
            })  # fmt: skip
    finally:
        server.kill()
    ratio_one = [r["ours_one_at_a_time_eps"] / r["openenv_eps"] for r in rounds]
    ratio = [r["ours_eps"] / r["openenv_eps"] for r in rounds]
    result = {
        "openenv": version[0], "harbor_in_openenvs_venv": version[1], "backend": "docker", "agent": "terminus-2",
        "tasks": len(rounds[0]["openenv"]["episodes"]), "rounds": rounds,
        "summary": {
            "same_episodes_every_round": all(r["same_as_ours_one_at_a_time"]["same_episodes"] and r["same_as_ours"]["same_episodes"] for r in rounds),
            "ours_one_at_a_time_over_openenv_median": round(statistics.median(ratio_one), 3),
            "ours_one_at_a_time_over_openenv_range": [round(min(ratio_one), 3), round(max(ratio_one), 3)],
            "ours_over_openenv_median": round(statistics.median(ratio), 3),
            "ours_over_openenv_range": [round(min(ratio), 3), round(max(ratio), 3)],
        },
    }  # fmt: skip
    print(json.dumps(result["summary"], indent=2), file=sys.stderr)
    write_json(args.out, "openenv-side", result)


if __name__ == "__main__":
    main()
