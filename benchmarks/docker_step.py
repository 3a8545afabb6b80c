"""GRPO-step environment time on docker, B = 8 distinct task images: each layer of ours against TRL's env.

The GRPO-step replay of :mod:`benchmarks.grpo_step`, layer by layer, every
ratio against the same baseline measured in the same round, TRL 1.16's own
``HarborBashEnv`` on Harbor's ``docker``:

- ``concurrency only``: the plain shim with Harbor's own docker start
  (``fast_start=False``): starts, verifies and stops run concurrently on the
  engine, nothing else changes;
- ``+ backend fast path``: the plain shim on plain ``docker``, what a user who
  changes the import line gets (each task image built once per run, no
  pointless Compose calls, ``docker exec``);
- ``+ trainer dispatch``: and each turn's calls dispatched at once by
  HarborGRPOTrainer's round code;
- ``+ prefetch``: and the next step's sandboxes started by HarborGRPOTrainer's
  prefetch once the rewards are in, hidden behind a pause of
  :data:`OPTIMISE_SECONDS` standing in for the optimiser step (host CPUs idle;
  the pause is not environment time, for TRL's env either).

Every layer runs ``--repeats`` rounds (TRL's env first in each); a layer's
ratio is TRL's later-step mean over its own, per round, published as the
median with min and max. Step 1 is reported apart: it starts from the round's
build cache (the first round builds every image once). ``--task-set wide``
runs the same on a generated set of heavier tasks (:mod:`benchmarks.task_sets`).

Run: ``harbor-async bench docker-step [--repeats 3] [--steps 3] [--task-set wide]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.grpo_step import run_grpo_steps

#: Seconds of the pause standing in for a GPU optimiser step (host CPUs idle) in the prefetch layer.
OPTIMISE_SECONDS = 4.0
#: (layer, implementation, backend options, optimiser pause), in run order; the first is the baseline.
LAYERS: tuple[tuple[str, str, dict[str, Any], float], ...] = (
    ("TRL's env", "trl", {}, 0.0),
    ("concurrency only", "shim", {"fast_start": False}, 0.0),
    ("+ backend fast path", "shim", {}, 0.0),
    ("+ trainer dispatch", "shim-rounds", {}, 0.0),
    ("+ prefetch", "shim-prefetch", {}, OPTIMISE_SECONDS),
)


def _images_in_daemon() -> int:
    """How many of the daemon's images are Harbor task images (``hb__*``): the cache state at the start."""
    found = subprocess.run(
        ["docker", "images", "--format", "{{.Repository}}"], capture_output=True, text=True, check=False
    )
    return sum(1 for name in found.stdout.split() if name.startswith("hb__"))


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def run(
    batch: int = 8, turns: int = 3, steps: int = 3, repeats: int = 3, suite: str | None = None, log: Any = print
) -> dict[str, Any]:
    """Every layer for ``repeats`` rounds; their runs, and each layer's ratios to TRL's env."""
    result: dict[str, Any] = {
        "batch": batch, "turns": turns, "steps": steps, "repeats": repeats,
        "suite": suite or "bundled", "hb_images_before": _images_in_daemon(),
    }  # fmt: skip
    rounds: list[list[dict[str, Any]]] = []
    for round_index in range(repeats):
        runs = []
        for layer, implementation, options, optimise in LAYERS:
            log(f"docker-step round {round_index + 1}/{repeats}: {layer} ({implementation}, {options or 'defaults'})")
            grpo = run_grpo_steps(
                implementation,
                backend="docker",
                batch=batch,
                turns=turns,
                steps=steps,
                suite=suite,
                backend_kwargs=options if implementation != "trl" else None,
                optimise_seconds=optimise,
                on_step=lambda i, t: log(
                    f"  step {i + 1}: {t.total:.2f} s (reset {t.reset:.2f}, tools {t.tools:.2f}, rewards {t.rewards:.2f})"
                ),
            )
            data = grpo.to_dict()
            data.update(layer=layer, backend_options=options, first_step=data["step_totals"][0])
            runs.append(data)
        rounds.append(runs)
    result["rounds"] = rounds
    result["summary"] = {}
    for position, (layer, *_rest) in enumerate(LAYERS):
        mine = [runs[position] for runs in rounds]
        trl = [runs[0] for runs in rounds]
        result["summary"][layer] = {
            "later_step_s": _spread([r["later_step_mean"] for r in mine]),
            "first_step_s": _spread([r["first_step"] for r in mine]),
            "later_ratio_to_trl": _spread([t["later_step_mean"] / r["later_step_mean"] for t, r in zip(trl, mine)]),
            "first_ratio_to_trl": _spread([t["first_step"] / r["first_step"] for t, r in zip(trl, mine)]),
            "mean_reward": _spread([r["mean_reward"] for r in mine]),
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--task-set", choices=("bundled", "wide"), default="bundled")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    from benchmarks.provenance import begin

    begin()
    suite = None
    if args.task_set != "bundled":
        from benchmarks.task_sets import generate

        suite = str(generate(args.task_set, Path(tempfile.gettempdir()) / "harbor-async-task-sets"))
    result = run(args.batch, args.turns, args.steps, args.repeats, suite)
    result["task_set"] = args.task_set
    from benchmarks.report import write_json

    name = "docker-step" if args.task_set == "bundled" else f"docker-step-{args.task_set}"
    path = write_json(args.out / f"{name}.json", "docker-step", result)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
