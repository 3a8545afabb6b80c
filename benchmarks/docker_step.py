"""GRPO-step environment time on Harbor's docker backend, B = 8 distinct tasks: TRL's env, the shim, docker-fast.

One run, side by side, the GRPO-step replay of :mod:`benchmarks.grpo_step`:

- ``trl`` on ``docker``: TRL 1.16's own ``HarborBashEnv``;
- ``shim`` on ``docker``: the shim, GRPOTrainer's serial tool loop;
- ``shim`` on ``docker-fast``: the same with the cheaper starts of
  :mod:`harbor_async.backends.docker.fast_start`;
- ``shim-rounds`` on ``docker-fast``: and each turn's calls dispatched all at
  once by HarborGRPOTrainer's round code;
- with a pause of :data:`OPTIMISE_SECONDS` after each step's rewards, standing
  in for a GPU optimiser step (host CPUs idle; not environment time):
  ``shim-rounds`` again; ``shim-prefetch-early``, the next step's sandboxes
  started by HarborGRPOTrainer's prefetch when the rewards begin (beside the
  verifiers); ``shim-prefetch``, started once the rewards are in, where
  HarborGRPOTrainer starts them.

Step 1 and the later steps are reported apart (step 1 starts from the run's
empty build cache: every image is built, or found in the daemon's cache, once);
the docker-fast runs add every start's per-call profile. Each task of the
bundled suite has its own image, and the replay takes 8 consecutive tasks a
step, so one step's sandboxes are 8 different images.

Run: ``python -m benchmarks.docker_step [--steps 3] [--out benchmarks/results]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.grpo_step import run_grpo_steps

#: Seconds of the pause standing in for a GPU optimiser step (host CPUs idle) in the last three variants.
OPTIMISE_SECONDS = 4.0
#: (implementation, backend, optimiser pause) triples, in run order.
VARIANTS = (
    ("trl", "docker", 0.0),
    ("shim", "docker", 0.0),
    ("shim", "docker-fast", 0.0),
    ("shim-rounds", "docker-fast", 0.0),
    ("shim-rounds", "docker-fast", OPTIMISE_SECONDS),
    ("shim-prefetch-early", "docker-fast", OPTIMISE_SECONDS),
    ("shim-prefetch", "docker-fast", OPTIMISE_SECONDS),
)


def _images_in_daemon() -> int:
    """How many of the daemon's images are Harbor task images (``hb__*``): the cache state at the start."""
    found = subprocess.run(
        ["docker", "images", "--format", "{{.Repository}}"], capture_output=True, text=True, check=False
    )
    return sum(1 for name in found.stdout.split() if name.startswith("hb__"))


def run(batch: int = 8, turns: int = 3, steps: int = 3, log: Any = print) -> dict[str, Any]:
    """Every variant, one after another; their runs and the ratios to TRL's env (later steps, and step 1)."""
    result: dict[str, Any] = {"batch": batch, "turns": turns, "steps": steps, "hb_images_before": _images_in_daemon()}
    runs = []
    for implementation, backend, optimise in VARIANTS:
        pause = f", {optimise:g} s optimiser pause" if optimise else ""
        log(f"docker-step: {implementation} on {backend}, B={batch}, T={turns}, {steps} steps{pause}")
        grpo = run_grpo_steps(
            implementation,
            backend=backend,
            batch=batch,
            turns=turns,
            steps=steps,
            optimise_seconds=optimise,
            on_step=lambda i, t: log(
                f"  step {i + 1}: {t.total:.2f} s (reset {t.reset:.2f}, tools {t.tools:.2f}, rewards {t.rewards:.2f})"
            ),
        )
        data = grpo.to_dict()
        data["first_step"] = data["step_totals"][0]
        runs.append(data)
    result["runs"] = runs
    trl = runs[0]
    result["summary"] = {
        _label(r): {
            "first_step_s": r["first_step"],
            "later_step_mean_s": r["later_step_mean"],
            "later_ratio_to_trl": round(trl["later_step_mean"] / r["later_step_mean"], 1),
            "first_ratio_to_trl": round(trl["first_step"] / r["first_step"], 1),
        }
        for r in runs
    }
    return result


def _label(run: dict[str, Any]) -> str:
    """``implementation@backend``, plus ``+optimiseNs`` for a run with an optimiser pause."""
    pause = run.get("optimise_seconds") or 0
    return f"{run['implementation']}@{run['backend']}" + (f"+optimise{pause:g}s" if pause else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    from benchmarks.provenance import begin

    begin()
    result = run(args.batch, args.turns, args.steps)
    from benchmarks.report import write_json

    path = write_json(args.out / "docker-step.json", "docker-step", result)
    print(json.dumps(result["summary"], indent=2))
    for r in result["runs"]:
        if r["start_profile"]:
            print(f"start profile, {r['implementation']} on {r['backend']}:")
            for call, row in sorted(r["start_profile"].items()):
                print(f"  {call:40s} {row['count']:4.0f} calls, {row['skipped']:4.0f} skipped, "
                      f"mean {row['mean_seconds']:.3f} s")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
