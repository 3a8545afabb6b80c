"""What ending the agent's processes before the verifier costs: the verify phase with and without ``strict_verify``.

Each round runs the bundled suite's tasks once with the oracle on one engine
with ``strict_verify=False`` and once with ``strict_verify=True`` (the order
alternates between rounds), and reads each record's verify seconds. On local
strict mode starts a new PID namespace over the sandbox's files, on docker it
restarts the main container; elsewhere it kills every process of the sandbox
but its init and main command. A round's figure is the median
verify time of each mode and their difference; the published figures are the
median, min and max over the rounds.

Run: ``harbor-async bench verify [--env local|docker] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import anyio


async def _verify_seconds(env: str, strict: bool, concurrency: int) -> list[float]:
    from harbor_async.engine.engine import Engine
    from harbor_async.episodes.runner import run_suite
    from harbor_async.tasks.suite import load_suite

    tasks = load_suite(None).tasks
    async with Engine(strict_verify=strict) as engine:
        records = await run_suite(engine, tasks, env, agent="oracle", concurrency=concurrency)
    failed = [r for r in records if r.error_class is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed ({failed[0].error_class}: {failed[0].error})")
    return [r.seconds["verify"] for r in records]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def run(env: str, repeats: int, concurrency: int) -> dict[str, Any]:
    """``repeats`` rounds of both modes on ``env``; the per-round medians and their spread."""
    rounds = []
    for index in range(repeats):
        order = (False, True) if index % 2 == 0 else (True, False)
        medians = {strict: statistics.median(anyio.run(_verify_seconds, env, strict, concurrency)) for strict in order}
        rounds.append({"plain_s": round(medians[False], 4), "strict_s": round(medians[True], 4),
                       "added_s": round(medians[True] - medians[False], 4)})  # fmt: skip
    return {
        "env": env,
        "concurrency": concurrency,
        "rounds": rounds,
        "summary": {key: _spread([r[key] for r in rounds]) for key in ("plain_s", "strict_s", "added_s")},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", choices=("local", "docker"), default="local")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    from benchmarks.provenance import begin
    from benchmarks.report import write_json

    begin()
    result = run(args.env, args.repeats, args.concurrency)
    path = write_json(args.out / f"verify-isolation-{args.env}.json", "verify-isolation", result)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
