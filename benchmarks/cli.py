"""``harbor-async bench ...``: the benchmark commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import anyio
import typer
from rich.console import Console

from benchmarks.grpo_step import CLOUD_LATENCIES, IMPLEMENTATIONS, GrpoRun, run_grpo_steps
from benchmarks.overhead import run_overhead
from benchmarks.report import (
    grpo_table,
    overhead_table,
    plot_grpo,
    print_tables,
    throughput_table,
    write_json,
)
from benchmarks.throughput import run_throughput

bench_app = typer.Typer(help="Benchmarks: throughput, engine overhead, GRPO-step environment time.", no_args_is_help=True)
err = Console(stderr=True, soft_wrap=True)

OutDir = Annotated[Path, typer.Option("--out", help="Folder for the JSON and PNG files.")]
DEFAULT_OUT = Path("bench-results")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _backend_kwargs(backend: str, latency: str, extra: str | None) -> dict:
    kwargs = dict(CLOUD_LATENCIES) if backend == "simulated" and latency == "cloud" else {}
    if extra:
        kwargs.update(json.loads(extra))
    return kwargs


@bench_app.command()
def throughput(
    backend: Annotated[str, typer.Option("--backend", "-b")] = "local",
    episodes: Annotated[int, typer.Option("--episodes", "-n", min=1)] = 64,
    concurrency: Annotated[str, typer.Option("--concurrency", "-c", help="Comma-separated levels.")] = "1,8,32",
    latency: Annotated[str, typer.Option(help="simulated only: 'cloud' or 'zero'.")] = "cloud",
    backend_kwargs: Annotated[str | None, typer.Option(help="JSON object of backend kwargs.")] = None,
    out: OutDir = DEFAULT_OUT,
) -> None:
    """N episodes (start, exec, verify, stop) at each concurrency level on one backend."""
    kwargs = _backend_kwargs(backend, latency, backend_kwargs)
    results = []
    for level in _ints(concurrency):
        err.print(f"throughput: {episodes} episodes at concurrency {level} on {backend}")
        results.append(anyio.run(lambda c=level: run_throughput(episodes=episodes, concurrency=c, backend=backend, backend_kwargs=kwargs)))
    print_tables(throughput_table(results))
    path = write_json(out / f"throughput-{backend}.json", "throughput", {"backend_kwargs": kwargs, "runs": [r.to_dict() for r in results]})
    err.print(f"wrote {path}")


@bench_app.command()
def overhead(
    calls: Annotated[int, typer.Option(min=10)] = 2000,
    sizes: Annotated[str, typer.Option(help="Live sandbox counts to try, comma-separated.")] = "250,500,1000,2000,4000,8000",
    out: OutDir = DEFAULT_OUT,
) -> None:
    """The portal round trip against a direct await, and the sandboxes one loop thread holds."""
    result = run_overhead(calls=calls, sizes=_ints(sizes))
    print_tables(overhead_table(result))
    path = write_json(out / "overhead.json", "overhead", result.to_dict())
    err.print(f"wrote {path}; largest live count with a probe under 1 ms: {result.max_sandboxes_under_1ms}")


@bench_app.command("grpo-step")
def grpo_step(
    backend: Annotated[str, typer.Option("--backend", "-b")] = "simulated",
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", "-B", help="Comma-separated B values.")] = "64",
    turns: Annotated[int, typer.Option("--turns", "-T", min=1)] = 3,
    steps: Annotated[int, typer.Option("--steps", "-s", min=2)] = 3,
    latency: Annotated[str, typer.Option(help="simulated only: 'cloud' (start 0.5, exec 0.05, verify 1, stop 0.5 s) or 'zero'.")] = "cloud",
    implementations: Annotated[str, typer.Option(help="Comma-separated: trl, shim.")] = "trl,shim",
    backend_kwargs: Annotated[str | None, typer.Option(help="JSON object of backend kwargs.")] = None,
    out: OutDir = DEFAULT_OUT,
) -> None:
    """Replay GRPO steps with TRL's HarborBashEnv and the shim's, on the same tasks and backend."""
    kwargs = _backend_kwargs(backend, latency, backend_kwargs)
    impls = [i.strip() for i in implementations.split(",") if i.strip()]
    unknown = set(impls) - set(IMPLEMENTATIONS)
    if unknown:
        raise typer.BadParameter(f"unknown implementation(s) {sorted(unknown)}; use {IMPLEMENTATIONS}")
    if "trl" in impls and (backend in ("local", "simulated") or ":" in backend):
        err.print("TRL's env runs through benchmarks.reference: its smallest subclass that only creates the Harbor environment by import path")
    runs: list[GrpoRun] = []
    for batch in _ints(batch_sizes):
        for impl in impls:
            err.print(f"grpo-step: {impl} on {backend}, B={batch}, T={turns}, {steps} steps")
            run = run_grpo_steps(
                impl, backend=backend, batch=batch, turns=turns, steps=steps, backend_kwargs=kwargs,
                on_step=lambda i, t, impl=impl: err.print(
                    f"  {impl} step {i + 1}: {t.total:.2f} s (reset {t.reset:.2f}, tools {t.tools:.2f}, rewards {t.rewards:.2f})"
                ),
            )  # fmt: skip
            runs.append(run)
    print_tables(grpo_table(runs))
    name = f"grpo-step-{backend.replace(':', '_').replace('.', '_')}"
    path = write_json(out / f"{name}.json", "grpo-step", {"backend_kwargs": kwargs, "runs": [r.to_dict() for r in runs]})
    plot = plot_grpo(runs, out / f"{name}.png", f"GRPO step environment time on {backend} (T={turns})")
    err.print(f"wrote {path}" + (f" and {plot}" if plot else ""))
