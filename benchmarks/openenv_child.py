"""OpenEnv's own Harbor rollout of a suite's tasks, for ``benchmarks/openenv_side.py``: run in OpenEnv's venv.

Imports nothing of harbor-async (``openenv[harbor]`` pins its own Harbor, so it
lives in a venv of its own). It calls ``openenv.harbor.runner.run_batch``,
OpenEnv's batch entry point (its capture proxy, its seams, its rollouts one
after another, as that function runs them), with the harness ``terminus-2``,
and writes one JSON line per rollout and the batch's wall seconds.

One change to OpenEnv's terminus-2 wiring, so that both sides run the same
agent: ``record_terminal_session=False`` (harbor-async's default for
terminus-2; otherwise terminus-2 tries to install asciinema in the sandbox,
which has no network here, and its failed install costs ~95 s per episode).

    python benchmarks/openenv_child.py --llm-url URL --dataset DIR --model NAME --out FILE [--indices 0,1,...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any


def _without_recording() -> None:
    from openenv.harbor import seams

    wired = seams.SEAMS["terminus-2"]
    original = wired.kwargs

    def kwargs(*args: Any, **named: Any) -> dict[str, Any]:
        return {**original(*args, **named), "record_terminal_session": False}

    seams.SEAMS["terminus-2"] = dataclasses.replace(wired, kwargs=kwargs)


async def _main(args: argparse.Namespace) -> None:
    from openenv.harbor.runner import run_batch
    from openenv.harbor.tasks import resolve_task_dirs

    _without_recording()
    indices = [int(i) for i in args.indices.split(",")] if args.indices else list(range(len(resolve_task_dirs(args.dataset))))
    begin = time.perf_counter()
    results = await run_batch(
        llm_url=args.llm_url, dataset=args.dataset, task_indices=indices, harness="terminus-2", sandbox=args.sandbox,
        model=args.model, port=args.port, expose="direct", trials_dir=Path(args.trials),
    )  # fmt: skip
    seconds = time.perf_counter() - begin
    with open(args.out, "w") as out:
        for result in results:
            row = {k: getattr(result, k, None) for k in ("task_name", "ok", "reward", "n_turns", "n_trainable_tokens", "wall_s", "error")}
            row["findings"] = list(result.findings or [])[:5]
            out.write(json.dumps(row, default=str) + "\n")
        out.write(json.dumps({"batch_seconds": seconds, "episodes": len(results)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llm-url", required=True)
    parser.add_argument("--dataset", required=True, help="a folder of Harbor tasks")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--indices", default="")
    parser.add_argument("--sandbox", default="docker")
    parser.add_argument("--port", type=int, default=18532, help="OpenEnv's capture proxy")
    parser.add_argument("--trials", default="/tmp/openenv-harbor-trials")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
