"""``evaluate``: episodes of checkpoints on a suite, with the training harness, into a job folder.

For each model (one server at a time), every (task, attempt) runs
concurrently on the engine: the harness (a shim ``HarborEnv`` class, as in
training) is reset on the task, the :class:`~harbor_async.agent.Agent` loop
talks to the model and calls the harness's tools, and the task's verifier
scores the sandbox. Each episode's :class:`~harbor_async.records.EpisodeRecord`
(transcript, usage, finish reason, timings, failure class) is appended to the
job folder as it ends; ``resume`` runs only the missing episodes and those a
resume reruns (infrastructure, model-server, cancelled). The summary, and for
several models the sweep (table, paired differences, plot), come from
:mod:`harbor_async.scoring`.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio

from harbor_async import serve as _serve
from harbor_async.agent import Agent, AgentLimits, Sampling
from harbor_async.backends import resolve_backend
from harbor_async.checkpoints import ModelSpec, ServerGroup, resolve_models, server_groups
from harbor_async.errors import EvalConfigError, FailureClass, HarborAsyncError, Phase, SandboxError, failure_class
from harbor_async.jobs import JobFolder
from harbor_async.logs import get_logger
from harbor_async.records import EpisodeRecord, episode_key
from harbor_async.scoring import DEFAULT_SUCCESS_THRESHOLD, summarize, sweep_summary
from harbor_async.tasks import matches_names

log = get_logger("harbor_async.eval")


class EvalInterrupted(HarborAsyncError):
    """SIGINT or SIGTERM stopped the evaluation; its sandboxes and server were stopped, its records kept.

    Attributes:
        signum: the signal's number.
        job_dir: the job folder, to resume.
    """

    def __init__(self, signum: int, job_dir: Path) -> None:
        self.signum = signum
        self.job_dir = job_dir
        super().__init__(f"interrupted by {signal.Signals(signum).name}; resume with --resume {job_dir}")


@dataclass
class EvalSettings:
    """Everything an evaluation needs, stored as the job's ``config.json`` (so a resume repeats it)."""

    models: list[str]
    suite: str | None = None
    agent: str = "bash"
    backend: str = "local"
    attempts: int = 1
    concurrency: int = 8
    num_tasks: int | None = None
    indices: list[int] | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    base_url: str | None = None
    serve_cmd: str | None = None
    api_key_name: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    max_concurrent_requests: int = 32
    request_timeout: float = 600.0
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    episode_timeout: float | None = None
    ready_timeout: float = _serve.DEFAULT_READY_TIMEOUT
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    vllm_args: list[str] = field(default_factory=list)
    ray: bool = False
    ray_address: str | None = None
    budget: str = "local"
    max_live: int | None = None
    creates_per_second: float | None = None
    command: str = "eval"

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalSettings:
        """Read :meth:`to_dict`'s output (unknown keys ignored)."""
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


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
        self, settings: EvalSettings, job: JobFolder | None, on_record: Callable[[EpisodeRecord], None] | None
    ):
        self.settings = settings
        self.job = job
        self.on_record = on_record
        self.harness = resolve_harness(settings.agent, settings.backend)
        self.sandbox_limiter = anyio.CapacityLimiter(settings.concurrency)
        self.tool_limiter = anyio.CapacityLimiter(settings.concurrency)
        self.request_limiter = anyio.CapacityLimiter(settings.max_concurrent_requests)
        self.sampling = Sampling(**settings.sampling)
        self.limits = AgentLimits(**settings.limits)
        self.fatal: BaseException | None = None
        self.interrupted: int | None = None
        self.ran = 0

    def options(self):
        from shim.options import EngineOptions

        if self.settings.budget == "ray":  # one lease per sandbox from the cluster's budget actor
            return EngineOptions(
                max_live_sandboxes=None,
                episode_timeout=self.settings.episode_timeout,
                budget="ray",
                ray_address=self.settings.ray_address,
                cluster_max_live=self.settings.max_live,
                cluster_creates_per_second=self.settings.creates_per_second,
            )
        return EngineOptions(
            max_live_sandboxes=self.settings.concurrency, episode_timeout=self.settings.episode_timeout
        )

    def api_key(self) -> str:
        return _api_key(self.settings.api_key_name)

    async def run_group(self, group: ServerGroup, tasks: list[Any], root: Path, index: int, total: int) -> None:
        pending = set(self.job.pending(_keys(group.models, tasks, root, self.settings.attempts)))
        if not pending:
            return
        if group.command is None:
            await self._with_server(group, tasks, root, pending, self.settings.base_url, None)
            return
        port = _serve.free_port()
        log_name = "server.log" if total == 1 else f"server-{index}.log"
        server = _serve.ManagedServer(
            group.command(port), port, self.job.path / log_name, ready_timeout=self.settings.ready_timeout
        )
        async with server:
            await self._with_server(group, tasks, root, pending, server.base_url, server)

    async def _with_server(self, group, tasks, root, pending, base_url, server) -> None:
        import openai

        if group.check_names:
            listed = await _serve.served_models(base_url, api_key=self.api_key())
            _serve.check_models([s.name for s in group.models], listed, base_url)
        if self.settings.ray:
            await self._on_cluster(group, tasks, root, pending, base_url)
            return
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=self.api_key(), max_retries=0, timeout=self.settings.request_timeout
        )
        try:
            async with anyio.create_task_group() as tg:
                for spec in group.models:
                    agent = Agent(
                        client,
                        spec.name,
                        sampling=self.sampling,
                        limits=self.limits,
                        request_limiter=self.request_limiter,
                        tool_limiter=self.tool_limiter,
                    )
                    for task in tasks:
                        for attempt in range(self.settings.attempts):
                            if episode_key(_task_path(task, root), attempt, spec.name) in pending:
                                tg.start_soon(self._episode, tg.cancel_scope, agent, spec, task, root, attempt, server)
        finally:
            with anyio.CancelScope(shield=True):
                await client.close()
        if self.fatal is not None:
            raise self.fatal

    async def _on_cluster(self, group: ServerGroup, tasks, root: Path, pending: set[str], base_url: str) -> None:
        """Shard the group's pending episodes over the Ray cluster; records come back into the job folder."""
        from harbor_async.cluster.eval_items import eval_item, eval_items
        from harbor_async.cluster.sharding import run_on_cluster

        items = eval_items(self.settings.to_dict(), group.models, base_url, tasks, root, pending)

        def record(done: EpisodeRecord) -> None:
            self.ran += 1
            if self.on_record is not None:
                self.on_record(done)

        await anyio.to_thread.run_sync(
            functools.partial(
                run_on_cluster, eval_item, items, job=self.job, address=self.settings.ray_address,
                concurrency=self.settings.concurrency, on_record=record,
            )  # fmt: skip
        )

    async def _episode(self, scope, agent: Agent, spec: ModelSpec, task, root: Path, attempt: int, server) -> None:
        async with self.sandbox_limiter:
            record = await self.run_episode(agent, spec, task, root, attempt)
        if record.failure is FailureClass.MODEL_SERVER and server is not None and not server.alive:
            # The server is gone: every other episode would fail the same way.
            try:
                server.check_alive()
            except _serve.ServerDiedError as exc:
                self.fatal = exc
            scope.cancel()
            return
        self.job.append(record)
        self.ran += 1
        if self.on_record is not None:
            self.on_record(record)

    async def run_episode(self, agent: Agent, spec: ModelSpec, task, root: Path, attempt: int) -> EpisodeRecord:
        from shim import engines
        from shim.env import _await_loop

        record = EpisodeRecord(
            task=task.name,
            task_path=_task_path(task, root),
            attempt=attempt,
            agent=self.settings.agent,
            model=spec.name,
            checkpoint=spec.checkpoint,
            started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        began = time.perf_counter()
        env = episode = None
        try:
            env = await anyio.to_thread.run_sync(self._make_env)
            reset_at = time.monotonic()  # the engine's episode deadline counts from the reset
            observation = await anyio.to_thread.run_sync(env.reset, str(task.task_dir))
            episode = env._episode
            await _await_loop(engines.submit(episode.wait_ready))
            if episode.error is not None:
                record.set_error(FailureClass.INFRASTRUCTURE, episode.error, Phase.START.value)
                return record
            record.sandbox = episode.sandbox.id
            timeout = self.limits.timeout if self.limits.timeout is not None else task.config.agent.timeout_sec
            deadline_left = None
            if self.settings.episode_timeout is not None:
                deadline_left = self.settings.episode_timeout - (time.monotonic() - reset_at)
            by_deadline = deadline_left is not None and (timeout is None or deadline_left < timeout)
            sampling = self.sampling
            if sampling.seed is not None:  # attempts of one task must differ, or pass@k is pass@1
                sampling = replace(sampling, seed=sampling.seed + attempt)
            result = await agent.run(
                env, observation, timeout=deadline_left if by_deadline else timeout, sampling=sampling
            )
            if result.finish_reason == "agent_timeout" and by_deadline:
                result.finish_reason = "episode_deadline"
            record.transcript = result.messages
            record.usage = {**result.usage, "tool_calls": result.tool_calls, "tool_failures": result.tool_failures}
            record.finish_reason = result.finish_reason
            record.seconds.update(model=round(result.model_seconds, 4), tools=round(result.tool_seconds, 4))
            if result.error is not None:
                record.set_error(FailureClass.MODEL_SERVER, result.error, "model")
                return record
            if episode.exec_errors:  # the model saw "could not be run": not a fair episode to score
                record.set_error(FailureClass.INFRASTRUCTURE, episode.exec_errors[0])
                return record
            if result.finish_reason == "agent_timeout":
                record.set_error(FailureClass.AGENT, f"the agent ran past its {timeout:g} s budget", Phase.AGENT.value)
            elif result.finish_reason == "episode_deadline":
                message = f"the episode reached its {self.settings.episode_timeout:g} s deadline"
                record.set_error(FailureClass.AGENT, message, Phase.AGENT.value)
            await self._verify(record, episode)
        except SandboxError as exc:
            record.set_error(FailureClass.INFRASTRUCTURE, exc)
        except HarborAsyncError as exc:  # a harness that cannot be built or reset on this task
            record.set_error(FailureClass.INFRASTRUCTURE, exc, "start")
        except Exception as exc:  # a bug or an unexpected library error: record it, keep the run going
            log.exception("episode crashed", task=task.name, model=spec.name)
            record.set_error(FailureClass.INFRASTRUCTURE, exc)
        finally:
            if env is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(env._close)
            _copy_times(record, episode)
            record.seconds["total"] = round(time.perf_counter() - began, 4)
        return record

    async def _verify(self, record: EpisodeRecord, episode) -> None:
        from shim import engines
        from shim.env import _await_loop

        try:
            verdict = await _await_loop(engines.submit(episode.sandbox.verify))
        except SandboxError as exc:
            failure = failure_class(exc)
            record.set_error(failure, exc)
            record.verifier_output = getattr(exc, "output", None)
            record.reward = None if failure.rerun else 0.0
            return
        episode.reward = verdict.reward  # the shim must not verify again
        record.verifier_output = verdict.output
        if record.failure is None or record.failure.scored:
            record.reward, record.rewards = verdict.reward, dict(verdict.rewards)

    def _make_env(self):
        env = self.harness(environment_type=self.settings.backend)
        env._configure(self.options(), self.settings.backend_kwargs)
        return env


def _api_key(name: str | None) -> str:
    """The key in the environment variable ``name`` (Harbor's ``--api-key-name``); never stored in the job."""
    if name is None:
        return "EMPTY"  # local servers ignore it; the client wants one
    value = os.environ.get(name)
    if not value:
        raise EvalConfigError(f"--api-key-name {name}: the environment variable {name} is not set")
    return value


def resolve_harness(agent: str, backend: str) -> type:
    """The harness class for ``-a`` (checked: it loads and its tools have schemas) and the backend.

    Raises :class:`EvalConfigError` (or the backend's :class:`~harbor_async.errors.BackendError`).
    """
    import shim.harnesses  # noqa: F401 - registers "python" and "terminal"
    from harbor_async.agent import build_toolset
    from shim import spec as _spec

    resolve_backend(backend).environment_class()
    try:
        harness = _spec._resolve_agent(agent)
    except (ValueError, TypeError, ImportError, AttributeError, OSError) as exc:
        raise EvalConfigError(f"harness {agent!r}: {exc}") from exc
    build_toolset(harness(environment_type=backend))  # no sandbox: only the schemas
    return harness


def _copy_times(record: EpisodeRecord, episode) -> None:
    sandbox = getattr(episode, "sandbox", None)
    if sandbox is not None:
        record.start_attempts = sandbox.start_attempts
        record.seconds.update({k: round(v, 4) for k, v in sandbox.times.seconds.items()})


def _task_path(task, root: Path) -> str:
    """The task's path relative to the suite root: stable across machines and caches."""
    try:
        return str(Path(task.task_dir).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(task.task_dir)


def _keys(models: Sequence[ModelSpec], tasks: Sequence[Any], root: Path, attempts: int) -> list[str]:
    return [episode_key(_task_path(t, root), a, m.name) for m in models for t in tasks for a in range(attempts)]


def _summaries(
    settings: EvalSettings, specs: list[ModelSpec], job: JobFolder, keys: list[str]
) -> tuple[dict[str, Any], list[EpisodeRecord]]:
    # Suite order, not completion order: the same records give the same summary however they ran.
    done = job.latest()
    latest = [done[k] for k in keys if k in done]
    by_model = {s.name: [r for r in latest if r.model == s.name] for s in specs}
    k, threshold = settings.attempts, settings.success_threshold
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
    from harbor_async.plots import plot_sweep, sweep_csv

    (job.path / "sweep.csv").write_text(sweep_csv(sweep), encoding="utf-8")
    try:
        plot_sweep(sweep, job.path / "sweep.png")
    except ImportError:  # matplotlib is the `eval` extra; the table and summary stand without the plot
        log.warning("sweep plot skipped: matplotlib is not installed (pip install 'harbor-async[eval]')")


async def evaluate(
    models: Sequence[str] | str | None = None,
    suite: str | None = None,
    *,
    resume: str | os.PathLike[str] | None = None,
    jobs_dir: str | os.PathLike[str] = "jobs",
    job_name: str | None = None,
    on_record: Callable[[EpisodeRecord], None] | None = None,
    on_plan: Callable[[int, int], None] | None = None,
    **settings: Any,
) -> EvalResult:
    """Evaluate ``models`` on ``suite`` with a training harness; write and return the job.

    Args:
        models: model names on ``base_url``, checkpoint folders for a managed
            server, or globs of them (``ckpts/checkpoint-*``).
        suite: a local task tree or a Hugging Face dataset id (default: the bundled example suite).
        resume: an existing job folder: its ``config.json`` is reused (server
            settings given here override it); only missing episodes and those
            whose failure a resume reruns are run.
        jobs_dir, job_name: where a new job folder goes (``jobs_dir/job_name``).
        on_record: called with each record as it is written (the CLI's progress bar).
        on_plan: called once with (episodes to run now, episodes of the job).
        **settings: the fields of :class:`EvalSettings` (``agent``, ``backend``,
            ``attempts``, ``concurrency``, ``base_url``, ``serve_cmd``,
            ``api_key_name``, ``sampling``, ``limits``, ...).

    Raises:
        EvalConfigError, harbor_async.serve.ServeError, harbor_async.tasks.EmptySuiteError,
        harbor_async.jobs.JobFolderError: bad input, found before any sandbox starts
        (except a managed server dying mid-run: :class:`~harbor_async.serve.ServerDiedError`).
    """
    from harbor_async.tasks import load_suite

    if resume is not None:
        job = JobFolder.open(resume)
        stored = EvalSettings.from_dict(job.config)
        overrides = {k: v for k, v in settings.items() if k in ("base_url", "serve_cmd", "api_key_name") and v}
        config = EvalSettings.from_dict({**stored.to_dict(), **overrides})
    else:
        if models is None:
            raise EvalConfigError("no model to evaluate: pass at least one model")
        config = EvalSettings(models=[models] if isinstance(models, str) else list(models), suite=suite, **settings)
    if config.base_url and config.serve_cmd:
        raise EvalConfigError("give --base-url or --serve-cmd, not both")
    if config.attempts < 1 or config.concurrency < 1 or config.max_concurrent_requests < 1:
        raise EvalConfigError("attempts, concurrency and max concurrent requests must be at least 1")
    specs = resolve_models(config.models)
    config.models = [s.name for s in specs]
    filtered = bool(config.include or config.exclude)  # globs first, then the first N (as harbor run)
    loaded = load_suite(config.suite, num_tasks=None if filtered else config.num_tasks, indices=config.indices)
    if filtered:
        kept = [t for t in loaded.tasks if matches_names(t.name, config.include, config.exclude)]
        if not kept:
            raise EvalConfigError(f"no task of {loaded.root} matches the -i/-x globs")
        loaded.tasks = kept[: config.num_tasks] if config.num_tasks is not None else kept
    groups = server_groups(specs, base_url=config.base_url, serve_cmd=config.serve_cmd, vllm_args=config.vllm_args)
    resolve_harness(config.agent, config.backend)
    resolve_backend(config.backend).check_options(config.backend_kwargs)  # before any server or job folder
    _api_key(config.api_key_name)  # a missing key is bad input: fail before the job folder
    if resume is None:
        job = JobFolder.create(jobs_dir, job_name, config.to_dict())
    run = _Run(config, job, on_record)
    tasks, root = list(loaded.tasks), Path(loaded.root)
    all_keys = _keys(specs, tasks, root, config.attempts)
    if on_plan is not None:
        on_plan(len(job.pending(all_keys)), len(all_keys))
    error: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            if threading.current_thread() is threading.main_thread():
                tg.start_soon(_watch_signals, tg.cancel_scope, run)
            try:
                for index, group in enumerate(groups):  # one server at a time
                    await run.run_group(group, tasks, root, index, len(groups))
            except Exception as exc:  # raised below, unwrapped from the task group
                error = exc
            finally:
                tg.cancel_scope.cancel()
    finally:
        job.close()
        summary, latest = _summaries(config, specs, job, all_keys)
        job.write_summary(summary)
        if "sweep" in summary:
            _write_sweep(job, summary["sweep"])
    if error is not None:
        raise error
    if run.interrupted is not None:
        raise EvalInterrupted(run.interrupted, job.path)
    return EvalResult(job.path, summary, latest, ran=run.ran)


async def _watch_signals(scope: anyio.CancelScope, run: _Run) -> None:
    """Turn SIGINT/SIGTERM into a cancellation, so that every episode stops its sandbox and the server stops."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            run.interrupted = int(signum)
            scope.cancel()
            return


def evaluate_sync(*args: Any, **kwargs: Any) -> EvalResult:
    """:func:`evaluate` for synchronous callers (runs its own event loop)."""
    return anyio.run(functools.partial(evaluate, *args, **kwargs))
