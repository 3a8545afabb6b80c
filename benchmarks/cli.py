"""The bodies of ``harbor-async bench ...`` (options: :mod:`harbor_async.cli.bench`, which imports this lazily)."""

from __future__ import annotations

from pathlib import Path

import anyio
from rich.console import Console

from benchmarks.grpo_step import GrpoRun, run_grpo_steps
from benchmarks.overhead import run_overhead
from benchmarks.report import (
    grpo_table,
    harbor_table,
    harbor_task_table,
    overhead_table,
    plot_grpo,
    print_tables,
    throughput_table,
    write_json,
)
from benchmarks.throughput import run_throughput

err = Console(stderr=True, soft_wrap=True)


def throughput(backend: str, episodes: int, levels: list[int], kwargs: dict, out: Path) -> Path:
    """N episodes at each concurrency level; writes ``throughput-<backend>.json`` (no plot)."""
    results = []
    for level in levels:
        err.print(f"throughput: {episodes} episodes at concurrency {level} on {backend}", markup=False)
        results.append(
            anyio.run(
                lambda c=level: run_throughput(episodes=episodes, concurrency=c, backend=backend, backend_kwargs=kwargs)
            )
        )
    print_tables(throughput_table(results))
    name = backend.replace(":", "_").replace(".", "_")
    runs = [r.to_dict() for r in results]
    path = write_json(out / f"throughput-{name}.json", "throughput", {"backend_kwargs": kwargs, "runs": runs})
    err.print(f"wrote {path}", markup=False)
    return path


def fork_bombs(repeats: int, seconds: float, bomber_cpus: float, out: Path, bomber_pids: int | None = None) -> Path:
    """Fork bombs killed while other sandboxes exec (:mod:`benchmarks.fork_bombs`); writes ``fork-bombs.json``."""
    from benchmarks.fork_bombs import run_fork_bombs

    result = run_fork_bombs(repeats, seconds=seconds, bomber_cpus=bomber_cpus, bomber_pids=bomber_pids)
    for number, found in enumerate(result["rounds"], 1):
        err.print(
            f"round {number}: probe p99 {found['idle_p99_ms']} ms idle, {found['bombed_p99_ms']} ms under bombs "
            f"({found['p99_ratio']}x; bombs never killed: {found['unkilled_p99_ms']} ms, {found['unkilled_ratio']}x); {found['kills']} kills, p50 {found['kill_p50_s']} s; walk of the host "
            f"{found['table_walk_ms']} ms ({found['host_processes']} processes), of a bomber's cgroup "
            f"{found['cgroup_walk_ms']} ms ({found['cgroup_processes']})",
            markup=False,
        )
    ratio = result["p99_ratio"]
    err.print(f"p99 under bombs / idle: median {ratio['median']}x ({ratio['min']}-{ratio['max']})", markup=False)
    name = "fork-bombs.json" if bomber_pids is None else f"fork-bombs-pids{bomber_pids}.json"
    return _written(out / name, "fork-bombs", result)


def overhead(calls: int, sizes: list[int], out: Path, bound_us: float = 20_000.0) -> Path:
    """The portal round trip and the loop thread's capacity; writes ``overhead.json`` (no plot)."""
    result = run_overhead(calls=calls, sizes=sizes, bound_us=bound_us)
    print_tables(overhead_table(result))
    path = write_json(out / "overhead.json", "overhead", result.to_dict())
    err.print(f"wrote {path}; largest live count with a probe p99 within {bound_us:g} µs: {result.max_sandboxes_under_bound}", markup=False)
    return path


def grpo_step(
    backend: str, batches: list[int], turns: int, steps: int, impls: list[str], kwargs: dict, out: Path,
    task_set: str = "bundled",
) -> Path:
    """GRPO steps with TRL's env and the shim's; writes ``grpo-step-<backend>[-<task set>].json`` and ``.png``."""
    suite = None
    if task_set != "bundled":
        import tempfile

        from benchmarks.task_sets import generate

        suite = str(generate(task_set, Path(tempfile.gettempdir()) / "harbor-async-task-sets"))
    if "trl" in impls and (backend in ("local", "simulated") or ":" in backend):
        err.print(
            "TRL's env runs through benchmarks.reference: its smallest subclass that only creates "
            "the Harbor environment by import path",
            markup=False,
        )
    runs: list[GrpoRun] = []
    for batch in batches:
        for impl in impls:
            err.print(f"grpo-step: {impl} on {backend}, B={batch}, T={turns}, {steps} steps", markup=False)
            run = run_grpo_steps(
                impl, backend=backend, batch=batch, turns=turns, steps=steps, backend_kwargs=kwargs, suite=suite,
                on_step=lambda i, t, impl=impl: err.print(
                    f"  {impl} step {i + 1}: {t.total:.2f} s (reset {t.reset:.2f}, tools {t.tools:.2f}, rewards {t.rewards:.2f})",
                    markup=False,
                ),
            )  # fmt: skip
            runs.append(run)
    print_tables(grpo_table(runs))
    name = f"grpo-step-{backend.replace(':', '_').replace('.', '_')}" + (f"-{task_set}" if suite else "")
    data = {"backend_kwargs": kwargs, "task_set": task_set, "runs": [r.to_dict() for r in runs]}
    path = write_json(out / f"{name}.json", "grpo-step", data)
    plot = plot_grpo(runs, out / f"{name}.png", f"GRPO step environment time on {backend} (T={turns})")
    err.print(f"wrote {path}" + (f" and {plot}" if plot else ""), markup=False)
    return path


def harbor(suite: Path, env: str, agent: str, n: int, n_tasks: int | None, repeats: int, out: Path) -> Path:
    """``harbor-async run`` and ``harbor run`` alternated for ``repeats`` rounds; writes ``harbor-vs-harbor-async-<env>.json``."""
    from benchmarks.harbor_cli import compare

    err.print(f"harbor: {repeats} rounds of harbor-async run and harbor run on {env}, -a {agent}, -n {n}", markup=False)
    result = compare(
        suite, env, agent, n, n_tasks, repeats,
        on_run=lambda i, side: err.print(
            f"  round {i + 1}: {side.cli}: {side.episodes} episodes in {side.wall_s:.2f} s "
            f"({side.episodes_per_second:.2f}/s)", markup=False,
        ),
    )  # fmt: skip
    print_tables(harbor_table(result), harbor_task_table(result))
    name = env.replace(":", "_").replace(".", "_")
    return _written(out / f"harbor-vs-harbor-async-{name}.json", "harbor", result)


def starts(profiles: list[str], policies: list, repeats: int, episodes: int, speedup: float, out: Path) -> Path:
    """Adaptive against fixed start policies (:mod:`benchmarks.starts`); writes ``starts.json``."""
    from rich.table import Table

    from benchmarks.starts import run_starts

    result = run_starts(profiles, policies, repeats=repeats, episodes=episodes, speedup=speedup)
    table = Table(title=f"starts: medians of {repeats} runs, {episodes} episodes each")
    for column in ("profile", "policy", "goodput (ep/s)", "episode p99 (s)", "429s", "quota", "not judged"):
        table.add_column(column, justify="right")
    for profile, rows in result["summary"].items():
        for name, row in rows.items():
            table.add_row(
                profile, name, f"{row['goodput']:.2f}", f"{row['episode_p99_s']:.2f}", f"{row['rate_limited']:g}",
                f"{row['quota_refused']:g}", f"{row['not_judged']:g}",
            )  # fmt: skip
    print_tables(table)
    return _written(out / "starts.json", "starts", result)


def starts_backend(env: str, repeats: int, episodes: int, out: Path) -> Path:
    """Throughput with the start window on and off on a real backend; writes ``starts-<env>.json``."""
    from benchmarks.starts import run_backend

    result = run_backend(env, repeats=repeats, episodes=min(episodes, 64))
    for level, row in result["summary"].items():
        err.print(
            f"{env} -n {level}: adaptive / fixed episodes per second, median {row['ratio_median']} "
            f"({row['ratio_min']}-{row['ratio_max']})",
            markup=False,
        )
    return _written(out / f"starts-{env}.json", "starts", result)


def telemetry(env: str, repeats: int, episodes: int, concurrency: int, out: Path) -> Path:
    """Throughput with resource telemetry on and off, and the reading's own latency; writes ``telemetry-<env>.json``."""
    from benchmarks.telemetry import run_telemetry

    result = run_telemetry(env, repeats=repeats, episodes=episodes, concurrency=concurrency)
    row = result["summary"]
    err.print(
        f"{env}: telemetry on / off episodes per second, median {row['ratio_median']} ({row['ratio_min']}-"
        f"{row['ratio_max']}); a reading p50 {row['reading_p50_ms_median']} ms, p99 {row['reading_p99_ms_median']} ms",
        markup=False,
    )
    return _written(out / f"telemetry-{env}.json", "telemetry", result)


def churn(repeats: int, seconds: float, width: int, out: Path) -> Path:
    """The loop thread's responsiveness while sandboxes start, are killed and transfer files; writes ``churn.json``."""
    from benchmarks.churn import run_churn

    result = run_churn(repeats=repeats, seconds=seconds, width=width)
    for name, row in result["summary"].items():
        err.print(
            f"{name}: the probe's p99 under churn / idle, median {row['p99_ratio_median']} "
            f"({row['p99_ratio_min']}-{row['p99_ratio_max']}); idle p99 {row['idle_p99_ms_median']} ms",
            markup=False,
        )
    return _written(out / "churn.json", "churn", result)


def _written(path: Path, kind: str, result: dict) -> Path:
    """``result`` written to ``path`` with its provenance (:func:`benchmarks.report.write_json`), and said so."""
    written = write_json(path, kind, result)
    err.print(f"wrote {written}", markup=False)
    return written
