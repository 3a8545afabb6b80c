"""``harbor-async eval``: evaluate checkpoints on a suite with the training harness."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.text import Text

from harbor_async.agents.task_checks import (
    MissingVariablesError,
    UnsupportedTaskError,
)
from harbor_async.cli import cluster as cluster_opts
from harbor_async.cli import setting_opts
from harbor_async.cli.agents import AgentKwargOpt, parsed_agent_kwargs
from harbor_async.cli.common import (
    EpisodeDiskLimitOpt,
    JobDiskLimitOpt,
    StrictVerifyOpt,
    checked_backend,
    err,
    fail,
    out,
    parse_kwargs,
    say,
    say_refused,
    say_refused_at_end,
    setup_logging,
)
from harbor_async.cli.progress import EpisodeProgress
from harbor_async.cli.selection import (
    DatasetOpt,
    RegistryPathOpt,
    RegistryUrlOpt,
    suite_source,
)
from harbor_async.core.errors import HarborAsyncError, ModelServerDownError
from harbor_async.core.printing import escape_controls
from harbor_async.engine.loop import run_loop
from harbor_async.jobs.settings import JobSettings
from harbor_async.models.serve import ServerDiedError
from harbor_async.verification.disk_bounds import JobDiskLimitError

#: Exit code of an eval the model server stopped (1: infrastructure failures, 2: bad input).
MODEL_SERVER_DOWN_EXIT = 3



def eval_command(
    ctx: typer.Context,
    path: Annotated[
        str | None,
        typer.Option(
            "--path", "-p", help="Suite: a local task tree or a dataset repo id (default: the bundled example)."
        ),
    ] = None,
    dataset: DatasetOpt = None,
    registry_url: RegistryUrlOpt = None,
    registry_path: RegistryPathOpt = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            "-m",
            help="Model name on --base-url, or a checkpoint folder (glob allowed: 'ckpts/checkpoint-*'); repeat for a sweep.",
        ),
    ] = None,
    base_url: Annotated[
        str | None, typer.Option("--base-url", help="An OpenAI-compatible server's API root (http://HOST:PORT/v1).")
    ] = None,
    step_from: Annotated[
        str | None,
        typer.Option(
            "--step-from", metavar="REGEX",
            help="Read a checkpoint's step from its folder name with this regular expression, its first group the "
            "step ('ckpt(\\d+)'); default: checkpoint-N, step-N, step_N, global_step_N.",
        ),
    ] = None,
    serve_cmd: Annotated[
        str | None,
        typer.Option(
            "--serve-cmd", help="Command that serves {model} on {port} (default without --base-url: vllm serve)."
        ),
    ] = None,
    agent: Annotated[
        str,
        typer.Option(
            "--agent", "-a",
            help="Harness (bash, python, terminal, module:Class, file.py:Class) or a Harbor agent (terminus-2, ..., "
            "module:Class): it gets hosted_vllm/<model> at the server's URL.",
        ),
    ] = "bash",
    ak: AgentKwargOpt = None,
    env: Annotated[
        str, typer.Option("--env", "-e", help="Backend: local, simulated, a Harbor type (docker, ...) or module:Class.")
    ] = "local",
    attempts: Annotated[int | None, typer.Option("--n-attempts", "-k", min=1, help="Episodes per task (pass@k up to k).", show_default=setting_opts.setting_default("n_attempts"))] = None,
    concurrency: Annotated[
        int | None, typer.Option("--n-concurrent", "-n", min=1, help="Episodes (and live sandboxes) at once.", show_default=setting_opts.setting_default("n_concurrent"))
    ] = None,
    jobs_dir: Annotated[Path, typer.Option("--jobs-dir", "-o", help="Folder of job folders.")] = Path("jobs"),
    job_name: Annotated[str | None, typer.Option("--job-name", help="Job folder name (default: a timestamp).")] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Resume this job folder: run only missing and rerun-class episodes.")
    ] = None,
    num_tasks: Annotated[int | None, typer.Option("--n-tasks", "-l", min=1, help="Only the first N tasks.")] = None,
    include: Annotated[list[str] | None, typer.Option("--include-task-name", "-i", help="Only tasks whose name matches this glob (repeatable).")] = None,
    exclude: Annotated[list[str] | None, typer.Option("--exclude-task-name", "-x", help="Leave out tasks whose name matches this glob (repeatable).")] = None,
    api_key_name: Annotated[
        str | None, typer.Option("--api-key-name", help="Environment variable holding the API key.")
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Tokens per reply.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    max_turns: Annotated[int | None, typer.Option(min=1, help="Model replies per episode.", show_default=setting_opts.setting_default("limits.max_turns"))] = None,
    max_total_tokens: Annotated[
        int | None, typer.Option(help="Conversation length (tokens) that ends an episode.")
    ] = None,
    agent_timeout: Annotated[
        float | None, typer.Option(help="Seconds for the agent loop (default: the task's [agent] timeout).")
    ] = None,
    episode_timeout: Annotated[
        float | None, typer.Option(help="Seconds for a whole episode (sandbox deadline).")
    ] = None,
    start_timeout: setting_opts.StartTimeoutOpt = None,
    slot_timeout: setting_opts.SlotTimeoutOpt = None,
    start_attempts: setting_opts.StartAttemptsOpt = None,
    start_retry_wait: setting_opts.StartRetryWaitOpt = None,
    start_retry_max_wait: setting_opts.StartRetryMaxWaitOpt = None,
    start_retry_max_total: setting_opts.StartRetryMaxTotalOpt = None,
    adaptive_starts: setting_opts.AdaptiveStartsOpt = None,
    resource_telemetry: setting_opts.ResourceTelemetryOpt = None,
    max_concurrent_requests: Annotated[int | None, typer.Option(min=1, help="Model requests in flight at once.", show_default=setting_opts.setting_default("max_concurrent_requests"))] = None,
    request_timeout: Annotated[float | None, typer.Option(help="Seconds for one model request.", show_default=setting_opts.setting_default("request_timeout"))] = None,
    model_retries: Annotated[
        int | None, typer.Option(min=0, help="Retries of a failed model request (429, 5xx, timeouts).", show_default=setting_opts.setting_default("limits.retries"))
    ] = None,
    ready_timeout: Annotated[float | None, typer.Option(help="Seconds a managed server gets to become ready.", show_default=setting_opts.setting_default("ready_timeout"))] = None,
    ready_error_timeout: Annotated[
        float | None, typer.Option(help="Seconds of server errors (HTTP 5xx) while waiting for readiness before giving up.", show_default=setting_opts.setting_default("ready_error_timeout"))
    ] = None,
    success_threshold: Annotated[
        float | None, typer.Option(help="Reward at or above which an episode counts as solved.", show_default=setting_opts.setting_default("success_threshold"))
    ] = None,
    env_allow: Annotated[
        list[str] | None, typer.Option("--env-allow", help="A host variable a task's ${VAR} may read (repeatable; default none).")
    ] = None,
    strict_verify: StrictVerifyOpt = True,
    capture: Annotated[bool, typer.Option("--capture", help="Record every model call of the Harbor agent (-a terminus-2 and agents like it) through a proxy on 127.0.0.1: messages, replies, the server's token ids and logprobs, in each trial's agent/capture.json and the record's capture.")] = False,
    episode_disk_limit_mb: EpisodeDiskLimitOpt = None,
    job_disk_limit_mb: JobDiskLimitOpt = None,
    override_cpus: Annotated[float | None, typer.Option("--override-cpus", min=0.01, help="Every task's cpus (bounded as a task's own).")] = None,
    override_memory_mb: Annotated[int | None, typer.Option("--override-memory-mb", min=1, help="Every task's memory_mb (bounded as a task's own).")] = None,
    override_storage_mb: Annotated[int | None, typer.Option("--override-storage-mb", min=1, help="Every task's storage_mb (bounded as a task's own).")] = None,
    override_gpus: Annotated[int | None, typer.Option("--override-gpus", min=0, help="Every task's gpus.")] = None,
    max_model_server_failures: Annotated[
        int | None,
        typer.Option(
            "--max-model-server-failures", min=0, show_default=setting_opts.setting_default("max_model_server_failures"),
            help="Stop the eval (exit 3) after this many episodes in a row failed for the model server (0: never).",
        ),
    ] = None,
    backend_kwarg: Annotated[
        list[str] | None, typer.Option("--ek", help="Backend constructor argument KEY=VALUE (repeatable).")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning or error.", show_default="$HARBOR_ASYNC_LOG_LEVEL or warning")
    ] = None,
    log_format: Annotated[
        str | None, typer.Option(help="console or json.", show_default="$HARBOR_ASYNC_LOG_FORMAT or console")
    ] = None,
    budget: cluster_opts.BudgetOpt = "local",
    ray_address: cluster_opts.RayAddressOpt = None,
    max_live: cluster_opts.MaxLiveOpt = None,
    creates_per_second: cluster_opts.CreatesOpt = None,
    on_ray: cluster_opts.RayOpt = False,
) -> None:
    """Evaluate models (checkpoints) on a suite with the same harness, tools and prompt as training.

    Writes the job folder (harbor-async.json, episodes.jsonl, summary.json; for
    several models sweep.csv and sweep.png; a managed server's log). Exits 1
    when an episode failed for an infrastructure or model-server reason, 2 on
    bad input, 3 when the model server failed --max-model-server-failures
    episodes in a row (the eval stopped; resume it), 130/143/129 on a signal.
    """
    from harbor_async.evaluation import evaluate

    setup_logging(log_level, log_format)  # the flag, else $HARBOR_ASYNC_LOG_LEVEL/_FORMAT; a bad one: one line, exit 2
    if err.is_terminal and _names_a_harbor_agent(agent):  # its libraries take seconds to load: say so now (a person)
        say("loading:", f"-a {agent} (Harbor's agent and its model libraries take a few seconds)", "dim")
    cluster = cluster_opts.cluster_settings(budget, ray_address, max_live, creates_per_second, on_ray)  # checked now
    if path and dataset:
        raise fail("give -p PATH or -d DATASET, not both")
    if not model and resume is None:
        raise fail("give at least one -m MODEL (or --resume JOB_DIR)")
    backend_kwargs = parse_kwargs(backend_kwarg)
    checked_backend(env, backend_kwargs)
    suite: str | list[str] | None = path
    if dataset or registry_url is not None or registry_path is not None:  # resolved (downloaded) as run resolves it
        suite = cast("str | list[str] | None", suite_source(None, None, dataset, registry_url, registry_path))  # no -p: no Path
    settings: dict[str, Any] = dict(
        environment_kwargs=backend_kwargs,
        env_allow=list(env_allow or []),
        strict_verify=strict_verify,
        capture=capture,
        episode_disk_limit_mb=episode_disk_limit_mb,
        job_disk_limit_mb=job_disk_limit_mb,
        override_cpus=override_cpus,
        override_memory_mb=override_memory_mb,
        override_storage_mb=override_storage_mb,
        override_gpus=override_gpus,
        agent=agent,
        agent_kwargs=parsed_agent_kwargs(ak),
        environment_type=env,
        n_attempts=attempts,
        n_concurrent=concurrency,
        n_tasks=num_tasks,
        include=include,
        exclude=exclude,
        **cluster,
        base_url=base_url,
        serve_cmd=serve_cmd,
        step_from=step_from,
        api_key_name=api_key_name,
        sampling={
            k: v
            for k, v in dict(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed).items()
            if v is not None
        },
        limits={
            k: v
            for k, v in dict(max_turns=max_turns, max_total_tokens=max_total_tokens, timeout=agent_timeout, retries=model_retries).items()
            if v is not None
        },
        max_concurrent_requests=max_concurrent_requests,
        max_model_server_failures=max_model_server_failures,
        request_timeout=request_timeout,
        success_threshold=success_threshold,
        episode_timeout=episode_timeout,
        start_timeout=start_timeout,
        slot_timeout=slot_timeout,
        start_attempts=start_attempts,
        start_retry_wait=start_retry_wait,
        start_retry_max_wait=start_retry_max_wait,
        start_retry_max_total=start_retry_max_total,
        adaptive_starts=adaptive_starts,
        resource_telemetry=resource_telemetry,
        ready_timeout=ready_timeout,
        ready_error_timeout=ready_error_timeout,
    )
    settings = {name: value for name, value in settings.items() if value is not None}  # not given: the setting's default
    if resume is not None:  # the job's stored settings, whole: only what was typed is checked against them
        settings = _given_on_resume(ctx, settings, resume)
    progress = EpisodeProgress(err)
    try:
        with progress:
            result = run_loop(
                lambda: evaluate(
                    model,
                    suite,
                    resume=resume,
                    jobs_dir=jobs_dir,
                    job_name=job_name,
                    on_record=progress.record,
                    on_plan=lambda pending, _total: progress.plan(pending),
                    on_status=progress.status,
                    on_refused=say_refused,
                    **settings,
                )
            )
    except HarborAsyncError as exc:
        from harbor_async.evaluation import EvalInterrupted

        if isinstance(exc, EvalInterrupted):
            err.print(f"[yellow]{exc}[/]")
            raise typer.Exit(128 + exc.signum) from None
        if isinstance(exc, JobDiskLimitError):  # its message names the bound and the resume
            err.print(Text(escape_controls(f"error: {exc}")))
            raise typer.Exit(1) from None
        if isinstance(exc, ModelServerDownError):  # one line: the cause, then how to go on
            err.print(Text(escape_controls(
                f"error: {exc}; the eval stopped (records kept). Fix the server, then: "
                f"harbor-async eval --resume {exc.job_dir}"
            )))  # fmt: skip
            raise typer.Exit(MODEL_SERVER_DOWN_EXIT) from None

        if isinstance(exc, (MissingVariablesError, UnsupportedTaskError)):
            raise fail(exc) from None
        raise fail(f"{type(exc).__name__}: {exc}", code=1 if isinstance(exc, ServerDiedError) else 2) from None
    _print_summary(result.summary)
    err.print(f"job folder: {result.job_dir}")
    if result.summary.get("refused"):
        say_refused_at_end(len({r["task"] for r in result.summary["refused"]}))
    if any(r.rerun for r in result.records) or result.summary.get("refused"):
        raise typer.Exit(1)


def _names_a_harbor_agent(agent: str) -> bool:
    """Whether ``-a`` names one of Harbor's agents by name (read off Harbor's list, which loads no agent)."""
    from harbor.models.agent.name import AgentName

    return agent in {name.value for name in AgentName} and agent not in ("oracle", "nop")


#: The flags whose setting has another name.
_SETTING_OF = {
    "backend_kwarg": "environment_kwargs", "ak": "agent_kwargs", "env": "environment_type", "attempts": "n_attempts",
    "concurrency": "n_concurrent", "num_tasks": "n_tasks", "on_ray": "ray", "max_live": "cluster_max_live",
    "creates_per_second": "cluster_creates_per_second",
}  # fmt: skip
#: The flags that set one key of a setting's table (sampling, the agent loop's limits).
_KEY_OF = {
    "temperature": ("sampling", "temperature"), "top_p": ("sampling", "top_p"), "max_tokens": ("sampling", "max_tokens"),
    "seed": ("sampling", "seed"), "max_turns": ("limits", "max_turns"), "max_total_tokens": ("limits", "max_total_tokens"),
    "agent_timeout": ("limits", "timeout"), "model_retries": ("limits", "retries"),
}  # fmt: skip


def _given_on_resume(ctx: typer.Context, settings: dict[str, Any], resume: Path) -> dict[str, Any]:
    """The settings typed on a resume's command line (``evaluate`` checks them against the stored ones)."""
    from harbor_async.jobs.folder import JobFolder

    typed = [n for n in ctx.params if getattr(ctx.get_parameter_source(n), "name", "") == "COMMANDLINE"]
    if folder := [n for n in typed if n in ("jobs_dir", "job_name")]:
        raise fail(f"--resume runs the job in its own folder; drop {', '.join('--' + n.replace('_', '-') for n in folder)}")
    given: dict[str, Any] = {}
    for name in typed:
        if name in _KEY_OF:
            table, key = _KEY_OF[name]
            if table not in given:
                try:
                    given[table] = getattr(JobSettings.from_dict(JobFolder.open(resume).config), table).model_dump()
                except HarborAsyncError as exc:  # no job folder, or settings this release cannot read
                    raise fail(exc) from None
            given[table][key] = ctx.params[name]
        elif _SETTING_OF.get(name, name) in settings:
            given[_SETTING_OF.get(name, name)] = settings[_SETTING_OF.get(name, name)]
    return given


def _fmt(value: float | None, ci: Any = None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="evaluation (95% bootstrap intervals over tasks)")
    table.add_column("model")
    table.add_column("step", justify="right")
    table.add_column("episodes", justify="right")
    table.add_column("mean reward")
    ks = sorted({int(k) for s in summary["models"].values() for k in s["pass_at_k"]})
    for k in ks:
        table.add_column(f"pass@{k}")
    table.add_column("failures")
    for name, s in summary["models"].items():
        cells = [_fmt(s["mean_reward"], s["mean_reward_ci"])]
        cells += [
            _fmt((s["pass_at_k"].get(str(k)) or {}).get("value"), (s["pass_at_k"].get(str(k)) or {}).get("ci"))
            for k in ks
        ]
        failures = ", ".join(f"{k}: {v}" for k, v in s["failures"].items())
        table.add_row(
            name, str(s.get("step") if s.get("step") is not None else "-"), str(s["episodes"]), *cells, failures
        )
    out.print(table)
    sweep = summary.get("sweep")
    if sweep:
        diffs = Table(title="paired differences in mean reward (per-task bootstrap)")
        for column in ("base", "other", "tasks", "difference"):
            diffs.add_column(column)
        seen = set()
        for pair in sweep["vs_first"] + sweep["neighbours"]:
            if (pair["base"], pair["other"]) in seen:
                continue
            seen.add((pair["base"], pair["other"]))
            diffs.add_row(pair["base"], pair["other"], str(pair["tasks"]), _fmt(pair["difference"], pair["ci"]))
        out.print(diffs)
