"""``harbor-async bench ...``: the benchmark commands, in Harbor's dialect.

Only the options live here; each command imports :mod:`benchmarks` (and so the
shim, TRL and matplotlib) inside its body, so that ``harbor-async --help`` and
every other command never import them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from harbor_async.cli.common import checked_backend, fail, parse_kwargs, setup_logging

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks: throughput, engine overhead, GRPO-step environment time, harbor-async run vs harbor run (needs the bench and trl extras).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

EnvOpt = Annotated[str | None, typer.Option("--env", "-e", help="Harbor type, 'local', 'simulated' or module:Class.")]
OldBackendOpt = Annotated[str | None, typer.Option("--backend", "-b", hidden=True)]
EkOpt = Annotated[
    list[str] | None,
    typer.Option("--ek", "--environment-kwarg", help="Backend keyword argument key=value (repeatable; JSON values)."),
]
OldKwargsOpt = Annotated[str | None, typer.Option("--backend-kwargs", hidden=True)]
LatencyOpt = Annotated[
    str, typer.Option(help="simulated only: 'cloud' (start 0.5, exec 0.05, verify 1, stop 0.5 s) or 'zero'.")
]
DEFAULT_OUT = Path("bench-results")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise fail(f"{name}: {text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise fail(f"{name}: give positive integers, got {text!r}")
    return values


def _kwargs(env: str, latency: str, ek: list[str] | None, old_json: str | None) -> dict:
    import json

    if latency not in ("cloud", "zero"):
        raise fail(f"--latency must be 'cloud' or 'zero', got {latency!r}")
    from benchmarks.grpo_step import CLOUD_LATENCIES

    kwargs = dict(CLOUD_LATENCIES) if env == "simulated" and latency == "cloud" else {}
    if old_json:
        try:
            kwargs.update(json.loads(old_json))
        except ValueError as exc:
            raise fail(f"--backend-kwargs is not a JSON object: {exc}") from None
    kwargs.update(parse_kwargs(ek))
    checked_backend(env, kwargs)
    return kwargs


def _one_of(value: str, choices: tuple[str, ...], flag: str) -> None:
    """Exit 2 in one line unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise fail(f"{flag}: {' or '.join(choices)}, got {value!r}")


def _setup(log_level: str | None) -> None:
    import importlib.util

    if importlib.util.find_spec("benchmarks") is None:  # the wheel ships the product, not the benchmarks
        raise fail(
            "`harbor-async bench` needs a source checkout (the benchmarks are not in the wheel): "
            "run it from a clone of the repository (`uv run harbor-async bench ...`)"
        )
    from benchmarks.provenance import begin

    begin()  # the load average the run starts under, for the result file
    setup_logging(log_level)


LogOpt = Annotated[str | None, typer.Option(help="debug, info, warning or error.", show_default="$HARBOR_ASYNC_LOG_LEVEL or warning")]


@bench_app.command()
def throughput(
    env: EnvOpt = None,
    backend: OldBackendOpt = None,
    episodes: Annotated[int, typer.Option("--episodes", min=1, help="Episodes at each concurrency level.")] = 64,
    n_concurrent: Annotated[str | None, typer.Option("--n-concurrent", "-n", help="Comma-separated concurrency levels.", show_default="1,8,32")] = None,
    concurrency: Annotated[str | None, typer.Option("--concurrency", "-c", hidden=True)] = None,
    latency: LatencyOpt = "cloud",
    ek: EkOpt = None,
    backend_kwargs: OldKwargsOpt = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """N episodes (start, exec, verify, stop) at each concurrency level on one backend; writes throughput-ENV.json."""
    _setup(log_level)
    name = env or backend or "local"
    levels = _ints(n_concurrent or concurrency or "1,8,32", "--n-concurrent")
    from benchmarks.cli import throughput as run_it

    run_it(name, episodes, levels, _kwargs(name, latency, ek, backend_kwargs), out)


@bench_app.command()
def overhead(
    calls: Annotated[int, typer.Option(min=10)] = 2000,
    sizes: Annotated[str, typer.Option(help="Live sandbox counts to try, comma-separated.")] = "1000,2000,4000,8000,10000,12000,16000",
    bound_us: Annotated[float, typer.Option("--bound-us", min=0.0, help="The probe's p99 bound, in µs: the ramp stops at the first size above it.")] = 20_000.0,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """The portal round trip against a direct await, and the sandboxes one loop thread holds; writes overhead.json."""
    _setup(log_level)
    from benchmarks.cli import overhead as run_it

    run_it(calls, _ints(sizes, "--sizes"), out, bound_us)


@bench_app.command("fork-bombs")
def fork_bombs(
    repeats: Annotated[int, typer.Option(min=1, help="Rounds (each: the probes idle, then beside the bombs).")] = 3,
    seconds: Annotated[float, typer.Option(min=1.0, help="Seconds of each half of a round.")] = 6.0,
    bomber_cpus: Annotated[float, typer.Option(min=0.1, help="The bombers' task's cpus (their cgroup's quota, as root).")] = 0.5,
    bomber_pids: Annotated[
        int | None, typer.Option(min=16, help="The bombers' process limit (default: the local backend's, 1,024); writes fork-bombs-pidsN.json.")
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """Local sandboxes exec while fork bombs in others are killed: the probes' p99 against idle; writes fork-bombs.json."""
    _setup(log_level or "error")
    from benchmarks.cli import fork_bombs as run_it

    run_it(repeats, seconds, bomber_cpus, out, bomber_pids)


@bench_app.command("grpo-step")
def grpo_step(
    env: EnvOpt = None,
    backend: OldBackendOpt = None,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", "-B", help="Comma-separated B values.")] = "64",
    turns: Annotated[int, typer.Option("--turns", "-T", min=1)] = 3,
    steps: Annotated[int, typer.Option("--steps", "-s", min=2)] = 3,
    latency: LatencyOpt = "cloud",
    implementations: Annotated[str, typer.Option(help="Comma-separated: trl, shim.")] = "trl,shim",
    task_set: Annotated[str, typer.Option("--task-set", help="bundled (the example suite) or wide (generated heavier tasks).")] = "bundled",
    ek: EkOpt = None,
    backend_kwargs: OldKwargsOpt = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file and the PNG plot.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """Replay GRPO steps with TRL's HarborBashEnv and the shim's; writes grpo-step-ENV.json and .png."""
    _setup(log_level)
    name = env or backend or "simulated"
    impls = [i.strip() for i in implementations.split(",") if i.strip()]
    if not impls or set(impls) - {"trl", "shim"}:
        raise fail(f"--implementations takes trl and/or shim, got {implementations!r}")
    _one_of(task_set, ("bundled", "wide"), "--task-set")
    kwargs = _kwargs(name, latency, ek, backend_kwargs)
    from benchmarks.cli import grpo_step as run_it

    run_it(name, _ints(batch_sizes, "--batch-sizes"), turns, steps, impls, kwargs, out, task_set)


@bench_app.command("trainer-step")
def trainer_step(
    scenario: Annotated[str, typer.Option(help="cloud (B=64, simulated cloud latencies) or cpu-step (a real CPU step, B=16).")] = "cloud",
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    repeats: Annotated[int, typer.Option("--repeats", "-r", min=1, help="Runs of each trainer; the summary takes medians.")] = 1,
    log_level: LogOpt = None,
) -> None:
    """GRPOTrainer with the plain shim against HarborGRPOTrainer (concurrent tool rounds), without and with prefetch, each over its limit; writes trainer-step-SCENARIO.json."""
    _setup(log_level)
    from benchmarks.trainer_step import main as run_it

    run_it(["--scenario", scenario, "--out", str(out), "--repeats", str(repeats)])


@bench_app.command("docker-step")
def docker_step(
    steps: Annotated[int, typer.Option("--steps", "-s", min=2)] = 3,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Rounds of every layer; ratios are their median, min and max.")] = 3,
    task_set: Annotated[str, typer.Option("--task-set", help="bundled (the example suite) or wide (generated heavier tasks).")] = "bundled",
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """GRPO steps on docker, B=8 distinct task images, layer by layer against TRL's env; writes docker-step[-SET].json."""
    _setup(log_level)
    _one_of(task_set, ("bundled", "wide"), "--task-set")
    from benchmarks.docker_step import main as run_it

    run_it(["--steps", str(steps), "--repeats", str(repeats), "--task-set", task_set, "--out", str(out)])


@bench_app.command("verify")
def verify(
    env: Annotated[str, typer.Option("--env", "-e", help="local or docker.")] = "local",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Rounds of both modes (their order alternates).")] = 3,
    n_concurrent: Annotated[int, typer.Option("--n-concurrent", "-n", min=1, help="Episodes at once.")] = 4,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """The verify phase with and without --strict-verify on the bundled suite; writes verify-isolation-ENV.json."""
    _setup(log_level)
    _one_of(env, ("local", "docker"), "--env")
    from benchmarks.verify_isolation import main as run_it

    run_it(["--env", env, "--repeats", str(repeats), "--concurrency", str(n_concurrent), "--out", str(out)])


@bench_app.command("harbor")
def harbor(
    path: Annotated[Path | None, typer.Option("--path", "-p", help="A local suite.", show_default="the bundled example suite")] = None,
    env: Annotated[str, typer.Option("--env", "-e", help="local or docker (Harbor spells local by import path).")] = "local",
    agent: Annotated[str, typer.Option("--agent", "-a", help="A Harbor agent both CLIs run.")] = "oracle",
    n_concurrent: Annotated[int, typer.Option("--n-concurrent", "-n", min=1, help="Episodes at once, both CLIs.")] = 8,
    n_tasks: Annotated[int | None, typer.Option("--n-tasks", "-l", min=1, help="At most N tasks.")] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Rounds; the CLIs alternate which goes first.")] = 3,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """The same suite, agent, backend and -n under `harbor-async run` and Harbor's `harbor run`; writes harbor-vs-harbor-async-ENV.json."""
    _setup(log_level)
    _one_of(env, ("local", "docker"), "--env")
    from benchmarks.cli import harbor as run_it
    from benchmarks.harbor_cli import HarborBenchError
    from harbor_async.suites import example_suite_path

    suite = (path or example_suite_path()).resolve()
    try:
        run_it(suite, env, agent, n_concurrent, n_tasks, repeats, out)
    except HarborBenchError as exc:
        raise fail(f"bench harbor: {exc}", code=1) from None


@bench_app.command("churn")
def churn(
    seconds: Annotated[float, typer.Option("--seconds", min=1.0, help="Seconds of each window (idle, churn).")] = 6.0,
    width: Annotated[int, typer.Option("--width", min=1, help="Churners of each kind (starts, kills, transfers).")] = 2,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Rounds on each event loop (asyncio, uvloop).")] = 3,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """Does the loop thread stay responsive while local sandboxes start, are killed and transfer files? Writes churn.json.

    A trainer-like thread times calls through the loop thread idle and under the churn, on asyncio and on uvloop.
    """
    _setup(log_level or "error")
    from benchmarks.cli import churn as run_it

    run_it(repeats, seconds, width, out)


@bench_app.command("telemetry")
def telemetry(
    env: Annotated[str, typer.Option("--env", "-e", help="local or docker.")] = "local",
    episodes: Annotated[int, typer.Option("--episodes", min=1, help="Episodes per run.")] = 48,
    concurrency: Annotated[int, typer.Option("--concurrency", "-n", min=1, help="Episodes at once.")] = 8,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Rounds of on and off (the order alternates).")] = 3,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """What resource telemetry costs: throughput with it on and off, and each reading's latency; writes telemetry-ENV.json."""
    _setup(log_level or "error")
    _one_of(env, ("local", "docker"), "--env")
    from benchmarks.cli import telemetry as run_it

    run_it(env, repeats, episodes, concurrency, out)


@bench_app.command("starts")
def starts(
    profile: Annotated[
        list[str] | None,
        typer.Option("--profile", help="A provider profile (repeatable): e2b-pro, e2b-hobby, coreweave-free, bursty.", show_default="all"),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option("--policy", help="fixed-N or adaptive-N (repeatable).", show_default="fixed-8, fixed-64, adaptive-64"),
    ] = None,
    episodes: Annotated[int, typer.Option("--episodes", min=1, help="Episodes per run (simulated; local and docker: at most 64).")] = 200,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs of each policy (the order alternates).")] = 3,
    speedup: Annotated[
        float, typer.Option(min=1.0, help="Divide every latency and multiply every rate by this (the dynamics keep their shape).")
    ] = 5.0,
    env: Annotated[
        str,
        typer.Option("--env", "-e", help="simulated (the provider profiles), or local or docker (throughput, window on and off)."),
    ] = "simulated",
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the JSON file.")] = DEFAULT_OUT,
    log_level: LogOpt = None,
) -> None:
    """Adaptive starts against fixed limits on simulated cloud providers (429s, quotas, heavy tails); writes starts.json.

    With --env local or docker: the throughput of -n 8 and 32 with the window on and off; writes starts-ENV.json.
    """
    _setup(log_level or "error")
    _one_of(env, ("simulated", "local", "docker"), "--env")
    if env != "simulated":
        from benchmarks.cli import starts_backend

        starts_backend(env, repeats, episodes, out)
        return
    from benchmarks.starts import PROFILES, Policy

    names = profile or list(PROFILES)
    for name in names:
        _one_of(name, tuple(PROFILES), "--profile")
    try:
        policies = [Policy.parse(text) for text in policy or ("fixed-8", "fixed-64", "adaptive-64")]
    except ValueError as exc:
        raise fail(f"--policy: {exc}") from None
    from benchmarks.cli import starts as run_it

    run_it(names, policies, repeats, episodes, speedup, out)
