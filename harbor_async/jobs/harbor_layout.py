"""Harbor's job layout beside ours, written with Harbor's own models, so Harbor's tools read our jobs.

Next to ``harbor-async.json``, ``episodes.jsonl`` and ``summary.json`` a job folder holds:

- ``config.json``: Harbor's ``JobConfig`` (the agents, models, dataset and environment);
- ``result.json``: Harbor's ``JobResult``, rewritten as each episode ends: the
  stats of each eval (Harbor's ``agent__model__dataset`` key: a sweep is one
  job with one eval per model), and at the end its metrics (mean) and pass@k;
- one trial folder per episode, ``<task>__<id>/``: ``config.json``
  (``TrialConfig``), ``lock.json`` (Harbor's resolved inputs), ``result.json``
  (``TrialResult`` with its timings, rewards, token usage and exception, named
  as Harbor names it: a verifier that left no reward has no ``verifier_result``
  and ``RewardFileNotFoundError``, while ``episodes.jsonl`` keeps our class and
  its 0), ``trial.log``, ``exception.txt``, ``agent/`` (the agent's logs;
  a harness's transcript as an ATIF ``trajectory.json``), ``verifier/`` (the
  reward file and the test script's stdout and stderr) and ``artifacts/`` (with
  Harbor's ``manifest.json``).

So ``harbor view``, ``harbor job regrade`` and the rest of Harbor's tooling work
on a ``run`` or ``eval`` job. The record names its trial folder (``trial``); a
resume that reruns an episode replaces its trial folder, as Harbor's resume does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from harbor_async.core.logs import get_logger
from harbor_async.core.records import EpisodeRecord
from harbor_async.tasks.registry import HF_PREFIXES

if TYPE_CHECKING:
    from harbor.models.job.result import JobResult
    from harbor.models.trial.result import TrialResult

log = get_logger()

CONFIG_NAME = "config.json"
RESULT_NAME = "result.json"
LOCK_NAME = "lock.json"
LOG_NAME = "trial.log"
#: Harbor's verifier exceptions, found in the text of our verifier failures (raised by Harbor's own Verifier).
HARBOR_VERIFIER_ERRORS = (
    "RewardFileNotFoundError", "RewardFileEmptyError", "VerifierOutputParseError", "AddTestsDirError",
    "DownloadVerifierDirError",
)  # fmt: skip
#: Exception types of a trial whose verifier ran and gave no reward: scored 0, judged (Harbor's names and ours).
VERIFIER_FAILURES = frozenset({
    *HARBOR_VERIFIER_ERRORS, "VerifierTimeoutError", "VerifierFailure", "VerifierDiskLimitError", "FinalStepRewardError",
})  # fmt: skip
#: The folders Harbor keeps in a trial folder, moved from the sandbox's trial folder at its stop.
TRIAL_LOG_FOLDERS = ("agent", "verifier", "steps")


def trial_name(task_name: str) -> str:
    """A trial folder's name as Harbor makes it: ``<task folder, 32 chars>__<7 random letters and digits>``."""
    from shortuuid import ShortUUID  # Harbor's own (TrialConfig.generate_trial_name)

    short = task_name.split("/")[-1][:32].rstrip("_-") or "task"
    return f"{short}__{ShortUUID().random(length=7)}"


def harbor_exception_type(record: EpisodeRecord) -> str:
    """The exception name Harbor's own trial gives this outcome (``episodes.jsonl`` keeps ours).

    A verifier that left no reward is Harbor's ``RewardFileNotFoundError`` (and
    kin) or ``VerifierTimeoutError``; an agent or a start past its budget is
    ``AgentTimeoutError`` or ``EnvironmentStartTimeoutError``; anything Harbor
    has no name for keeps ours.
    """
    ours = record.error_type or record.error_class or "Error"
    text = record.error or ""
    if record.error_class == "verifier":
        named = next((name for name in HARBOR_VERIFIER_ERRORS if name in text), None)
        if named is not None:
            return named
        return "VerifierTimeoutError" if ours == "VerifierFailure" and "timed out" in text else ours
    if ours == "SandboxTimeout":
        return {"agent": "AgentTimeoutError", "start": "EnvironmentStartTimeoutError"}.get(record.error_phase or "", ours)
    return ours


def judged_trial(trial: Any) -> bool:
    """Whether a trial was judged: it has a verifier result, or its verifier ran and left none (scored 0)."""
    info = trial.exception_info
    return trial.verifier_result is not None or (info is not None and info.exception_type in VERIFIER_FAILURES)


def keep_trial_logs(sandbox_trial_dir: Path | None, target: Path, only: tuple[str, ...] = TRIAL_LOG_FOLDERS) -> None:
    """Move the agent's and verifier's files from a sandbox's (temporary) trial folder into the job's trial folder.

    What is there came through the backends' bounded transfers (or from an agent
    running on the host); it is moved, links not followed, never read, and any
    symbolic link in it is dropped: Harbor's viewer, run on the host, would
    follow one out of the job folder. The emptied folder is made again: a
    multi-step task's next step writes there.
    """
    if sandbox_trial_dir is None:
        return
    for name in only:
        source = sandbox_trial_dir / name
        if not source.is_dir() or source.is_symlink() or not any(source.iterdir()):
            continue
        destination = target / name
        try:
            target.mkdir(parents=True, exist_ok=True)
            if destination.exists():  # e.g. artifacts collected into steps/<name>/ already: merge
                shutil.copytree(source, destination, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.move(source, destination)
            source.mkdir(exist_ok=True)
            _drop_links(destination)
        except OSError as exc:  # the record is kept either way; a missing log is not worth failing it for
            log.warning("trial logs not kept", source=str(source), error=repr(exc))


def _drop_links(folder: Path) -> None:
    """Remove every symbolic link below ``folder`` (never followed)."""
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(root) / name
            if path.is_symlink():
                path.unlink()


def _trial_log(record: EpisodeRecord, trial: Any) -> str:
    """The trial's ``trial.log``, as Harbor's viewer shows it: what happened, phase by phase, and how it ended."""
    lines = [f"trial {trial.trial_name}: task {record.task}, agent {record.agent or 'oracle'}, model {record.model or '-'}"]
    lines.append(f"sandbox {record.sandbox or '-'}, started {record.started_at or '-'}, start attempts {record.start_attempts}")
    for span in record.phases:
        lines.append(f"{span.phase}: {span.start:.3f} s -> {span.end:.3f} s ({span.end - span.start:.3f} s)")
    for step in record.steps:
        lines.append(f"step {step.get('name')}: reward {step.get('reward')}" + (f", {step['error']}" if step.get("error") else ""))
    if record.error_class is not None:
        lines.append(f"{record.error_class} failure in {record.error_phase or '-'}: {harbor_exception_type(record)}: {record.error}")
    judged = "judged" if record.judged else "not judged (verification disabled)" if record.verification_disabled else "not judged (a resume reruns it)"
    lines.append(f"finished {record.finished_at or '-'}: reward {record.reward}, {judged}")
    return "\n".join(lines) + "\n"


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _spans(record: EpisodeRecord) -> dict[str, Any]:
    """Harbor's ``TimingInfo`` of each phase, from the record's spans (seconds from the start)."""
    from harbor.models.trial.result import TimingInfo

    started = _time(record.started_at)
    if started is None:
        return {}
    names = {"start": "environment_setup", "agent": "agent_execution", "verify": "verifier"}
    spans: dict[str, Any] = {}
    for span in record.phases:
        name = names.get(span.phase)
        if name is not None and name not in spans:
            spans[name] = TimingInfo(
                started_at=started + timedelta(seconds=span.start), finished_at=started + timedelta(seconds=span.end)
            )
    return spans


def _agent_context(usage: dict[str, Any]) -> Any:
    """Harbor's ``AgentContext`` from the record's usage (a harness's OpenAI counts, or a Harbor agent's own)."""
    from harbor.models.agent.context import AgentContext

    def first(*keys: str) -> Any:
        return next((usage[k] for k in keys if usage.get(k) is not None), None)

    context = AgentContext(
        n_input_tokens=first("n_input_tokens", "prompt_tokens"),
        n_cache_tokens=first("n_cache_tokens"),
        n_output_tokens=first("n_output_tokens", "completion_tokens"),
        cost_usd=first("cost_usd"),
    )
    return None if context.model_dump(exclude_none=True) == {} else context


class HarborJob:
    """Harbor's ``config.json``, ``result.json`` and trial folders of one job folder.

    Args:
        path: the job folder.
        settings: the job's :class:`~harbor_async.jobs.settings.JobSettings`.
        root: the suite's root (records name tasks relative to it).
        environment: the backend's Harbor type and import path (``BackendSpec``).
    """

    def __init__(self, path: Path, settings: Any, root: Path | None, environment: Any) -> None:
        from harbor.models.job.result import JobStats

        self.path = Path(path)
        self.settings = settings
        self.root = root
        self.environment = environment
        self._trials: dict[str, TrialResult] = {}
        self._stats = JobStats()
        self._result: JobResult | None = None
        self._checksums: dict[Path, str] = {}
        self._locks: dict[tuple[Path, str | None], str | None] = {}
        self._job_id = uuid.uuid4()

    # ── the job ─────────────────────────────────────────────────────────

    def start(self, n_total: int, latest: dict[str, EpisodeRecord]) -> None:
        """Write ``config.json`` and ``result.json`` before any episode runs; on a resume, keep what the job has."""
        from harbor.models.job.result import JobResult, JobStats
        from harbor.models.trial.result import TrialResult

        previous = self._read_result()
        if previous is not None:
            self._job_id = previous.id
        for key, record in latest.items():
            folder = self._trial_folder(record)
            if folder is None or not (folder / RESULT_NAME).is_file():
                continue
            with contextlib.suppress(OSError, ValueError):
                self._trials[key] = TrialResult.model_validate_json((folder / RESULT_NAME).read_text(encoding="utf-8"))
        self._stats = JobStats.from_trial_results(list(self._trials.values()))
        self._write(CONFIG_NAME, self.job_config().model_dump_json(indent=4))
        self._result = JobResult(
            id=self._job_id,
            started_at=previous.started_at if previous is not None else datetime.now(UTC),
            n_total_trials=n_total,
            stats=self._stats,
        )
        self._write_result()

    def add(self, record: EpisodeRecord) -> None:
        """Write the episode's trial folder and update ``result.json`` (a rerun replaces the earlier trial)."""
        folder = self._trial_folder(record)
        if folder is None:
            return
        trial = self.trial_result(record)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_NAME).write_text(trial.config.model_dump_json(indent=4), encoding="utf-8")
        (folder / RESULT_NAME).write_text(trial.model_dump_json(indent=4), encoding="utf-8")
        if (lock := self._lock(trial)) is not None:
            (folder / LOCK_NAME).write_text(lock, encoding="utf-8")
        (folder / LOG_NAME).write_text(_trial_log(record, trial), encoding="utf-8")
        if record.error:
            (folder / "exception.txt").write_text(f"{record.error_type or 'Error'}: {record.error}\n", encoding="utf-8")
        if record.transcript and not (folder / "agent" / "trajectory.json").exists():  # an agent's own stays
            from harbor_async.jobs.trajectory import write_trajectory

            write_trajectory(folder / "agent" / "trajectory.json", record)
        previous = self._trials.get(record.key)
        if previous is not None and previous.trial_name != trial.trial_name:
            shutil.rmtree(self.path / previous.trial_name, ignore_errors=True)
        self._trials[record.key] = trial
        self._stats.update_trial(trial, previous)
        self._write_result()

    def finish(self) -> None:
        """Add each eval's metrics (Harbor's mean) and pass@k over its judged trials, and the end time.

        Harbor's ``Mean`` and pass@k count a trial without a verifier result as
        0; here a trial nobody judged (infrastructure, the model server, an
        interruption) is left out, and an eval with none judged has no metric,
        so that ``harbor view`` shows no result rather than 0.00.
        """
        from harbor.metrics.mean import Mean
        from harbor.utils.pass_at_k import compute_pass_at_k_by_evals

        if self._result is None:
            return
        judged = [trial for trial in self._trials.values() if judged_trial(trial)]
        rewards: dict[str, list[Any]] = {}
        for trial in judged:
            key = self._stats.format_agent_evals_key(
                trial.agent_info.name,
                trial.agent_info.model_info.name if trial.agent_info.model_info else None,
                trial.source or "adhoc",
            )
            rewards.setdefault(key, []).append(trial.verifier_result.rewards if trial.verifier_result else None)
        for key, entry in self._stats.evals.items():
            entry.metrics = [Mean().compute(rewards[key])] if key in rewards else []
            entry.pass_at_k = {}
        for key, pass_at_k in compute_pass_at_k_by_evals(judged).items():
            self._stats.evals[key].pass_at_k = pass_at_k
        self._result.finished_at = datetime.now(UTC)
        self._write_result()

    def job_config(self) -> Any:
        """Harbor's ``JobConfig`` of this job: its agents (one per model of a sweep), dataset and environment."""
        from harbor.models.job.config import DatasetConfig, JobConfig
        from harbor.models.trial.config import EnvironmentConfig, VerifierConfig

        s = self.settings
        models = list(s.models) or [None]
        name, version = self._registry_dataset()
        tasks = []
        if getattr(s, "task_ref", None):  # -t: one registry task, as harbor run -t writes it
            from harbor.models.trial.config import TaskConfig

            from harbor_async.tasks.registry import parse_task_ref

            task, ref = parse_task_ref(s.task_ref)
            datasets, tasks = [], [TaskConfig(name=task, ref=ref)]
        elif name is not None:
            datasets = [DatasetConfig(name=name, version=version)]
        else:
            datasets = [DatasetConfig(path=self.root)] if self.root is not None else []
        return JobConfig(
            job_name=self.path.name,
            jobs_dir=self.path.parent,
            n_attempts=max(1, s.n_attempts),
            timeout_multiplier=s.timeout_multiplier or 1.0,
            agent_timeout_multiplier=s.agent_timeout_multiplier,
            verifier_timeout_multiplier=s.verifier_timeout_multiplier,
            environment_build_timeout_multiplier=s.environment_build_timeout_multiplier,
            n_concurrent_trials=max(1, s.n_concurrent),
            environment=EnvironmentConfig(**self._environment()),
            agents=[self._agent_config(model) for model in models],
            datasets=datasets,
            tasks=tasks,
            retry=self._retry_config(),
            artifacts=list(getattr(s, "artifacts", None) or []),
            verifier=VerifierConfig(  # --ve, --disable-verification
                env=dict(getattr(s, "verifier_env", None) or {}), disable=bool(getattr(s, "disable_verification", False))
            ),
        )

    # ── one trial ───────────────────────────────────────────────────────

    def trial_result(self, record: EpisodeRecord) -> TrialResult:
        """Harbor's ``TrialResult`` of one episode."""
        from harbor.models.task.id import LocalTaskId
        from harbor.models.trial.config import (
            EnvironmentConfig,
            TaskConfig,
            TrialConfig,
        )
        from harbor.models.trial.result import (
            AgentInfo,
            ExceptionInfo,
            StepResult,
            TrialResult,
        )
        from harbor.models.verifier.result import VerifierResult

        name = record.trial or trial_name(Path(record.task_path or record.task).name)
        task_dir = self._task_dir(record)
        source = self._source()
        config = TrialConfig(
            task=TaskConfig(path=task_dir, source=source),
            trial_name=name,
            trials_dir=self.path,
            timeout_multiplier=self.settings.timeout_multiplier or 1.0,
            agent=self._agent_config(record.model),
            environment=EnvironmentConfig(**self._environment()),
            job_id=self._job_id,
        )
        finished = _time(record.finished_at) or datetime.now(UTC)
        exception = None
        if record.error_class is not None:
            exception = ExceptionInfo(
                exception_type=harbor_exception_type(record),
                exception_message=record.error or "",
                exception_traceback="",
                occurred_at=finished,
            )
        # A verifier that left no reward leaves Harbor's verifier_result empty (the 0 is ours, in episodes.jsonl).
        rewarded = record.reward is not None and record.error_class != "verifier"
        verifier = VerifierResult(rewards=dict(record.rewards) or {"reward": cast(float, record.reward)}) if rewarded else None
        steps = [
            StepResult(
                step_name=str(step.get("name")),
                verifier_result=VerifierResult(rewards=step.get("rewards") or None) if step.get("rewards") else None,
            )
            for step in record.steps
        ] or None
        model = self._model_info(record.model)
        return TrialResult(
            task_name=record.task,
            trial_name=name,
            trial_uri=(self.path / name).resolve().as_uri(),
            task_id=LocalTaskId(path=task_dir),
            source=source,
            task_checksum=self._checksum(task_dir),
            config=config,
            agent_info=AgentInfo(name=record.agent or "oracle", version="unknown", model_info=model),
            agent_result=_agent_context(record.usage),
            verifier_result=verifier,
            exception_info=exception,
            started_at=_time(record.started_at),
            finished_at=finished,
            step_results=steps,
            **_spans(record),
        )

    # ── helpers ─────────────────────────────────────────────────────────

    def _agent_config(self, model: str | None) -> Any:
        from harbor.models.trial.config import AgentConfig

        agent, env = self.settings.agent or "oracle", dict(getattr(self.settings, "agent_env", None) or {})  # --ae
        if ":" in agent:
            return AgentConfig(import_path=agent, model_name=model, env=env)
        return AgentConfig(name=agent, model_name=model, env=env)

    def _retry_config(self) -> Any:
        """Harbor's ``RetryConfig`` of ``-r``, ``--retry-include``, ``--retry-exclude`` (Harbor's defaults otherwise)."""
        from harbor.models.job.config import RetryConfig

        s = self.settings
        given: dict[str, Any] = {"max_retries": getattr(s, "max_retries", 0)}
        if getattr(s, "retry_include", None):
            given["include_exceptions"] = set(s.retry_include)
        if getattr(s, "retry_exclude", None) is not None:
            given["exclude_exceptions"] = set(s.retry_exclude)
        return RetryConfig(**given)

    def _model_info(self, model: str | None) -> Any:
        """Harbor's ``ModelInfo``: a Harbor agent's ``provider/name`` split as Harbor splits it; an eval's model whole."""
        from harbor.models.trial.result import ModelInfo

        if not model:
            return None
        provider, slash, name = model.partition("/")
        if self.settings.command == "run" and slash:  # -m hosted_vllm/NAME: Harbor records NAME from hosted_vllm
            return ModelInfo(name=name, provider=provider)
        return ModelInfo(name=model)  # a served name or a checkpoint path, whole: a sweep's key

    def _lock(self, trial: Any) -> str | None:
        """Harbor's ``lock.json`` of a trial (its resolved inputs: the task's content digest, the agent, the
        multipliers), made by Harbor's own builder; ``None`` where the installed Harbor has none or it fails."""
        try:
            from harbor.models.job.lock import build_trial_lock
        except ImportError:
            return None
        from types import SimpleNamespace

        task_dir = Path(trial.config.task.path) if trial.config.task.path is not None else None
        if task_dir is None or not task_dir.is_dir():
            return None
        key = (task_dir, trial.agent_info.model_info.name if trial.agent_info.model_info else None)
        if key not in self._locks:
            resolved = SimpleNamespace(path=task_dir, content_hash=None, resolved_git_commit_id=None)
            try:
                lock = build_trial_lock(trial_config=trial.config, task_download_result=resolved)
                self._locks[key] = lock.model_dump_json(indent=4, exclude_none=True)
            except Exception as exc:  # noqa: BLE001 - another Harbor's builder: the trial's other files still stand
                log.debug("lock.json not written", task=str(task_dir), error=repr(exc))
                self._locks[key] = None
        return self._locks[key]

    def _registry_dataset(self) -> tuple[str | None, str | None]:
        """A Harbor registry dataset's name and version (``-d name@version``); ``(None, None)`` for a folder or ``hf:``."""
        text = getattr(self.settings, "dataset", None)
        if not text or text.startswith(HF_PREFIXES):
            return None, None
        name, _, version = text.partition("@")
        return name, version or None

    def _source(self) -> str | None:
        """What Harbor calls the trials' source: the registry dataset's name, else the suite folder's."""
        name, _ = self._registry_dataset()
        return name or (self.root.name if self.root is not None else None)

    def _environment(self) -> dict[str, Any]:
        spec = self.environment
        found = {"type": spec.type, "import_path": spec.import_path, "kwargs": dict(self.settings.environment_kwargs)}
        if getattr(self.settings, "force_build", False):
            found["force_build"] = True
        if getattr(self.settings, "mounts", None):  # --mounts, in Harbor's form (read_only: true unless writable)
            found["mounts"] = [dict(m) for m in self.settings.mounts]
        found["delete"] = bool(getattr(self.settings, "delete", False))  # Harbor's default deletes; ours keeps images
        for name in ("override_cpus", "override_memory_mb", "override_storage_mb", "override_gpus"):
            if getattr(self.settings, name, None) is not None:
                found[name] = getattr(self.settings, name)
        return found

    def _task_dir(self, record: EpisodeRecord) -> Path:
        path = Path(record.task_path or record.task)
        if not path.is_absolute() and self.root is not None:
            path = self.root / path
        return path.resolve()

    def _checksum(self, task_dir: Path) -> str:
        if task_dir not in self._checksums:
            from harbor.models.task.task import Task

            try:
                with warnings.catch_warnings():  # Harbor marks it "deprecated soon"; its replacement needs a lock file
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._checksums[task_dir] = Task(task_dir).checksum
            except Exception:  # a task folder gone since the run: the result stays readable
                self._checksums[task_dir] = ""
        return self._checksums[task_dir]

    def _trial_folder(self, record: EpisodeRecord) -> Path | None:
        if not record.trial or "/" in record.trial or record.trial.startswith("."):
            return None
        return self.path / record.trial

    def _read_result(self) -> JobResult | None:
        from harbor.models.job.result import JobResult

        try:
            return JobResult.model_validate_json((self.path / RESULT_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _write_result(self) -> None:
        assert self._result is not None
        self._result.stats = self._stats
        self._result.updated_at = datetime.now(UTC)
        self._write(RESULT_NAME, self._result.model_dump_json(indent=4, exclude={"trial_results"}))

    def _write(self, name: str, text: str) -> None:
        target = self.path / name
        tmp = target.with_name(f".{name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
