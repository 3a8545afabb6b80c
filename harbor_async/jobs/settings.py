"""One job's settings, for ``run`` and ``eval`` alike: what a resume repeats, stored as ``harbor-async.json``.

Field names are Harbor's words (``harbor run``'s flags and ``JobConfig``):
``environment_type`` (``-e``), ``environment_kwargs`` (``--ek``), ``n_attempts``
(``-k``), ``n_concurrent`` (``-n``), ``n_tasks`` (``-l``), the timeout
multipliers. Settings written by earlier releases (``config.json``: nested for
``run``, flat with other names for ``eval``) are read too.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, Self, TypedDict

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from harbor_async.core.errors import ResumeConflictError, UnknownSettingError
from harbor_async.jobs.retries import EpisodeRetries
from harbor_async.jobs.scoring import DEFAULT_SUCCESS_THRESHOLD
from harbor_async.jobs.setting_fields import (
    RESUME_MARK,
    AgentLimits,
    EngineSettings,
    Sampling,
    fspath,
    knob,
    marked_fields,
    may_change_on_resume,
)
from harbor_async.models.serve import DEFAULT_ERROR_TIMEOUT, DEFAULT_READY_TIMEOUT
from harbor_async.tasks.host_variables import fill_values
from harbor_async.tasks.overrides import TaskOverrides
from harbor_async.verification.disk_bounds import (
    DEFAULT_EPISODE_DISK_MB,
    DEFAULT_JOB_DISK_MB,
    DiskLimits,
)

#: Names of earlier releases, read (with a DeprecationWarning where a user passes them) as today's.
RENAMED = {
    "backend": "environment_type",
    "env": "environment_type",
    "backend_kwargs": "environment_kwargs",
    "ek": "environment_kwargs",
    "attempts": "n_attempts",
    "concurrency": "n_concurrent",
    "num_tasks": "n_tasks",
    "max_live": "cluster_max_live",
    "creates_per_second": "cluster_creates_per_second",
    "source": "suite",
}

# 3: run stores its -n (n_concurrent); 4: a start_timeout of None is no limit (before: the engine's default).
SETTINGS_VERSION = 4
#: Stored by version 2 under the shim's name of another option: the cluster's cap.
_STORED_AS = {"max_live_sandboxes": "cluster_max_live"}
#: Stored as None by earlier versions to mean the default (today None is no limit, or no value at all).
_NONE_WAS_DEFAULT = ("start_timeout", "timeout_multiplier")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _current_names(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` under today's names; an earlier release's name warns (the caller passed it)."""
    current: dict[str, Any] = {}
    for name, value in values.items():
        if name in RENAMED:
            warnings.warn(
                f"{name}= is deprecated; use {RENAMED[name]}= (the old name goes in the next release)",
                DeprecationWarning,
                stacklevel=4,
            )
            name = RENAMED[name]
        current[name] = value
    return current


class JobSettings(EngineSettings):
    """Everything a ``run`` or an ``eval`` job needs (``command`` says which), checked once when built.

    Attributes shared by both: the suite and its selection, the backend and its
    options, the host variables a task's ``${VAR}`` may read (``env_allow``), attempts, concurrency, the
    engine's knobs (the episode deadline, the start timeout, retries and the
    slot wait, Harbor's timeout multipliers: :class:`~harbor_async.jobs.setting_fields.EngineSettings`,
    shared with the shim's options), and the cluster options (``ray``, ``ray_address``, ``budget``
    and the cluster's caps ``cluster_max_live``, ``cluster_creates_per_second``,
    named as the shim's engine options name them), and a Harbor agent's
    options (``agent_kwargs``, ``--ak``).
    ``run`` adds the plan (``episodes``) and its agent's model (``models``: none
    or one, ``-m``); ``eval`` adds the models and how to
    reach them (``models``, ``base_url``, ``serve_cmd``, ``api_key_name``,
    ``vllm_args``, ``ready_timeout``), sampling, the agent loop's limits and the
    scoring threshold.

    Both add the disk bounds of what the job folder gets (``episode_disk_limit_mb``,
    ``job_disk_limit_mb``: :mod:`harbor_async.verification.disk_bounds`).

    A field marked :func:`~harbor_async.jobs.setting_fields.may_change_on_resume`
    (where the model server is now, how many episodes run at once, the job folder's bound) may be
    given anew by a resume; every other one must equal the stored value
    (:meth:`resumed`).
    """

    command: Literal["run", "eval"] = "run"
    suite: str | list[str] | None = None  # a folder, a dataset id, or a registry dataset's task folders
    dataset: str | None = None
    task_ref: str | None = None  # harbor run's -t NAME[@REF]: the one registry task the suite is (suite: its folder)
    agent: str = "oracle"
    agent_kwargs: dict[str, Any] = Field(default_factory=dict)  # a Harbor agent's options (--ak)
    environment_type: str = "local"
    environment_kwargs: dict[str, Any] = Field(default_factory=dict)
    n_attempts: PositiveInt = 1
    n_concurrent: PositiveInt = may_change_on_resume(8)  # the results do not depend on it
    n_tasks: PositiveInt | None = None
    indices: list[NonNegativeInt] | None = Field(None, strict=False)
    include: list[str] | None = Field(None, strict=False)
    exclude: list[str] | None = Field(None, strict=False)
    agent_setup_timeout_multiplier: float | None = knob("timeouts", "agent_setup_timeout_multiplier")
    ray: bool = False
    force_build: bool = may_change_on_resume(False)  # build each task's image again at its first start (docker)
    # harbor run's --delete: at the run's end, delete what its sandboxes' stops kept for reuse (docker's task images);
    # containers and volumes go at every stop either way. Our default keeps the images (Harbor's deletes them).
    delete: bool = may_change_on_resume(False)
    # harbor run's --override-*: every task's resources, bounded by the backend as a task's own values are
    override_cpus: float | None = Field(None, gt=0)
    override_memory_mb: PositiveInt | None = None
    override_storage_mb: PositiveInt | None = None
    override_gpus: NonNegativeInt | None = None
    artifacts: list[str] = Field(default_factory=list, strict=False)  # harbor run's --artifact: collected from every task
    # harbor run's --mounts, normalized (harbor_async.tasks.mounts: read-only unless --mounts-writable let one be writable)
    mounts: list[dict[str, Any]] = Field(default_factory=list, strict=False)
    mounts_writable: bool = False
    # harbor run's --ae/--ve (values as given: a ${VAR} is filled at each start from --env-allow'ed host variables)
    agent_env: dict[str, str] = Field(default_factory=dict)
    verifier_env: dict[str, str] = Field(default_factory=dict)
    disable_verification: bool = False  # harbor run's --disable-verification: no verifier, nobody judged
    capture: bool = False  # --capture: a Harbor agent's model calls through the capture proxy (harbor_async.models.capture)
    env_file: str | None = may_change_on_resume()  # harbor run's --env-file: loaded into this process's environment
    # harbor run's trial retries (-r): failed episodes a resume would rerun, rerun at once (harbor_async.jobs.retries)
    max_retries: NonNegativeInt = 0
    retry_include: list[str] | None = Field(None, strict=False)
    retry_exclude: list[str] | None = Field(None, strict=False)
    # what the job folder gets of each episode (the shim keeps no trial folders: nothing to bound)
    episode_disk_limit_mb: PositiveInt | None = DEFAULT_EPISODE_DISK_MB
    job_disk_limit_mb: PositiveInt | None = may_change_on_resume(DEFAULT_JOB_DISK_MB)  # the results do not depend on it
    # eval
    models: list[str] = Field(default_factory=list, strict=False)
    base_url: str | None = may_change_on_resume()  # where the model server is, not what the job runs
    serve_cmd: str | None = may_change_on_resume()
    api_key_name: str | None = may_change_on_resume()
    sampling: Sampling = Sampling()
    limits: AgentLimits = AgentLimits()
    max_concurrent_requests: PositiveInt = 32
    max_model_server_failures: NonNegativeInt = 5
    request_timeout: PositiveFloat = 600.0
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    ready_timeout: PositiveFloat = DEFAULT_READY_TIMEOUT
    ready_error_timeout: PositiveFloat = DEFAULT_ERROR_TIMEOUT
    vllm_args: list[str] = Field(default_factory=list, strict=False)
    step_from: str | None = None  # a regular expression whose group is a checkpoint's step (--step-from)
    # run
    episodes: list[dict[str, Any]] = Field(default_factory=list)
    created_at: str = Field(default_factory=_now)
    version: int = SETTINGS_VERSION

    @model_validator(mode="before")
    @classmethod
    def earlier_names(cls, values: Any) -> Any:
        """An earlier release's name of a setting (``backend``, ``attempts``, ...) read as today's."""
        if isinstance(values, Mapping):
            return {RENAMED.get(k, k): v for k, v in values.items()}
        return values

    @field_validator("suite", mode="before")
    @classmethod
    def paths_as_text(cls, value: Any) -> Any:
        """A suite given as a path (or task folders as paths) is stored as text."""
        return [fspath(v) for v in value] if isinstance(value, list | tuple) else fspath(value)

    @field_validator("include", "exclude", mode="before")
    @classmethod
    def one_glob_is_a_list_of_one(cls, value: Any) -> Any:
        """``include="csv-*"`` is that one glob (as :func:`~harbor_async.tasks.suite.load_suite` takes it)."""
        return [value] if isinstance(value, str) else value

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (the job's ``harbor-async.json``): every field."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSettings:
        """Read a stored :meth:`to_dict`, whole, of this release or an earlier one, or an earlier ``config.json``.

        An earlier version's file is brought up to this one (its names, its
        ``None`` that meant a default, a key no setting has any more dropped);
        this version's is read as it is: an unknown key is refused.

        Raises:
            UnknownSettingError, SettingError: a stored value this release cannot read.
        """
        data = dict(data)
        nested = data.pop("settings", None)
        if isinstance(nested, dict):  # run's earlier shape: {"command", "created_at", "settings": {...}, "episodes"}
            multipliers = nested.pop("multipliers", None) or {}
            data.update(nested)
            data.update(
                timeout_multiplier=multipliers.get("all"),
                agent_timeout_multiplier=multipliers.get("agent"),
                verifier_timeout_multiplier=multipliers.get("verifier"),
                environment_build_timeout_multiplier=multipliers.get("environment_build"),
            )
        version = data.get("version", 1)
        if version < SETTINGS_VERSION:
            data = _upgraded(data, version)
        return cls(**data)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> JobSettings:
        """Build from keyword arguments; an earlier release's name works, with a ``DeprecationWarning``.

        Raises:
            UnknownSettingError: a name that is no setting (a ``TypeError``).
            SettingError: a value of the wrong type or out of its range.
        """
        return cls(**_current_names(kwargs))

    def resumed(self, given: Mapping[str, Any]) -> JobSettings:
        """These stored settings for a resume given ``given`` (settings by name; earlier names work, and warn).

        A resume runs the job whole as it was started: every setting given is
        checked as a new job's would be, then compared with the stored one
        (their JSON forms). Equal is accepted; different is refused
        (:class:`~harbor_async.core.errors.ResumeConflictError`, naming both),
        except for the fields marked as a resume's to change (:data:`RESUME_MAY_CHANGE`:
        where the job's model server is now, how many episodes run at once),
        which replace the stored ones. ``None`` means not given.

        Raises:
            ResumeConflictError: a value that differs from the stored one.
            UnknownSettingError: a name that is no setting.
            SettingError: a value of the wrong type or out of its range.
        """
        values = _current_names(given)
        unknown = sorted(set(values) - set(type(self).model_fields))
        if unknown:
            raise UnknownSettingError(unknown[0], sorted(type(self).model_fields))
        values = {name: value for name, value in values.items() if value is not None}
        checked = type(self)(**{**self.model_dump(), **values})
        stored, now = self.to_dict(), checked.to_dict()
        for name in values:
            if name not in RESUME_MAY_CHANGE and now[name] != stored[name]:
                raise ResumeConflictError(name, stored[name], now[name])
        moved = {name: getattr(checked, name) for name in values if name in RESUME_MAY_CHANGE}
        if moved.get("base_url") and "serve_cmd" not in moved:  # the server is now at that address, not started
            moved["serve_cmd"] = None
        if moved.get("serve_cmd") and "base_url" not in moved:
            moved["base_url"] = None
        return self.model_copy(update=moved)

    def resource_overrides(self) -> dict[str, Any]:
        """The ``[environment]`` values ``--override-*`` set on every task (``cpus``, ``memory_mb``, ...)."""
        given = {"cpus": self.override_cpus, "memory_mb": self.override_memory_mb,
                 "storage_mb": self.override_storage_mb, "gpus": self.override_gpus}  # fmt: skip
        return {name: value for name, value in given.items() if value is not None}

    def task_overrides(self) -> TaskOverrides:
        """What the run sets on every task (``--override-*``, ``--artifact``, ``--ve``): the engine applies it."""
        return TaskOverrides(self.resource_overrides(), tuple(self.artifacts), dict(self.verifier_env))

    def retries(self) -> EpisodeRetries:
        """The run's trial retries (``-r``, ``--retry-include``, ``--retry-exclude``)."""
        return EpisodeRetries.of(self.max_retries, self.retry_include, self.retry_exclude)

    @model_validator(mode="after")
    def retries_name_no_judged_outcome(self) -> Self:
        """A judged outcome named in ``retry_include`` is refused (it is never rerun)."""
        self.retries()
        return self

    def engine_kwargs(self, budget: Any = None, job_dir: Any = None) -> dict[str, Any]:
        """The ``Engine`` arguments of this job's episodes (the driver's, or a cluster node's).

        The episodes' one concurrency limit is the driver's (``n_concurrent``)
        or the worker's; the engine gets no lower one. ``budget``: the budget
        factory (:func:`harbor_async.cluster.ray_budget.job_budget`; ``None``: this
        process's limits). ``job_dir``: the
        job folder, whose ``artifacts/`` gets each episode's artifacts.
        """
        return {
            **self.engine_knobs(),
            "trials_dir": None if job_dir is None else str(job_dir),
            "disk_limits": DiskLimits(self.episode_disk_limit_mb, self.job_disk_limit_mb),
            "force_build": self.force_build,
            "mounts": list(self.mounts),
            "mounts_writable": self.mounts_writable,
            "delete": self.delete,
            "task_overrides": self.task_overrides(),
            "verify": not self.disable_verification,
            "agent_env": fill_values(self.agent_env, self.env_allow, "--ae"),  # here: the workers get the driver's
            "backend_kwargs": dict(self.environment_kwargs),
            "budget": budget,
            "reap_stale": True,  # what killed runs left on this machine goes first (dead owners only)
        }


#: What a resume may set anew: the fields marked so (where the model server is, how many episodes at once).
RESUME_MAY_CHANGE = frozenset(marked_fields(JobSettings, RESUME_MARK))


def _upgraded(data: dict[str, Any], version: int) -> dict[str, Any]:
    """An earlier version's stored settings in this version's form (see :meth:`JobSettings.from_dict`)."""
    known = set(JobSettings.model_fields)
    values = {_STORED_AS.get(k, RENAMED.get(k, k)): v for k, v in data.items()}
    values = {k: v for k, v in values.items() if k in known}  # a setting since removed: nothing reads it
    for name in _NONE_WAS_DEFAULT:
        if values.get(name, 0) is None:
            del values[name]
    if values.get("command", "run") == "run" and version < 3:  # run stored no -n: the default, unless given now
        values.pop("n_concurrent", None)
    values["version"] = SETTINGS_VERSION  # what it holds now means what this version's would
    return values


class EvaluateSettings(TypedDict, total=False):
    """The keywords of :func:`~harbor_async.evaluation.evaluate` (``**settings``): :class:`JobSettings`' fields.

    For type checkers only: the values are checked, converted and defaulted by
    :class:`JobSettings` (a test keeps the two in step). The names of earlier
    releases still work at run time, with a ``DeprecationWarning``, and are
    not listed.
    """

    start_timeout: float | None
    slot_timeout: float | None
    episode_timeout: float | None
    start_attempts: int
    start_retry_wait: float
    start_retry_max_wait: float
    start_retry_max_total: float | None
    adaptive_starts: bool
    timeout_multiplier: float
    agent_timeout_multiplier: float | None
    verifier_timeout_multiplier: float | None
    environment_build_timeout_multiplier: float | None
    budget: Literal["local", "ray"]
    ray_address: str | None
    cluster_max_live: int | None
    cluster_creates_per_second: float | None
    env_allow: Sequence[str]
    strict_verify: bool
    resource_telemetry: bool
    dataset: str | None
    task_ref: str | None
    agent: str
    agent_kwargs: dict[str, Any]
    capture: bool
    environment_type: str
    environment_kwargs: dict[str, Any]
    n_attempts: int
    n_concurrent: int
    n_tasks: int | None
    indices: Sequence[int] | None
    include: Sequence[str] | None
    exclude: Sequence[str] | None
    agent_setup_timeout_multiplier: float | None
    ray: bool
    force_build: bool
    delete: bool
    override_cpus: float | None
    override_memory_mb: int | None
    override_storage_mb: int | None
    override_gpus: int | None
    artifacts: Sequence[str]
    mounts: list[dict[str, Any]]
    mounts_writable: bool
    agent_env: dict[str, str]
    verifier_env: dict[str, str]
    disable_verification: bool
    env_file: str | None
    max_retries: int
    retry_include: Sequence[str] | None
    retry_exclude: Sequence[str] | None
    episode_disk_limit_mb: int | None
    job_disk_limit_mb: int | None
    base_url: str | None
    serve_cmd: str | None
    api_key_name: str | None
    sampling: Sampling | Mapping[str, Any]
    limits: AgentLimits | Mapping[str, Any]
    max_concurrent_requests: int
    max_model_server_failures: int
    request_timeout: float
    success_threshold: float
    ready_timeout: float
    ready_error_timeout: float
    vllm_args: Sequence[str]
    step_from: str | None
