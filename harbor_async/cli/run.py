"""``harbor-async run`` and ``harbor-async tasks``: episodes of a suite, in Harbor's dialect.

Every run is a job folder (``-o/--jobs-dir``/``--job-name``, as Harbor's): its
settings in ``harbor-async.json``, one record a line in ``episodes.jsonl`` appended
and flushed as each episode ends, ``summary.json`` at the end. ``--resume``
runs what a job is missing. Signals stop the batch cleanly (see
:mod:`harbor_async.core.interrupts`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Annotated, Any, cast

import typer
from rich.table import Table
from rich.text import Text

from harbor_async.agents.task_checks import (
    RUN,
    MissingVariablesError,
    UnsupportedTaskError,
    check_tasks,
    refused_summary,
)
from harbor_async.backends.local import task_image_mismatch
from harbor_async.cli import cluster as cluster_opts
from harbor_async.cli import setting_opts
from harbor_async.cli.agents import AgentKwargOpt
from harbor_async.cli.common import (
    EpisodeDiskLimitOpt,
    JobDiskLimitOpt,
    StrictVerifyOpt,
    checked_backend,
    err,
    fail,
    out,
    parse_indices,
    parse_kwargs,
    say,
    say_refused,
    say_refused_at_end,
    setup_logging,
)
from harbor_async.cli.eval import MODEL_SERVER_DOWN_EXIT
from harbor_async.cli.progress import EpisodeProgress
from harbor_async.cli.run_options import (
    checked_mounts,
    defaults_line,
    env_pairs,
    load_env_file,
    mounts_option,
    previous_refusals,
    print_job_config,
    print_plan,
    refuse_protected_mounts,
    with_config,
)  # fmt: skip
from harbor_async.cli.run_output import print_summary, print_table
from harbor_async.cli.selection import (
    DatasetOpt,
    RegistryPathOpt,
    RegistryUrlOpt,
    TaskRefOpt,
    describe_episodes,
    load_tasks,
    plan_episodes,
    reload_episodes,
    suite_source,
)
from harbor_async.core.errors import (
    BackendError,
    ResumeConflictError,
    SettingError,
    UnknownSettingError,
)
from harbor_async.core.interrupts import Interrupts
from harbor_async.core.printing import escape_controls
from harbor_async.core.records import EpisodeRecord
from harbor_async.engine.engine import Engine
from harbor_async.engine.loop import run_loop
from harbor_async.episodes.runner import (
    MODEL_FREE_AGENTS,
    FailureBudget,
    PlannedEpisode,
)
from harbor_async.jobs.scoring import summarize
from harbor_async.jobs.settings import JobSettings
from harbor_async.models.serve import ServeError
from harbor_async.tasks.host_variables import RunEnvError, fill_values
from harbor_async.tasks.suite import suite_task_path
from harbor_async.verification.disk_bounds import JobDiskLimitError

DEFAULT_JOBS_DIR = Path("jobs")



# ── options shared by `run` and `tasks` (Harbor's spellings; older ones hidden) ──
SuiteArg = Annotated[str | None, typer.Argument(hidden=True, help="Older spelling of -p/-d.")]
PathOpt = Annotated[
    Path | None, typer.Option("--path", "-p", help="A local suite: <root>/tasks/*/task.toml or <root>/*/task.toml.")
]
NTasksOpt = Annotated[
    int | None, typer.Option("--n-tasks", "-l", min=1, help="At most N tasks (applied after -i/-x).")
]
OldNumTasksOpt = Annotated[int | None, typer.Option("--num-tasks", min=1, hidden=True)]
IncludeOpt = Annotated[
    list[str] | None, typer.Option("--include-task-name", "-i", help="Only tasks whose name matches this glob (repeatable).")
]
ExcludeOpt = Annotated[
    list[str] | None, typer.Option("--exclude-task-name", "-x", help="Leave out tasks whose name matches this glob (repeatable).")
]
IndicesOpt = Annotated[str | None, typer.Option("--indices", help="Comma-separated task positions, as TRL's HarborSpec takes them.")]

# With --resume the job's harbor-async.json is read whole; each option of `run` is one of these.
#: Options of one invocation, not of the job: a resume takes them as given.
_INVOCATION_OPTIONS = frozenset({"ctx", "resume", "json_path", "log_level", "debug", "quiet", "yes", "log_format", "dry_run", "config", "print_config"})
#: Options that choose the job's tasks and folder: the job keeps its plan (the episodes) and its folder.
_PLAN_OPTIONS = frozenset({
    "suite", "path", "dataset", "task_ref", "registry_url", "registry_path", "n_tasks", "num_tasks", "include", "exclude", "indices",
    "jobs_dir", "job_name",
})  # fmt: skip
#: Options that set one job setting (by its name): given on a resume, they must equal the stored value.
_SETTING_OF = {
    "slot_timeout": "slot_timeout", "start_attempts": "start_attempts", "start_retry_wait": "start_retry_wait",
    "start_retry_max_wait": "start_retry_max_wait", "start_retry_max_total": "start_retry_max_total",
    "adaptive_starts": "adaptive_starts", "resource_telemetry": "resource_telemetry", "env": "environment_type", "backend": "environment_type", "agent": "agent", "n_concurrent": "n_concurrent",
    "concurrency": "n_concurrent", "n_attempts": "n_attempts", "env_allow": "env_allow", "strict_verify": "strict_verify",
    "episode_disk_limit_mb": "episode_disk_limit_mb", "job_disk_limit_mb": "job_disk_limit_mb",
    "max_retries": "max_retries", "retry_include": "retry_include", "retry_exclude": "retry_exclude",
    "force_build": "force_build", "delete": "delete", "mounts_writable": "mounts_writable", "agent_import_path": "agent", "environment_import_path": "environment_type", "override_cpus": "override_cpus", "override_memory_mb": "override_memory_mb",
    "override_storage_mb": "override_storage_mb", "override_gpus": "override_gpus", "artifact": "artifacts",
    "timeout_multiplier": "timeout_multiplier", "agent_timeout_multiplier": "agent_timeout_multiplier",
    "verifier_timeout_multiplier": "verifier_timeout_multiplier",
    "environment_build_timeout_multiplier": "environment_build_timeout_multiplier",
    "agent_setup_timeout_multiplier": "agent_setup_timeout_multiplier", "episode_timeout": "episode_timeout",
    "start_timeout": "start_timeout", "budget": "budget", "ray_address": "ray_address", "max_live": "cluster_max_live",
    "creates_per_second": "cluster_creates_per_second", "on_ray": "ray",
    "max_model_server_failures": "max_model_server_failures", "disable_verification": "disable_verification",
    "capture": "capture",
}  # fmt: skip
#: Options whose value is converted before it is compared (the agent's model and options, where its server is now; --ek).
_CONVERTED_OPTIONS = frozenset({"model", "ak", "ek", "base_url", "api_key_name", "agent_env", "verifier_env", "mounts", "env_file"})


def run(
    ctx: typer.Context,
    suite: SuiteArg = None,
    path: PathOpt = None,
    dataset: DatasetOpt = None,
    registry_url: RegistryUrlOpt = None,
    registry_path: RegistryPathOpt = None,
    task_ref: TaskRefOpt = None,
    env: Annotated[str | None, typer.Option("--env", "-e", help="Harbor type (docker, e2b, ...), 'local', 'simulated' or module:Class.", show_default="local")] = None,
    backend: Annotated[str | None, typer.Option("--backend", "-b", hidden=True)] = None,
    environment_import_path: Annotated[str | None, typer.Option("--environment-import-path", help="An environment class, module:Class (as -e module:Class; Harbor's older spelling).")] = None,
    agent_import_path: Annotated[str | None, typer.Option("--agent-import-path", help="An agent class, module:Class (as -a module:Class; Harbor's older spelling).")] = None,
    override_cpus: Annotated[float | None, typer.Option("--override-cpus", min=0.01, help="Every task's cpus (bounded by the backend as a task's own: at most this host's on local and docker).")] = None,
    override_memory_mb: Annotated[int | None, typer.Option("--override-memory-mb", min=1, help="Every task's memory_mb (bounded as a task's own).")] = None,
    override_storage_mb: Annotated[int | None, typer.Option("--override-storage-mb", min=1, help="Every task's storage_mb (bounded as a task's own).")] = None,
    override_gpus: Annotated[int | None, typer.Option("--override-gpus", min=0, help="Every task's gpus (a task asking for GPUs is refused where the backend has none).")] = None,
    artifact: Annotated[list[str] | None, typer.Option("--artifact", help="A sandbox path to collect into each trial's artifacts/ after the agent, besides the task's own (repeatable).")] = None,
    agent_env: Annotated[list[str] | None, typer.Option("--ae", "--agent-env", help="KEY=VALUE over every command of the agent (repeatable; not the verifier's); a ${VAR} is filled from --env-allow'ed host variables.")] = None,
    verifier_env: Annotated[list[str] | None, typer.Option("--ve", "--verifier-env", help="KEY=VALUE of every verification, over the task's [verifier.env] (repeatable); a ${VAR} as in task.toml.")] = None,
    capture: Annotated[bool, typer.Option("--capture", help="Record every model call of the Harbor agent (-a terminus-2 and agents like it) through a proxy on 127.0.0.1: messages, replies, the server's token ids and logprobs, in each trial's agent/capture.json and the record's capture.")] = False,
    disable_verification: Annotated[bool, typer.Option("--disable-verification/--enable-verification", help="Run the agents and collect their artifacts, no verifier: every episode is recorded not judged (no reward, in no score, never rerun).")] = False,
    env_file: Annotated[Path | None, typer.Option("--env-file", help="A .env file loaded into this process's environment first; a task or --ae/--ve still reads a variable only through --env-allow NAME.")] = None,
    mounts: Annotated[str | None, typer.Option("--mounts", "--mounts-json", help="JSON array of host paths mounted into every sandbox (Compose volumes: '[\"/data:/data\"]' or {type: bind, source, target}); read-only, whatever it says (local, docker).")] = None,
    mounts_writable: Annotated[bool, typer.Option("--mounts-writable", help="DANGEROUS: let a --mounts entry be writable as the JSON says (rw, read_only: false): the sandbox's code can then change those host files.")] = False,
    force_build: Annotated[bool, typer.Option("--force-build/--no-force-build", help="Build each task's environment again at its first start in this run, even where its image is there (docker).")] = False,
    delete: setting_opts.DeleteOpt = False,
    agent: Annotated[str | None, typer.Option("--agent", "-a", help="A Harbor agent (oracle, none/nop: no agent, terminus-2, claude-code, ...) or module:Class.", show_default=setting_opts.setting_default("agent"))] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="The agent's model, as Harbor names it (LiteLLM's provider/model, e.g. hosted_vllm/NAME).")] = None,
    ak: AgentKwargOpt = None,
    base_url: Annotated[str | None, typer.Option("--base-url", help="The agent's inference server (a Harbor agent's api_base or base_url; --ak wins).")] = None,
    api_key_name: Annotated[str | None, typer.Option("--api-key-name", help="The variable holding the agent's inference API key.")] = None,
    n_concurrent: Annotated[int | None, typer.Option("--n-concurrent", "-n", min=1, help="Episodes (and live sandboxes) at once.", show_default=setting_opts.setting_default("n_concurrent"))] = None,
    concurrency: Annotated[int | None, typer.Option("--concurrency", min=1, hidden=True)] = None,
    n_attempts: Annotated[int | None, typer.Option("--n-attempts", "-k", min=1, help="Episodes per task; pass@k is reported when above 1.", show_default=setting_opts.setting_default("n_attempts"))] = None,
    n_tasks: NTasksOpt = None,
    num_tasks: OldNumTasksOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    indices: IndicesOpt = None,
    env_allow: Annotated[list[str] | None, typer.Option("--env-allow", help="A host variable a task's ${VAR} may read (repeatable; default none).")] = None,
    strict_verify: StrictVerifyOpt = True,
    episode_disk_limit_mb: EpisodeDiskLimitOpt = None,
    job_disk_limit_mb: JobDiskLimitOpt = None,
    max_retries: Annotated[int | None, typer.Option("--max-retries", "-r", min=0, help="Rerun an episode that was not judged (infrastructure, the model server) up to this many times in this run; a judged one never is.", show_default="0")] = None,
    retry_include: Annotated[list[str] | None, typer.Option("--retry-include", help="Rerun only these outcomes (Harbor's exception names, ours, or a class: infrastructure; repeatable).")] = None,
    retry_exclude: Annotated[list[str] | None, typer.Option("--retry-exclude", help="Never rerun these outcomes (repeatable; default Harbor's list).")] = None,
    ek: Annotated[list[str] | None, typer.Option("--ek", "--environment-kwarg", help="Backend keyword argument key=value (repeatable); values are read as JSON when they parse.")] = None,
    timeout_multiplier: Annotated[float | None, typer.Option("--timeout-multiplier", help="Multiplies the start, exec, agent and verifier budgets.", show_default=setting_opts.setting_default("timeout_multiplier"))] = None,
    agent_timeout_multiplier: Annotated[float | None, typer.Option("--agent-timeout-multiplier", help="Multiplies the agent budget (overrides --timeout-multiplier).")] = None,
    verifier_timeout_multiplier: Annotated[float | None, typer.Option("--verifier-timeout-multiplier", help="Multiplies the verifier budget (overrides --timeout-multiplier).")] = None,
    environment_build_timeout_multiplier: Annotated[float | None, typer.Option("--environment-build-timeout-multiplier", help="Multiplies the start budget (overrides --timeout-multiplier).")] = None,
    agent_setup_timeout_multiplier: Annotated[float | None, typer.Option("--agent-setup-timeout-multiplier", help="Multiplies a Harbor agent's setup budget (overrides --timeout-multiplier).")] = None,
    episode_timeout: Annotated[float | None, typer.Option(help="Seconds for a whole episode (all phases but the stop).")] = None,
    start_timeout: setting_opts.StartTimeoutOpt = None,
    slot_timeout: setting_opts.SlotTimeoutOpt = None,
    start_attempts: setting_opts.StartAttemptsOpt = None,
    start_retry_wait: setting_opts.StartRetryWaitOpt = None,
    start_retry_max_wait: setting_opts.StartRetryMaxWaitOpt = None,
    start_retry_max_total: setting_opts.StartRetryMaxTotalOpt = None,
    adaptive_starts: setting_opts.AdaptiveStartsOpt = None,
    resource_telemetry: setting_opts.ResourceTelemetryOpt = None,
    jobs_dir: Annotated[Path, typer.Option("--jobs-dir", "-o", help="Folder of job folders.")] = DEFAULT_JOBS_DIR,
    job_name: Annotated[str | None, typer.Option("--job-name", help="The job folder's name.", show_default="a timestamp")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="A job folder: run only its missing episodes and those a resume reruns.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also export the job's records (one JSON object a line) to this file.")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error.", show_default="$HARBOR_ASYNC_LOG_LEVEL or warning")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Debug logging (as --log-level debug).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "--silent", "-q", help="No progress bar.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Accepted for harbor run's command lines: harbor-async never asks.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the tasks and print the plan; start no sandbox, write no job folder.")] = False,
    config: Annotated[list[str] | None, typer.Option("--config", "-c", help="Harbor's job config (YAML or JSON JobConfig, as harbor run -c takes it; repeatable, later wins); flags given too override it.")] = None,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the run's Harbor JobConfig (JSON, as harbor run --print-config) and exit.")] = False,
    log_format: Annotated[str | None, typer.Option(help="console or json.", show_default="$HARBOR_ASYNC_LOG_FORMAT or console")] = None,
    budget: cluster_opts.BudgetOpt = "local",
    ray_address: cluster_opts.RayAddressOpt = None,
    max_live: cluster_opts.MaxLiveOpt = None,
    creates_per_second: cluster_opts.CreatesOpt = None,
    on_ray: cluster_opts.RayOpt = False,
    max_model_server_failures: Annotated[int | None, typer.Option("--max-model-server-failures", min=0, help="Stop the run (exit 3) after this many episodes in a row failed for the agent's model server (0: never).", show_default=setting_opts.setting_default("max_model_server_failures"))] = None,
) -> None:
    """Run every task of a suite (k times each), concurrently, into a job folder; report rewards and timings.

    Exits 1 when any episode failed for an infrastructure reason (start, exec,
    stop, a sandbox limit), 2 on bad input, 130/143/129 on SIGINT/SIGTERM/SIGHUP.
    """
    from harbor_async.jobs.folder import JobFolder, JobFolderError

    if agent_import_path or environment_import_path:  # Harbor's older spellings of -a/-e module:Class
        if (agent and agent_import_path) or ((env or backend) and environment_import_path):
            raise fail("give -a or --agent-import-path (-e or --environment-import-path), not both")
        agent, env = agent or agent_import_path, env or environment_import_path
    if config:  # Harbor's job config: its values where the command line gave none, then the run as if typed
        if resume is not None:
            raise fail("--resume runs the job's stored settings; drop -c/--config")
        return run(**with_config(ctx, config))
    setup_logging(log_level or ("debug" if debug else None), log_format)
    del yes  # harbor run's -y: harbor-async asks nothing
    if resume is not None:
        try:
            job = JobFolder.open(resume)
            settings = _resumed(ctx, JobSettings.from_dict(job.config))
            load_env_file(settings.env_file)  # the job's --env-file (or the one given now) again
        except (JobFolderError, ResumeConflictError, SettingError, UnknownSettingError) as exc:
            raise fail(exc) from None
        episodes = reload_episodes(settings.episodes)
    else:
        settings = _settings(
            ctx, suite=suite_source(suite, path, dataset, registry_url, registry_path, task_ref), dataset=dataset, task_ref=task_ref,
            environment_type=env or backend, agent=agent, models=[model] if model else [], n_attempts=n_attempts,
            n_concurrent=n_concurrent or concurrency, environment_kwargs=parse_kwargs(ek), env_allow=env_allow or [],
            strict_verify=strict_verify, force_build=force_build, delete=delete, agent_env=env_pairs(agent_env, "--ae"),
            mounts=mounts_option(mounts, mounts_writable), mounts_writable=mounts_writable,
            verifier_env=env_pairs(verifier_env, "--ve"), disable_verification=disable_verification, capture=capture, env_file=load_env_file(env_file), override_cpus=override_cpus, artifacts=artifact,
            override_memory_mb=override_memory_mb, override_storage_mb=override_storage_mb, override_gpus=override_gpus, episode_disk_limit_mb=episode_disk_limit_mb, max_retries=max_retries,
            retry_include=retry_include, retry_exclude=retry_exclude,
            job_disk_limit_mb=job_disk_limit_mb, timeout_multiplier=timeout_multiplier,
            agent_timeout_multiplier=agent_timeout_multiplier, verifier_timeout_multiplier=verifier_timeout_multiplier,
            environment_build_timeout_multiplier=environment_build_timeout_multiplier,
            agent_setup_timeout_multiplier=agent_setup_timeout_multiplier, episode_timeout=episode_timeout,
            start_timeout=start_timeout, slot_timeout=slot_timeout, start_attempts=start_attempts,
            start_retry_wait=start_retry_wait, start_retry_max_wait=start_retry_max_wait,
            start_retry_max_total=start_retry_max_total, adaptive_starts=adaptive_starts, resource_telemetry=resource_telemetry,
            **cluster_opts.cluster_settings(budget, ray_address, max_live, creates_per_second, on_ray),
            max_model_server_failures=max_model_server_failures,
        )  # fmt: skip
        if settings.agent not in MODEL_FREE_AGENTS and not quiet and err.is_terminal:  # seconds to load: say so now
            say("loading:", f"-a {settings.agent} (Harbor's agent and its model libraries take a few seconds)", "dim")
        settings.agent_kwargs = _agent_kwargs(settings.agent, model, ak, base_url, api_key_name)
        unsaid = defaults_line(env or backend, n_concurrent or concurrency, settings)
        loaded = load_tasks(
            settings.suite, n_tasks=n_tasks or num_tasks, indices=parse_indices(indices), include=include, exclude=exclude
        )
        settings.suite = str(loaded.root)
        episodes = plan_episodes(loaded.tasks, settings.n_attempts)
    concurrency, on_ray = settings.n_concurrent, settings.ray
    refuse_protected_mounts(settings, jobs_dir if resume is None else resume.resolve().parent)
    spec, timeouts = _resolve(settings)
    for episode in episodes:  # checked before any sandbox starts: every budget finite
        try:
            timeouts.for_task(episode.task)
        except SettingError as exc:
            raise fail(f"task {episode.task.name}: {exc}") from None
    try:  # every ${VAR} allowed; a task with a feature the backend cannot honour is refused alone (all of them: exit 2)
        refused = check_tasks(
            [e.task for e in episodes], spec, driver=_driver(settings), env_allow=settings.env_allow,
            backend_kwargs=settings.environment_kwargs, alone=resume is None, overrides=settings.task_overrides(),
        )  # fmt: skip
        fill_values(settings.agent_env, settings.env_allow, "--ae")
    except (MissingVariablesError, UnsupportedTaskError, RunEnvError) as exc:
        raise fail(exc) from None
    if refused:  # listed first, left out of the plan, kept in the summary; the exit status says so
        names = {r.task for r in refused}
        episodes = [e for e in episodes if e.task.name not in names]
        say_refused(refused, settings.environment_type)
    if episodes:  # a missing client package is one line, before any sandbox or job folder
        try:
            spec.check_installed(episodes[0].task, settings.environment_kwargs)
        except BackendError as exc:
            raise fail(exc) from None
    if dry_run:  # harbor run's --dry-run: every check above passed; the plan, and nothing else
        print_plan(episodes, settings, resume)
        return
    if print_config:  # harbor run's --print-config: the job as Harbor's JobConfig, nothing run
        print_job_config(settings, spec, jobs_dir, job_name, selection={
            "task_names": include or None, "exclude_task_names": exclude or None, "n_tasks": n_tasks or num_tasks,
        })  # fmt: skip
        return
    actor = _actor(settings)  # a Harbor agent is built once with its options, nothing started
    if settings.agent not in MODEL_FREE_AGENTS:  # its model server answers GET /models, else one line before any job folder
        from harbor_async.agents.harbor import HarborAgentSpec, check_model_server
        from harbor_async.core.errors import AgentConfigError

        try:  # an agent without a base URL of its own (openai/gpt-x) calls its provider: nothing local to probe
            check_model_server(HarborAgentSpec(settings.agent, _model(settings), settings.agent_kwargs))
        except (ServeError, AgentConfigError) as exc:
            raise fail(f"-a {settings.agent}: {exc}") from None
    budget_factory = cluster_opts.budget_from_options(
        settings.budget, settings.ray_address, settings.cluster_max_live, settings.cluster_creates_per_second, on_ray
    )

    export = _open_export(json_path)  # an unwritable export fails now, not after the batch
    if resume is None:
        settings.episodes = describe_episodes(episodes)
        stored = settings.to_dict()
        try:
            job = JobFolder.create(jobs_dir, job_name, stored)
        except JobFolderError as exc:
            raise fail(exc) from None
    root = cast(str, settings.suite or "")  # str(loaded.root) above, or the resumed job's
    try:
        job.keep_harbor_layout(settings, spec, len(episodes), root)  # harbor view, harbor job regrade read the job
    except JobFolderError as exc:
        raise fail(exc) from None
    keys = [_key(e, root, _model(settings)) for e in episodes]
    done = job.latest(root)
    todo = [e for e, key in zip(episodes, keys, strict=True) if key not in done or done[key].rerun]
    if resume is not None:
        err.print(Text(escape_controls(f"resuming {job.path}: {len(episodes) - len(todo)} of {len(episodes)} episodes kept, {len(todo)} to run")))
    else:
        if unsaid is not None:
            err.print(Text(unsaid))
        err.print(Text(escape_controls(f"job folder {job.path}")))

    interrupts = Interrupts()
    failures = FailureBudget(settings.max_model_server_failures, _server_url(settings), job.path)
    with interrupts, EpisodeProgress(err, disable=quiet or not todo) as progress:
        progress.plan(len(todo))

        def sink(record: EpisodeRecord) -> None:  # from each episode's own finally
            job.append(record)  # flushed before the next episode can end
            progress.record(record)

        try:
            engine_kwargs = settings.engine_kwargs(budget_factory, job.path)  # the one Engine of run, eval and the cluster
            retries, by_key = settings.retries(), dict(zip(keys, episodes, strict=True))
            for round_number in range(retries.max_retries + 1):  # -r: what was not judged, rerun at once
                if round_number:
                    latest = job.latest(root)
                    todo = [by_key[key] for key in keys if key in latest and retries.wants(latest[key])]
                    if not todo or interrupts.exit_code is not None or failures.error is not None:
                        break
                    progress.more(len(todo))
                    say("retrying:", f"{len(todo)} episodes not judged (retry {round_number} of {retries.max_retries})")
                if todo and on_ray:
                    _on_cluster(todo, settings, concurrency, engine_kwargs, job, sink, interrupts, root, failures)
                elif todo:
                    run_loop(_batch, todo, spec, actor, concurrency, engine_kwargs, sink, interrupts, root, _model(settings), failures)
        finally:
            job.close()
    latest = job.latest(root)
    records = [latest[key] for key in keys if key in latest]
    print_table(records)
    summary = _summary(records, len(episodes), settings, interrupted=interrupts.name or None)
    if failures.error is not None:
        summary["stopped_by"] = str(failures.error)
    if resume is not None and not refused:  # what the first run refused stays on record
        refused_before = previous_refusals(job)
    else:
        refused_before = refused_summary(refused)
    if refused_before:
        summary["refused"] = refused_before
    job.write_summary(summary)
    print_summary(summary, records)
    if export is not None:
        with export:
            for record in records:
                export.write(json.dumps(record.to_dict(), ensure_ascii=False) + "\n")
        err.print(Text(f"exported {len(records)} records to {json_path}"))
    if isinstance(failures.error, JobDiskLimitError):  # the message names the bound and the resume
        say("error:", failures.error, "bold red")
        raise typer.Exit(1)
    if failures.error is not None:  # one line: the cause, then how to go on (as eval)
        say("error:", f"{failures.error}; the run stopped (records kept). Fix the server, then: harbor-async run --resume {job.path}", "bold red")
        raise typer.Exit(MODEL_SERVER_DOWN_EXIT)
    if interrupts.exit_code is not None:
        left = len(episodes) - sum(1 for r in records if not r.rerun)
        say(f"interrupted by {interrupts.name}:", f"{left} episodes to run; resume with `harbor-async run --resume {job.path}`")
        raise typer.Exit(interrupts.exit_code)
    broken = [r for r in records if not r.judged and not r.verification_disabled]
    for r in broken:
        say(f"{r.error_class} failure", f"{r.task} (attempt {r.attempt}): {r.error}", "bold red")
    if refused:
        say_refused_at_end(len({r.task for r in refused}))
    if broken or refused:
        raise typer.Exit(1)


def _resumed(ctx: typer.Context, stored: JobSettings) -> JobSettings:
    """The stored settings of a job to resume, with the options given now checked against them (exit 2 on a conflict)."""
    given = {
        name: value for name, value in ctx.params.items()
        if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"
    }  # fmt: skip
    plan = sorted(name for name in given if name in _PLAN_OPTIONS)
    if plan:
        flags = ", ".join("--" + name.replace("_", "-") for name in plan)
        raise fail(f"--resume runs the job's stored plan in its own folder; drop {flags}")
    flag_of = {param.name: param.opts[0] for param in ctx.command.params}
    settings = stored
    checks = [(name, _SETTING_OF[name], value) for name, value in given.items() if name in _SETTING_OF]
    if given.get("model") is not None:
        checks.append(("model", "models", [given["model"]]))
    if given.get("ek") is not None:
        checks.append(("ek", "environment_kwargs", parse_kwargs(given["ek"])))
    if given.get("mounts") is not None:  # parsed as the job's were: writable as it was started, unless given anew
        checks.append(("mounts", "mounts", mounts_option(given["mounts"], given.get("mounts_writable", stored.mounts_writable))))
    for name in ("agent_env", "verifier_env"):
        if given.get(name) is not None:
            checks.append((name, name, env_pairs(given[name], flag_of[name])))
    if given.get("env_file") is not None:  # stored resolved (loaded by run, with the job's own when none is given)
        checks.append(("env_file", "env_file", str(Path(given["env_file"]).expanduser().resolve())))
    for name, field, value in checks:
        try:
            settings = settings.resumed({field: value})
        except ResumeConflictError as exc:  # named as the user typed it
            raise ResumeConflictError(flag_of[name], exc.stored, exc.given) from None
    options = _agent_kwargs(settings.agent, None, given.get("ak"), given.get("base_url"), given.get("api_key_name"))
    moved = {k: v for k, v in options.items() if k in ("api_base", "base_url", "model_api_key_name")}
    for key, value in options.items():
        if key not in moved and settings.agent_kwargs.get(key) != value:
            raise ResumeConflictError(f"--ak {key}", settings.agent_kwargs.get(key), value)
    settings.agent_kwargs = {**settings.agent_kwargs, **moved}  # where the agent's server is now
    return settings


def _settings(ctx: typer.Context, **values: Any) -> JobSettings:
    """A new job's settings, checked once (exit 2 naming the flag); an option not given keeps the setting's default."""
    try:
        return JobSettings(command="run", **{name: value for name, value in values.items() if value is not None})
    except SettingError as exc:
        field = exc.name.split(".")[0]
        option = next((o for o, f in _SETTING_OF.items() if f == field), field)
        flag = {param.name: param.opts[0] for param in ctx.command.params}.get(option, option)
        raise fail(f"{flag} must be {exc.requirement}, got {exc.value!r}") from None


def _resolve(settings: JobSettings):
    """The backend (resolved and loaded once, here) and the phase budgets of a job's settings."""
    spec = checked_backend(settings.environment_type, settings.environment_kwargs)
    checked_mounts(spec, settings)  # --mounts: host paths still there, on a backend that honours them
    return spec, settings.timeouts()


def _open_export(path: Path | None) -> IO[str] | None:
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("w", encoding="utf-8")
    except OSError as exc:
        raise fail(f"cannot write --json {path}: {exc.strerror or exc}") from None


def _on_cluster(todo, settings, concurrency, engine_kwargs, job, sink, interrupts: Interrupts, root: str, budget) -> None:
    """Shard the episodes over the Ray cluster: one engine per node, records appended here as they arrive."""
    from harbor_async.cluster.episodes import run_item, run_items
    from harbor_async.cluster.sharding import run_on_cluster_async

    async def main() -> None:
        await run_on_cluster_async(
            run_item, run_items(
                todo, settings.environment_type, settings.agent, root, model=_model(settings),
                agent_kwargs=settings.agent_kwargs, capture=settings.capture,
            ), sink=sink, budget=budget,
            stop=interrupts.arm, address=settings.ray_address, concurrency=concurrency, engine_kwargs=engine_kwargs,
        )  # fmt: skip
        interrupts.disarm()

    run_loop(main)


async def _batch(todo: list[PlannedEpisode], spec, agent, concurrency, engine_kwargs: dict[str, Any], sink, interrupts: Interrupts, root: str = "", model: str | None = None, budget=None) -> None:
    """Run the episodes on this process's engine; a signal cancels the batch (records of cancelled episodes kept)."""
    from harbor_async.episodes.runner import run_suite

    # run_suite's limiter is the batch's one concurrency limit (the engine gets none).
    async with Engine(**engine_kwargs) as engine:
        interrupts.leftovers = lambda: [s.id for s in engine.live_sandboxes()]
        await run_suite(
            engine, todo, spec, agent=agent, concurrency=concurrency, on_done=sink, model=model, budget=budget,
            task_path=lambda task: suite_task_path(task, root), stop=interrupts.arm,
        )  # fmt: skip
    interrupts.disarm()


def _server_url(settings: JobSettings) -> str:
    """The model server a Harbor agent's episodes call (its ``api_base``/``base_url``), else its model's name."""
    options = settings.agent_kwargs
    return str(options.get("api_base") or options.get("base_url") or _model(settings) or settings.agent)


def _agent_kwargs(agent: str, model: str | None, ak: list[str] | None, base_url: str | None = None, api_key_name: str | None = None) -> dict[str, Any]:
    """``--ak`` parsed as Harbor parses it, over ``--base-url``/``--api-key-name``, once ``-a`` names an agent that loads (else exit 2)."""
    from harbor_async.agents.harbor import endpoint_options
    from harbor_async.cli.agents import harbor_agent_class, parsed_agent_kwargs

    if agent in MODEL_FREE_AGENTS:
        if base_url or api_key_name:
            raise fail(f"--base-url and --api-key-name are a model agent's; -a {agent} uses no model")
        return parsed_agent_kwargs(ak)
    return {**endpoint_options(harbor_agent_class(agent), base_url, api_key_name), **parsed_agent_kwargs(ak)}


def _model(settings: JobSettings) -> str | None:
    """The agent's model (``-m``), the records' ``model``."""
    return settings.models[0] if settings.models else None


def _driver(settings: JobSettings):
    """``run``'s driver, with the Harbor agent it runs (checked against the backend and the tasks)."""
    from dataclasses import replace

    from harbor_async.cli.agents import harbor_agent_class

    if settings.agent in MODEL_FREE_AGENTS:
        return RUN
    return replace(RUN, agent=harbor_agent_class(settings.agent))


def _actor(settings: JobSettings):
    """What acts in each episode: a model-free agent's name, or a factory of a Harbor agent's episodes.

    The Harbor agent is built here once with its options (nothing started): bad options are one line, exit 2.
    """
    if settings.agent in MODEL_FREE_AGENTS:
        if settings.capture:
            raise fail(f"--capture records an agent's model calls: agent {settings.agent!r} calls no model")
        return settings.agent
    from functools import partial

    from harbor_async.agents.harbor import HarborAgentSpec
    from harbor_async.agents.harbor_episode import HarborAgentRunner
    from harbor_async.cli.agents import checked_capture, checked_spec

    spec = checked_spec(HarborAgentSpec(settings.agent, _model(settings), settings.agent_kwargs))
    if settings.capture:
        checked_capture(spec)
    return partial(HarborAgentRunner, spec, capture=settings.capture)


def _key(episode: PlannedEpisode, root: str, model: str | None = None) -> str:
    from harbor_async.core.records import episode_key

    return episode_key(suite_task_path(episode.task, root), episode.attempt, model)


def _summary(records: list[EpisodeRecord], planned: int, settings: JobSettings, *, interrupted: str | None) -> dict[str, Any]:
    k = settings.n_attempts or 1
    summary = summarize(records, k=k)
    summary["planned_episodes"] = planned
    summary["complete"] = interrupted is None and len(records) == planned and not any(r.rerun for r in records)
    summary["interrupted_by"] = interrupted
    if k == 1:
        summary["pass_at_k"] = {}
    return summary


def tasks(
    suite: SuiteArg = None,
    path: PathOpt = None,
    dataset: DatasetOpt = None,
    registry_url: RegistryUrlOpt = None,
    registry_path: RegistryPathOpt = None,
    n_tasks: NTasksOpt = None,
    num_tasks: OldNumTasksOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    indices: IndicesOpt = None,
    env: Annotated[str | None, typer.Option("--env", "-e", help="With 'local': mark the tasks whose FROM image the host's userland does not match.")] = None,
) -> None:
    """List a suite's valid tasks (as -p/-d/-i/-x/-l select them) and report the invalid ones."""
    setup_logging()
    loaded = load_tasks(
        suite_source(suite, path, dataset, registry_url, registry_path), n_tasks=n_tasks or num_tasks, indices=parse_indices(indices),
        include=include, exclude=exclude,
    )  # fmt: skip
    table = Table(title=Text(escape_controls(f"tasks in {loaded.root}")))
    table.add_column("#", justify="right")
    table.add_column("task", overflow="fold")
    table.add_column("path", overflow="fold")
    local = env == "local"
    if local:
        table.add_column("image on local", overflow="fold")
    for i, task in enumerate(loaded.tasks):
        cells: list[str | Text] = [str(i), Text(escape_controls(task.name)), Text(escape_controls(str(task.paths.task_dir)))]
        if local:
            mismatch = task_image_mismatch(task.paths.task_dir, task.config.environment.docker_image)
            cells.append(Text(escape_controls(mismatch or "ok")))
        table.add_row(*cells)
    out.print(table)
