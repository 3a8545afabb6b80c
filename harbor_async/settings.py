"""One job's settings, for ``run`` and ``eval`` alike: what a resume repeats, stored as ``harbor-async.json``.

Field names are Harbor's words (``harbor run``'s flags and ``JobConfig``):
``environment_type`` (``-e``), ``environment_kwargs`` (``--ek``), ``n_attempts``
(``-k``), ``n_concurrent`` (``-n``), ``n_tasks`` (``-l``), the timeout
multipliers. Settings written by earlier releases (``config.json``: nested for
``run``, flat with other names for ``eval``) are read too.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any

from harbor_async.errors import ResumeConflictError
from harbor_async.policy import Limits, RetryPolicy, Timeouts
from harbor_async.scoring import DEFAULT_SUCCESS_THRESHOLD
from harbor_async.serve import DEFAULT_ERROR_TIMEOUT, DEFAULT_READY_TIMEOUT

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

SETTINGS_VERSION = 3  # 3: run stores its -n (n_concurrent)

#: Where a job's model server is, not what the job runs: a resume may give them anew.
SERVER_LOCATION = frozenset({"base_url", "serve_cmd", "api_key_name"})
#: What a resume may set anew besides (how many episodes at once: the results do not depend on it).
RESUME_MAY_CHANGE = SERVER_LOCATION | {"n_concurrent"}


def _plain(value: Any) -> Any:
    """``value`` as its JSON form reads back (tuples as lists, paths as text): how a stored value compares."""
    return json.loads(json.dumps(value, default=str))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class JobSettings:
    """Everything a ``run`` or an ``eval`` job needs (``command`` says which).

    Attributes shared by both: the suite and its selection, the backend and its
    options, the host variables a task's ``${VAR}`` may read (``env_allow``), attempts, concurrency, the episode deadline and Harbor's timeout
    multipliers, and the cluster options (``ray``, ``ray_address``, ``budget``
    and the cluster's caps ``cluster_max_live``, ``cluster_creates_per_second``,
    named as the shim's engine options name them), and a Harbor agent's
    options (``agent_kwargs``, ``--ak``).
    ``run`` adds the plan (``episodes``) and its agent's model (``models``: none
    or one, ``-m``); ``eval`` adds the models and how to
    reach them (``models``, ``base_url``, ``serve_cmd``, ``api_key_name``,
    ``vllm_args``, ``ready_timeout``), sampling, the agent loop's limits and the
    scoring threshold.
    """

    command: str = "run"
    suite: str | list[str] | None = None  # a folder, a dataset id, or a registry dataset's task folders
    dataset: str | None = None
    agent: str = "oracle"
    agent_kwargs: dict[str, Any] = field(default_factory=dict)  # a Harbor agent's options (--ak)
    environment_type: str = "local"
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    env_allow: list[str] = field(default_factory=list)
    strict_verify: bool = False
    n_attempts: int = 1
    n_concurrent: int = 8
    n_tasks: int | None = None
    indices: list[int] | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    episode_timeout: float | None = None
    start_timeout: float | None = None
    # The engine's own defaults (harbor_async.policy), declared there once.
    slot_timeout: float | None = Timeouts.slot
    start_attempts: int = RetryPolicy.attempts
    start_retry_wait: float = RetryPolicy.initial_wait
    start_retry_max_wait: float = RetryPolicy.max_wait
    start_retry_max_total: float | None = RetryPolicy.max_total
    timeout_multiplier: float = 1.0
    agent_timeout_multiplier: float | None = None
    verifier_timeout_multiplier: float | None = None
    environment_build_timeout_multiplier: float | None = None
    agent_setup_timeout_multiplier: float | None = None
    ray: bool = False
    ray_address: str | None = None
    budget: str = "local"
    cluster_max_live: int | None = None
    cluster_creates_per_second: float | None = None
    # eval
    models: list[str] = field(default_factory=list)
    base_url: str | None = None
    serve_cmd: str | None = None
    api_key_name: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    max_concurrent_requests: int = 32
    max_model_server_failures: int = 5
    request_timeout: float = 600.0
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    ready_timeout: float = DEFAULT_READY_TIMEOUT
    ready_error_timeout: float = DEFAULT_ERROR_TIMEOUT
    vllm_args: list[str] = field(default_factory=list)
    # run
    episodes: list[dict[str, Any]] = field(default_factory=list)
    created_at: str = field(default_factory=_now)
    version: int = SETTINGS_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (the job's ``harbor-async.json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSettings:
        """Read :meth:`to_dict`'s output, or an earlier release's ``config.json`` (unknown keys ignored)."""
        data = dict(data)
        nested = data.pop("settings", None)
        if isinstance(nested, dict):  # run's earlier shape: {"command", "created_at", "settings": {...}, "episodes"}
            multipliers = nested.pop("multipliers", None) or {}
            data.update(nested)
            data.update(
                timeout_multiplier=multipliers.get("all") or 1.0,
                agent_timeout_multiplier=multipliers.get("agent"),
                verifier_timeout_multiplier=multipliers.get("verifier"),
                environment_build_timeout_multiplier=multipliers.get("environment_build"),
            )
        values = {RENAMED.get(k, k): v for k, v in data.items()}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> JobSettings:
        """Build from keyword arguments; an earlier release's name works, with a ``DeprecationWarning``.

        Raises:
            TypeError: a name that is no setting.
        """
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in RENAMED and RENAMED[name] in known:
                warnings.warn(
                    f"{name}= is deprecated; use {RENAMED[name]}= (the old name goes in the next release)",
                    DeprecationWarning,
                    stacklevel=3,
                )
                name = RENAMED[name]
            if name not in known:
                raise TypeError(f"unknown setting {name!r}; settings are: {', '.join(sorted(known))}")
            values[name] = value
        return cls(**values)

    def resumed(self, given: Mapping[str, Any]) -> JobSettings:
        """These stored settings for a resume given ``given`` (settings by name; earlier names work).

        A resume runs the job whole as it was started: a given value equal to the
        stored one is accepted, one that differs is refused
        (:class:`~harbor_async.errors.ResumeConflictError`, naming both), except
        where the job's model server is now (:data:`SERVER_LOCATION`: a server
        restarted on another port, a key under another name) and how many
        episodes run at once (``n_concurrent``), which replace the stored ones
        (:data:`RESUME_MAY_CHANGE`). ``None`` means not given.

        Raises:
            ResumeConflictError: a value that differs from the stored one.
            TypeError: a name that is no setting.
        """
        known = {f.name for f in fields(self)}
        moved: dict[str, Any] = {}
        for name, value in given.items():
            name = RENAMED.get(name, name)
            if name not in known:
                raise TypeError(f"unknown setting {name!r}; settings are: {', '.join(sorted(known))}")
            if value is None:
                continue
            if name in RESUME_MAY_CHANGE:
                moved[name] = value
            elif _plain(value) != _plain(getattr(self, name)):
                raise ResumeConflictError(name, getattr(self, name), value)
        if moved.get("base_url") and "serve_cmd" not in moved:  # the server is now at that address, not started
            moved["serve_cmd"] = None
        if moved.get("serve_cmd") and "base_url" not in moved:
            moved["base_url"] = None
        return replace(self, **moved)

    def timeouts(self) -> Timeouts:
        """The engine's phase budgets for this job (each task's own are applied per sandbox)."""
        base = Timeouts()
        return Timeouts(
            start=self.start_timeout or base.start,
            slot=self.slot_timeout,
            episode=self.episode_timeout,
            timeout_multiplier=self.timeout_multiplier or 1.0,
            agent_timeout_multiplier=self.agent_timeout_multiplier,
            verifier_timeout_multiplier=self.verifier_timeout_multiplier,
            environment_build_timeout_multiplier=self.environment_build_timeout_multiplier,
            agent_setup_timeout_multiplier=self.agent_setup_timeout_multiplier,
        )

    def budget_factory(self) -> Any:
        """The ``Engine(budget=...)`` factory: ``None`` (this process's limits) or the cluster's Ray budget."""
        if self.budget != "ray":
            return None
        from harbor_async.cluster.ray_budget import factory

        return factory(
            address=self.ray_address, max_live=self.cluster_max_live, creates_per_second=self.cluster_creates_per_second
        )

    def engine_kwargs(self, budget: Any = None, job_dir: Any = None) -> dict[str, Any]:
        """The ``Engine`` arguments of this job's episodes (the driver's, or a cluster node's).

        The episodes' one concurrency limit is the driver's (``n_concurrent``)
        or the worker's; the engine gets no lower one. ``budget``: a budget
        factory already made (else :meth:`budget_factory`). ``job_dir``: the
        job folder, whose ``artifacts/`` gets each episode's artifacts.
        """
        return {
            "trials_dir": None if job_dir is None else str(job_dir),
            "limits": Limits(live_sandboxes=None),
            "timeouts": self.timeouts(),
            "retry": RetryPolicy(
                attempts=self.start_attempts, initial_wait=self.start_retry_wait,
                max_wait=self.start_retry_max_wait, max_total=self.start_retry_max_total,
            ),
            "backend_kwargs": dict(self.environment_kwargs),
            "budget": budget if budget is not None else self.budget_factory(),
            "env_allow": list(self.env_allow),
            "strict_verify": self.strict_verify,
            "reap_stale": True,  # what killed runs left on this machine goes first (dead owners only)
        }

