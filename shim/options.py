"""Engine options: the knobs TRL's env does not have, as flat keyword arguments.

A thin builder of the engine's own configuration (:class:`~harbor_async.policy.Limits`,
:class:`~harbor_async.policy.Timeouts`, :class:`~harbor_async.policy.RetryPolicy`,
which check the values), as httpx's ``Timeout``/``Limits`` serve its sync and async
clients alike; plus the shim's own failure budget and the cluster budget.

``HarborSpec(...)`` and ``HarborEnv(...)`` accept every field of
:class:`EngineOptions` as a keyword argument (``max_live_sandboxes=16,
exec_timeout=60``); an unknown keyword raises ``TypeError``. The options are
frozen and hashable: every env of the process with the same options shares one
:class:`~harbor_async.engine.Engine` (see :mod:`shim.engines`), so limits apply
across the whole batch, not per env.
"""

from __future__ import annotations

import os

import warnings
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypedDict

from harbor_async.errors import SettingError
from harbor_async.policy import Limits, RetryPolicy, Timeouts

_TIMEOUTS, _RETRY = Timeouts(), RetryPolicy()

#: The engine's names of the settings an option sets (for errors in the option's name).
_OPTION_NAMES = {
    "live_sandboxes": "max_live_sandboxes",
    "start": "start_timeout",
    "exec": "exec_timeout",
    "verify": "verify_timeout",
    "stop": "stop_timeout",
    "episode": "episode_timeout",
    "agent": "agent_timeout",
    "attempts": "start_attempts",
    "slot": "slot_timeout",
    "initial_wait": "start_retry_wait",
    "max_wait": "start_retry_max_wait",
    "max_total": "start_retry_max_total",
}


@dataclass(frozen=True)
class EngineOptions:
    """Limits, per-phase timeouts and retries of the shared engine.

    Attributes:
        max_live_sandboxes: sandboxes alive at once across every env with these
            options (a sandbox counts from its create call until its stop is
            confirmed). Further starts wait for a slot. ``None`` (default):
            unlimited, so a batch of any size never waits on itself. With
            GRPOTrainer's batch reward every rollout of a generation batch holds
            its sandbox until the batch is verified: a ``reset`` that would need
            more than this many rollouts alive raises
            :class:`~harbor_async.errors.SandboxLimitError` at once (a provider
            cap below the batch size means a smaller generation batch).
        creates_per_second: at most this many sandbox creations per second
            (provider rate limits). ``None``: unlimited.
        concurrent_execs: commands and verifier runs in flight at once across
            all sandboxes. ``None``: unlimited.
        start_timeout: seconds for one start attempt (create + healthcheck).
        exec_timeout: default seconds for one tool command when the harness
            passes no ``timeout`` (TRL's fixed value is 180).
        verify_timeout: seconds for the verifier.
        stop_timeout: seconds for one teardown; teardown always gets it, even
            past the episode deadline.
        episode_timeout: seconds from ``reset()`` to the reward, bounding every
            phase but the stop. ``None``: no episode deadline.
        slot_timeout: seconds a start may wait for a live-sandbox slot (``max_live_sandboxes``).
        start_retry_wait, start_retry_max_wait, start_retry_max_total: the
            backoff between start attempts (first wait, longest wait) and the
            most seconds all attempts of one start may take (``None``: no cap).
        start_attempts: start attempts for transient failures (jittered
            exponential backoff); a permanent failure is not retried.
        agent_timeout: seconds of tool time a rollout may use (the sum of its
            commands) when its task sets no ``[agent] timeout_sec``; ``None``: no limit.
        timeout_multiplier, agent_timeout_multiplier, verifier_timeout_multiplier,
        environment_build_timeout_multiplier: Harbor's multipliers of the
            task's (or these) timeouts; see :meth:`harbor_async.policy.Timeouts.for_task`.
        max_failure_share: when more than this share of a batch's rollouts
            failed for infrastructure reasons, the reward raises
            :class:`~harbor_async.errors.InfrastructureBudgetError` and stops
            the trainer. ``None``: never.
        max_start_failures_in_a_row: after this many sandbox starts failed one
            after another, the next ``reset`` or reward raises the same error.
            ``None``: never.
        per_rank_limits: under torchrun/accelerate (``WORLD_SIZE`` set), divide
            ``max_live_sandboxes``, ``concurrent_execs`` and
            ``creates_per_second`` by the world size, so that the numbers given
            hold for all ranks together (see :mod:`harbor_async.cluster.ranks`).
        budget: ``"local"`` (default: this process's limits only) or ``"ray"``:
            every engine of every rank and node also leases from one Ray budget
            actor (``pip install 'harbor-async[ray]'``; see
            :mod:`harbor_async.cluster.ray_budget`). With ``"ray"``,
            ``max_live_sandboxes`` is this process's batch, leased all or
            nothing (set it to the rank's generation batch; ``None``: under
            torchrun/accelerate, ``cluster_max_live // WORLD_SIZE``, else one
            lease per sandbox), and ``cluster_max_live`` /
            ``cluster_creates_per_second`` are the caps of the whole cluster.
        ray_address: the Ray cluster (``None``: ``RAY_ADDRESS`` or the local one).
        cluster_max_live: live sandboxes across the cluster (``budget="ray"``;
            ``None`` with no rate either: join the running budget actor as it is).
        cluster_creates_per_second: sandbox creations per second across the cluster.
        env_allow: host variables a task's ``${VAR}`` may read (names; default none:
            see :mod:`harbor_async.task_env`).
        strict_verify: kill every process the agent left running before the
            verifier starts (default off, as in Harbor; see
            :mod:`harbor_async.verifier_isolation`).
        reap_stale: when the engine opens, remove what killed runs left on this
            machine (sandboxes, mounts, cgroups, containers of dead owners only;
            logged). Default on.
        job_dir: a job folder that every rollout's record is appended to when its
            sandbox stops (``episodes.jsonl``, as ``run`` and ``eval`` write it;
            made if missing, appended to if it exists). ``None``: records are
            kept in memory only (``env.record``). Under several ranks give each
            rank its own folder.
    """

    max_live_sandboxes: int | None = None
    creates_per_second: float | None = None
    concurrent_execs: int | None = None
    # The engine's own defaults, declared once (harbor_async.policy): the shim names them as TRL's users expect.
    start_timeout: float | None = _TIMEOUTS.start
    exec_timeout: float | None = _TIMEOUTS.exec
    verify_timeout: float | None = _TIMEOUTS.verify
    stop_timeout: float | None = _TIMEOUTS.stop
    episode_timeout: float | None = _TIMEOUTS.episode
    start_attempts: int = _RETRY.attempts
    slot_timeout: float | None = _TIMEOUTS.slot
    start_retry_wait: float = _RETRY.initial_wait
    start_retry_max_wait: float = _RETRY.max_wait
    start_retry_max_total: float | None = _RETRY.max_total
    agent_timeout: float | None = _TIMEOUTS.agent
    timeout_multiplier: float = _TIMEOUTS.timeout_multiplier
    agent_timeout_multiplier: float | None = None
    verifier_timeout_multiplier: float | None = None
    environment_build_timeout_multiplier: float | None = None
    max_failure_share: float | None = 0.5
    max_start_failures_in_a_row: int | None = 8
    per_rank_limits: bool = False
    budget: str = "local"
    ray_address: str | None = None
    cluster_max_live: int | None = None
    cluster_creates_per_second: float | None = None
    env_allow: tuple[str, ...] = ()
    strict_verify: bool = False
    reap_stale: bool = True
    job_dir: str | None = None

    def __post_init__(self) -> None:
        if self.job_dir is not None:
            object.__setattr__(self, "job_dir", os.fspath(self.job_dir))
        names = (self.env_allow,) if isinstance(self.env_allow, str) else tuple(self.env_allow)
        object.__setattr__(self, "env_allow", names)  # hashable: option sets key the shared engines
        if self.budget not in ("local", "ray"):
            raise SettingError("budget", self.budget, "'local' or 'ray'")
        share = self.max_failure_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1):
            raise SettingError("max_failure_share", share, "a number in [0, 1] or None")
        for name in ("max_start_failures_in_a_row", "cluster_max_live"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SettingError(name, value, "a positive integer or None")
        value = self.cluster_creates_per_second
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise SettingError("cluster_creates_per_second", value, "a positive number or None")
        try:  # the engine's own classes check the rest, once
            self.limits(), self.timeouts(), self.retry()
        except SettingError as exc:
            raise SettingError(_OPTION_NAMES.get(exc.name, exc.name), exc.value, exc.requirement) from None

    def limits(self) -> Limits:
        """The engine's :class:`~harbor_async.policy.Limits` (per rank with ``per_rank_limits``)."""
        limits = Limits(
            live_sandboxes=self.max_live_sandboxes,
            creates_per_second=self.creates_per_second,
            concurrent_execs=self.concurrent_execs,
        )
        if self.per_rank_limits:
            from harbor_async.cluster.ranks import divide_limits

            limits = divide_limits(limits)
        return limits

    def timeouts(self) -> Timeouts:
        """The engine's :class:`~harbor_async.policy.Timeouts`."""
        return Timeouts(
            start=self.start_timeout,
            exec=self.exec_timeout,
            verify=self.verify_timeout,
            stop=self.stop_timeout,
            slot=self.slot_timeout,
            episode=self.episode_timeout,
            agent=self.agent_timeout,
            timeout_multiplier=self.timeout_multiplier,
            agent_timeout_multiplier=self.agent_timeout_multiplier,
            verifier_timeout_multiplier=self.verifier_timeout_multiplier,
            environment_build_timeout_multiplier=self.environment_build_timeout_multiplier,
        )

    def retry(self) -> RetryPolicy:
        """The engine's :class:`~harbor_async.policy.RetryPolicy`."""
        return RetryPolicy(
            attempts=self.start_attempts, initial_wait=self.start_retry_wait, max_wait=self.start_retry_max_wait,
            max_total=self.start_retry_max_total,
        )

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineOptions:
        """Build from keyword arguments; a name that is no option raises ``TypeError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"engine options are: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~harbor_async.engine.Engine`.

        ``max_output`` stays at the engine default (8000 characters), the cut
        TRL's env applies, so tool outputs match TRL's byte for byte.
        """
        limits = self.limits()
        kwargs: dict[str, Any] = {}
        if self.budget == "ray":
            from harbor_async.cluster.ranks import current_world
            from harbor_async.cluster.ray_budget import factory

            world = current_world().size
            if limits.live_sandboxes is None and world > 1 and self.cluster_max_live is not None:
                # Ranks need their batches live at once: without a batch given, each rank's
                # batch is its share of the cluster cap (a larger rollout batch is refused).
                limits = replace(limits, live_sandboxes=max(1, self.cluster_max_live // world))

            kwargs["budget"] = factory(
                address=self.ray_address,
                max_live=self.cluster_max_live,
                creates_per_second=self.cluster_creates_per_second,
                batch=limits.live_sandboxes,
            )
        return {
            **kwargs, "limits": limits, "timeouts": self.timeouts(), "retry": self.retry(), "env_allow": self.env_allow,
            "strict_verify": self.strict_verify, "reap_stale": self.reap_stale,
        }  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments."""
        return asdict(self)


def renamed_kwargs(environment_kwargs: Any, backend_kwargs: Any) -> Any:
    """``environment_kwargs=``, or the deprecated ``backend_kwargs=`` with a ``DeprecationWarning``."""
    if backend_kwargs is None:
        return environment_kwargs
    if environment_kwargs is not None:
        raise TypeError("give environment_kwargs=, not also its deprecated name backend_kwargs=")
    warnings.warn(
        "backend_kwargs= is deprecated; use environment_kwargs= (Harbor's --ek; the old name goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    return backend_kwargs


class EngineOptionsKwargs(TypedDict, total=False):
    """The keyword arguments :class:`EngineOptions` accepts (for type checkers)."""

    job_dir: str | os.PathLike[str] | None
    max_live_sandboxes: int | None
    creates_per_second: float | None
    concurrent_execs: int | None
    start_timeout: float | None
    exec_timeout: float | None
    verify_timeout: float | None
    stop_timeout: float | None
    episode_timeout: float | None
    start_attempts: int
    slot_timeout: float | None
    start_retry_wait: float
    start_retry_max_wait: float
    start_retry_max_total: float | None
    agent_timeout: float | None
    timeout_multiplier: float
    agent_timeout_multiplier: float | None
    verifier_timeout_multiplier: float | None
    environment_build_timeout_multiplier: float | None
    max_failure_share: float | None
    max_start_failures_in_a_row: int | None
    per_rank_limits: bool
    budget: str
    ray_address: str | None
    cluster_max_live: int | None
    cluster_creates_per_second: float | None
    env_allow: tuple[str, ...]
    strict_verify: bool
    reap_stale: bool
