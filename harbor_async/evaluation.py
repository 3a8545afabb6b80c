"""``evaluate``: episodes of checkpoints on a suite, with the training harness, into a job folder.

For each model (one server at a time), every (task, attempt) runs
concurrently through the one episode runner (:func:`harbor_async.episodes.runner.run_episode`)
on this evaluation's engine: the harness (the one used in training) is prepared
on the new sandbox, the :class:`~harbor_async.agents.tool_loop.ToolLoop` talks to the
model and calls the harness's tools (:class:`~harbor_async.agents.harness_agent.HarnessAgent`),
and the task's verifier scores the sandbox. Each episode's :class:`~harbor_async.core.records.EpisodeRecord`
(transcript, usage, finish reason, timings, failure class) is appended to the
job folder as it ends; ``resume`` runs only the missing episodes and those a
resume reruns (infrastructure, model-server, cancelled). The summary, and for
several models the sweep (table, paired differences, plot), come from
:mod:`harbor_async.jobs.scoring`.
"""

from __future__ import annotations

import functools
import os
import re
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack, cast

import anyio

from harbor_async.agents.harbor import HarborAgentSpec, probe_model_server
from harbor_async.agents.harness_agent import (
    api_key,
    check_harbor_options,
    eval_driver,
    eval_episode_agent,
    harbor_agent_at,
    resolve_eval_agent,
    resolve_harness,
)
from harbor_async.agents.task_checks import Refusal, check_tasks, refused_summary
from harbor_async.agents.tool_loop import ToolLoop
from harbor_async.backends import BackendSpec, resolve_backend
from harbor_async.core.errors import (
    BackendError,
    EvalConfigError,
    FailureClass,
    HarborAsyncError,
    ModelServerDownError,
    ModelServerRefusedError,
    SettingError,
)
from harbor_async.core.interrupts import Interrupts
from harbor_async.core.logs import get_logger
from harbor_async.core.records import EpisodeRecord, episode_key
from harbor_async.engine.loop import run_loop
from harbor_async.episodes.runner import FailureBudget, PlannedEpisode, run_suite
from harbor_async.jobs.folder import JobFolder
from harbor_async.jobs.scoring import summarize, sweep_summary
from harbor_async.jobs.settings import EvaluateSettings, JobSettings
from harbor_async.models import serve as _serve
from harbor_async.models.checkpoints import (
    ModelSpec,
    ServerGroup,
    resolve_models,
    server_groups,
    step_pattern,
)
from harbor_async.tasks.suite import suite_task_path
from harbor_async.verification.disk_bounds import JobDiskLimitError

if TYPE_CHECKING:
    from harbor_async.engine.engine import Engine

log = get_logger("harbor_async.eval")


class EvalInterrupted(HarborAsyncError):
    """SIGINT, SIGTERM or SIGHUP stopped the evaluation; its sandboxes and server were stopped, its records kept.

    Attributes:
        signum: the signal's number.
        job_dir: the job folder, to resume.
    """

    def __init__(self, signum: int, job_dir: Path) -> None:
        self.signum = signum
        self.job_dir = job_dir
        super().__init__(f"interrupted by {signal.Signals(signum).name}; resume with --resume {job_dir}")


@dataclass
class EvalResult:
    """What :func:`evaluate` returns: the job folder, its summary and the latest record of each episode."""

    job_dir: Path
    summary: dict[str, Any]
    records: list[EpisodeRecord]
    ran: int = 0


class _Run:
    """The state of one evaluation run (one job folder)."""

    def __init__(
        self,
        settings: JobSettings,
        job: JobFolder,
        on_record: Callable[[EpisodeRecord], None] | None,
        on_status: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.job = job
        self.on_record = on_record
        self.on_status = on_status
        self.harbor = resolve_eval_agent(settings)  # one of Harbor's agents, else a tool harness
        self.harness = None if self.harbor is not None else resolve_harness(settings.agent, settings.environment_type)
        self.backend: BackendSpec = resolve_backend(settings.environment_type)
        self.engine: Engine | None = None
        self.tool_limiter = anyio.CapacityLimiter(settings.n_concurrent)
        self.request_limiter = anyio.CapacityLimiter(settings.max_concurrent_requests)
        self.fatal: BaseException | None = None
        self.interrupted: int | None = None
        self.ran = 0
        self.arm: Callable[[Callable[[], None]], None] = lambda cancel: None  # the interrupt policy's (see evaluate)

    def api_key(self) -> str:
        return api_key(self.settings.api_key_name)

    async def run_group(self, group: ServerGroup, tasks: list[Any], root: Path, index: int, total: int) -> None:
        pending = set(self.job.pending(_keys(group.models, tasks, root, self.settings.n_attempts)))
        if not pending:
            return
        if group.command is None:
            await self._with_server(group, tasks, root, pending, self.settings.base_url, None)
            return
        port = _serve.free_port()
        log_name = "server.log" if total == 1 else f"server-{index}.log"
        server = _serve.ManagedServer(
            group.command(port), port, self.job.path / log_name, ready_timeout=self.settings.ready_timeout,
            error_timeout=self.settings.ready_error_timeout, on_status=self.on_status,
        )  # fmt: skip
        async with server:
            await self._with_server(group, tasks, root, pending, server.base_url, server)

    async def _with_server(self, group, tasks, root, pending, base_url, server) -> None:
        import openai

        if group.check_names:
            listed = await _serve.served_models(base_url, api_key=self.api_key())
            await _serve.check_models([s.name for s in group.models], listed, base_url, api_key=self.api_key())
        budget = FailureBudget(self.settings.max_model_server_failures, base_url, self.job.path)
        for spec in group.models if self.harbor is not None else ():  # where each model's agent calls: it answers
            harbor = cast(HarborAgentSpec, self.harbor)  # set: the loop runs only then
            await probe_model_server(harbor_agent_at(harbor, self.settings, spec.name, base_url))  # --ak api_base wins
        if self.settings.ray:
            await self._on_cluster(group, tasks, root, pending, base_url, budget)
        else:
            async with openai.AsyncOpenAI(
                base_url=base_url, api_key=self.api_key(), max_retries=0, timeout=self.settings.request_timeout
            ) as client:  # fmt: skip
                await self._locally(group, tasks, root, pending, base_url, server, client, budget)
        if self.fatal is None:
            self.fatal = budget.error
        if self.fatal is not None:
            raise self.fatal

    async def _locally(self, group, tasks, root, pending, base_url, server, client, budget: FailureBudget) -> None:
        """The group's pending episodes on this evaluation's engine, through the one orchestration of ``run`` and ``eval``."""
        assert self.engine is not None
        planned: list[PlannedEpisode] = []
        for spec in group.models:
            agent: ToolLoop | Any = ToolLoop(
                client, spec.name, sampling=self.settings.sampling, limits=self.settings.limits,
                request_limiter=self.request_limiter, tool_limiter=self.tool_limiter,
            )  # fmt: skip
            if self.harbor is not None:  # a Harbor agent talks to the server with its own client
                agent = harbor_agent_at(self.harbor, self.settings, spec.name, base_url)
            for task in tasks:
                path = suite_task_path(task, root)
                for attempt in range(self.settings.n_attempts):
                    if episode_key(path, attempt, spec.name) in pending:
                        actor = eval_episode_agent(self.settings, agent, self.harness, attempt)
                        planned.append(PlannedEpisode(task, attempt, spec.name, spec.checkpoint, actor, path))
        cancel_batch: list[Any] = []

        def record(done: EpisodeRecord) -> None:
            self._record(done)
            if done.failure is FailureClass.MODEL_SERVER and server is not None and not server.alive and self.fatal is None:
                try:  # the managed server is gone: every other episode would fail the same way
                    server.check_alive()
                except _serve.ServerDiedError as exc:
                    self.fatal = exc
                    cancel_batch[0]()

        await run_suite(
            self.engine, planned, self.backend, concurrency=self.settings.n_concurrent, on_done=record, budget=budget,
            stop=cancel_batch.append,
        )  # fmt: skip

    def _record(self, done: EpisodeRecord) -> None:
        """One episode's record, from its own ``finally``: into the job folder, then to the caller."""
        self.job.append(done)
        self.ran += 1
        if self.on_record is not None:
            self.on_record(done)

    async def _on_cluster(self, group: ServerGroup, tasks, root: Path, pending: set[str], base_url: str, budget: FailureBudget) -> None:
        """Shard the group's pending episodes over the Ray cluster; records come back into the job folder."""
        from harbor_async.cluster.eval_items import eval_item, eval_items
        from harbor_async.cluster.ray_budget import job_budget
        from harbor_async.cluster.sharding import run_on_cluster_async

        items = eval_items(self.settings, group.models, base_url, tasks, root, pending)
        name = self.settings.api_key_name  # read here, as a local eval reads it; the workers' environment may lack it
        await run_on_cluster_async(
            eval_item, items, sink=self._record, budget=budget, stop=self.arm, address=self.settings.ray_address,
            concurrency=self.settings.n_concurrent, engine_kwargs=self.settings.engine_kwargs(job_budget(self.settings), self.job.path),
            env_vars={name: self.api_key()} if name else None,
        )  # fmt: skip


def _discard_empty_job(folder: Path) -> None:
    """Remove a new job folder that holds nothing (no episode ran; no server log beyond its command line)."""
    import shutil

    for log_file in folder.glob("server*.log"):
        if len(log_file.read_text(errors="replace").splitlines()) > 1:
            return  # the server said something: the error names this log
    shutil.rmtree(folder, ignore_errors=True)


def _keys(models: Sequence[ModelSpec], tasks: Sequence[Any], root: Path, attempts: int) -> list[str]:
    return [episode_key(suite_task_path(t, root), a, m.name) for m in models for t in tasks for a in range(attempts)]


def _summaries(
    settings: JobSettings, specs: list[ModelSpec], job: JobFolder, keys: list[str]
) -> tuple[dict[str, Any], list[EpisodeRecord]]:
    # Suite order, not completion order: the same records give the same summary however they ran.
    done = job.latest()
    latest = [done[k] for k in keys if k in done]
    by_model = {s.name: [r for r in latest if r.model == s.name] for s in specs}
    k, threshold = settings.n_attempts, settings.success_threshold
    summary: dict[str, Any] = {}
    if len(specs) == 1:
        summary.update(summarize(by_model[specs[0].name], k=k, success_threshold=threshold))
    summary["models"] = {
        s.name: {
            "checkpoint": s.checkpoint,
            "step": s.step,
            **summarize(by_model[s.name], k=k, success_threshold=threshold),
        }
        for s in specs
    }
    if len(specs) > 1:
        summary["sweep"] = sweep_summary(
            [(s.name, s.step, by_model[s.name]) for s in specs], k=k, success_threshold=threshold
        )
    return summary, latest


def _write_sweep(job: JobFolder, sweep: dict[str, Any]) -> None:
    from harbor_async.jobs.plots import plot_sweep, sweep_csv

    (job.path / "sweep.csv").write_text(sweep_csv(sweep), encoding="utf-8")
    try:
        plot_sweep(sweep, job.path / "sweep.png")
    except ImportError:  # matplotlib is the `eval` extra; the table and summary stand without the plot
        log.warning("sweep plot skipped: matplotlib is not installed (pip install 'harbor-async[eval]')")


async def evaluate(
    models: Sequence[str] | str | None = None,
    suite: str | Sequence[str] | None = None,
    *,
    resume: str | os.PathLike[str] | None = None,
    jobs_dir: str | os.PathLike[str] = "jobs",
    job_name: str | None = None,
    on_record: Callable[[EpisodeRecord], None] | None = None,
    on_plan: Callable[[int, int], None] | None = None,
    on_status: Callable[[str], None] | None = None,
    on_refused: Callable[[list[Refusal]], None] | None = None,
    **settings: Unpack[EvaluateSettings],
) -> EvalResult:
    """Evaluate ``models`` on ``suite`` with a training harness; write and return the job.

    Args:
        models: model names on ``base_url``, checkpoint folders for a managed
            server, or globs of them (``ckpts/checkpoint-*``).
        suite: a local task tree, a Hugging Face dataset id, or task folders (a registry dataset
            resolved by :func:`harbor_async.tasks.registry.resolve_dataset`); default: the bundled example suite.
        resume: an existing job folder: its stored settings are used whole; a
            setting given here must equal the stored one
            (:class:`~harbor_async.core.errors.ResumeConflictError` otherwise), except
            where the server is now (``base_url``, ``serve_cmd``, ``api_key_name``),
            which replaces it. Only missing episodes and those whose failure a
            resume reruns are run.
        jobs_dir, job_name: where a new job folder goes (``jobs_dir/job_name``).
        on_record: called with each record as it is written (the CLI's progress bar).
        on_plan: called once with (episodes to run now, episodes of the job).
        on_status: called with what a managed server answers while it is awaited (the CLI's progress line).
        on_refused: called once, before anything starts, with the feature refusals of the tasks left out
            (a task the backend cannot honour is refused alone; the rest runs; ``summary["refused"]``).
        **settings: the fields of :class:`~harbor_async.jobs.settings.JobSettings` (``agent``,
            ``environment_type``, ``environment_kwargs``, ``n_attempts``, ``n_concurrent``,
            ``base_url``, ``serve_cmd``, ``api_key_name``, ``sampling``, ``limits``, ``slot_timeout``,
            ``start_attempts``, ...; ``sampling`` and ``limits`` as their models or dicts of them);
            the names of earlier releases (``backend``, ``attempts``, ...) still work, with a
            ``DeprecationWarning``.

    Raises:
        EvalConfigError, harbor_async.models.serve.ServeError, harbor_async.tasks.suite.EmptySuiteError,
        harbor_async.jobs.folder.JobFolderError: bad input, found before any sandbox starts; a
        setting that is none (:class:`~harbor_async.core.errors.UnknownSettingError`), of the wrong
        type or out of its range (:class:`~harbor_async.core.errors.SettingError`), or that differs
        from the resumed job's (:class:`~harbor_async.core.errors.ResumeConflictError`) among them
        (except a managed server dying mid-run: :class:`~harbor_async.models.serve.ServerDiedError`).
    """
    from harbor_async.tasks.suite import load_suite

    if resume is not None:
        job = JobFolder.open(resume)
        given = dict(settings)
        if models is not None:  # as stored: globs and checkpoint folders resolved to the models' names
            named = [models] if isinstance(models, str) else list(models)
            given["models"] = [s.name for s in resolve_models(named, _step_from(settings.get("step_from")))]
        if suite is not None:
            given["suite"] = suite
        config = JobSettings.from_dict(job.config).resumed(given)  # the job whole; only where its server is now may change
    else:
        if models is None:
            raise EvalConfigError("no model to evaluate: pass at least one model")
        settings.setdefault("agent", "bash")
        config = JobSettings.from_kwargs(
            command="eval", models=[models] if isinstance(models, str) else list(models), suite=suite, **settings
        )
    if config.base_url and config.serve_cmd:
        raise EvalConfigError("give --base-url or --serve-cmd, not both")
    specs = resolve_models(config.models, _step_from(config.step_from))
    config.models = [s.name for s in specs]
    loaded = load_suite(
        config.suite, num_tasks=config.n_tasks, indices=config.indices, include=config.include, exclude=config.exclude
    )
    timeouts = config.timeouts()
    for task in loaded.tasks:  # checked before any server or sandbox: every budget finite
        try:
            timeouts.for_task(task)
        except SettingError as exc:
            raise EvalConfigError(f"task {task.name}: {exc}") from None
    groups = server_groups(specs, base_url=config.base_url, serve_cmd=config.serve_cmd, vllm_args=config.vllm_args)
    harbor = resolve_eval_agent(config)  # a Harbor agent, else a tool harness (checked)
    backend = resolve_backend(config.environment_type)
    backend.check_options(config.environment_kwargs)  # before any server or job folder
    # every ${VAR} allowed (else a table, exit 2); a task the backend cannot honour is refused alone (all: exit 2)
    refused = check_tasks(
        loaded.tasks, backend, driver=eval_driver(harbor), env_allow=config.env_allow,
        backend_kwargs=config.environment_kwargs, alone=True, overrides=config.task_overrides(),
    )  # fmt: skip
    tasks = [task for task in loaded.tasks if task.name not in {r.task for r in refused}]
    if refused and on_refused is not None:
        on_refused(refused)
    if harbor is not None:  # built once with its options (nothing started): bad --ak fails now
        check_harbor_options(harbor, config, specs[0].name)
    try:
        backend.check_installed(tasks[0], config.environment_kwargs)
    except BackendError as exc:
        raise EvalConfigError(str(exc)) from exc
    api_key(config.api_key_name)  # a missing key is bad input: fail before the job folder
    if resume is None:
        job = JobFolder.create(jobs_dir, job_name, config.to_dict())
    run = _Run(config, job, on_record, on_status)
    root = Path(loaded.root)
    all_keys = _keys(specs, tasks, root, config.n_attempts)
    job.keep_harbor_layout(config, backend, len(all_keys), root)  # harbor view, harbor job regrade read the job
    if on_plan is not None:
        on_plan(len(job.pending(all_keys)), len(all_keys))
    error: Exception | None = None
    try:
        with Interrupts() as interrupts, anyio.CancelScope() as scope:
            interrupts.arm(scope.cancel)
            # The cluster's driver loop runs in a thread: a signal also stops its dispatch (it then drains).
            run.arm = lambda stop: interrupts.arm(lambda: (stop(), scope.cancel()))  # type: ignore[arg-type,func-returns-value]  # two calls in one lambda
            try:
                if config.ray:  # the cluster's nodes run the episodes on their own engines
                    error = await _run_groups(run, groups, tasks, root)
                else:
                    from harbor_async.cluster.ray_budget import job_budget
                    from harbor_async.engine.engine import Engine

                    async with Engine(**config.engine_kwargs(job_budget(config), job.path)) as run.engine:
                        interrupts.leftovers = lambda: [s.id for s in cast(Engine, run.engine).live_sandboxes()]  # set just above
                        error = await _run_groups(run, groups, tasks, root)
            finally:
                interrupts.disarm()
        run.interrupted = interrupts.signum
    finally:
        job.close()
        summary, latest = _summaries(config, specs, job, all_keys)
        summary["planned_episodes"] = len(all_keys)
        summary["complete"] = len(latest) == len(all_keys) and not any(r.rerun for r in latest)
        if refused:
            summary["refused"] = refused_summary(refused)
        if run.interrupted is not None:
            summary["interrupted_by"] = signal.Signals(run.interrupted).name
        if isinstance(error, ModelServerRefusedError):
            summary["stopped_by"] = "the model server refused the run's requests (a wrong key, model or URL)"
        elif isinstance(error, ModelServerDownError):
            summary["stopped_by"] = f"the model server failed {error.failures} episodes in a row"
        elif isinstance(error, JobDiskLimitError):
            summary["stopped_by"] = str(error)
        job.write_summary(summary)
        if "sweep" in summary:
            _write_sweep(job, summary["sweep"])
    if error is not None:
        if resume is None and not latest and str(job.path) not in str(error):  # an error naming a file keeps it
            _discard_empty_job(job.path)
        raise error
    if run.interrupted is not None:
        raise EvalInterrupted(run.interrupted, job.path)
    return EvalResult(job.path, summary, latest, ran=run.ran)


async def _run_groups(run: _Run, groups: list[ServerGroup], tasks: list[Any], root: Path) -> Exception | None:
    """Run every group, one server at a time; return the error that stopped them (raised after the summary)."""
    try:
        for index, group in enumerate(groups):
            await run.run_group(group, tasks, root, index, len(groups))
    except Exception as exc:  # noqa: BLE001 - handed back, not lost: the engine's task group would wrap it
        return exc
    return None


def _step_from(text: str | None) -> re.Pattern[str] | None:
    """``--step-from``'s pattern, checked (:class:`~harbor_async.core.errors.EvalConfigError` if it is not one)."""
    return None if text is None else step_pattern(text)


def _synchronous[**P, T](function: Callable[P, Awaitable[T]]) -> Callable[P, T]:
    """``function`` run to its end in an event loop of its own, with ``function``'s typed parameters."""

    @functools.wraps(function)  # its signature, for help() and completion
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return run_loop(functools.partial(function, *args, **kwargs))

    return run


evaluate_sync = _synchronous(evaluate)
evaluate_sync.__name__ = evaluate_sync.__qualname__ = "evaluate_sync"
evaluate_sync.__doc__ = ":func:`evaluate` for synchronous callers (runs its own event loop); the same parameters."
