"""Engine options: the knobs TRL's env does not have, as flat keyword arguments.

A thin builder of the engine's own configuration (:class:`~harbor_async.core.policy.Limits`,
:class:`~harbor_async.core.policy.Timeouts`, :class:`~harbor_async.core.policy.RetryPolicy`,
which check the values), as httpx's ``Timeout``/``Limits`` serve its sync and async
clients alike; plus the shim's own failure budget and the cluster budget. Its
knobs shared with a job's settings (timeouts, retries, multipliers, the cluster's)
are declared once, in :class:`~harbor_async.jobs.setting_fields.EngineSettings`, which
both build the engine's classes with.

``HarborSpec(...)`` and ``HarborEnv(...)`` accept every field of
:class:`EngineOptions` as a keyword argument (``max_live_sandboxes=16,
exec_timeout=60``); an unknown keyword raises ``TypeError``. The options are
frozen and hashable: every env of the process with the same options shares one
:class:`~harbor_async.engine.engine.Engine` (see :mod:`shim.engines`), so limits apply
across the whole batch, not per env.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Any, Literal, TypedDict

from pydantic import ConfigDict, Field, field_validator

from harbor_async.core.policy import Limits
from harbor_async.jobs.setting_fields import EngineSettings, fspath, knob


class EngineOptions(EngineSettings):
    """Limits, per-phase timeouts and retries of the shared engine.

    Attributes:
        max_live_sandboxes: sandboxes alive at once across every env with these
            options (a sandbox counts from its create call until its stop is
            confirmed). Further starts wait for a slot. ``None`` (default):
            unlimited, so a batch of any size never waits on itself. With
            GRPOTrainer's batch reward every rollout of a generation batch holds
            its sandbox until the batch is verified: a ``reset`` that would need
            more than this many rollouts alive raises
            :class:`~harbor_async.core.errors.SandboxLimitError` at once (a provider
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
        adaptive_starts: bound the starts in flight by the adaptive window
            (:mod:`harbor_async.engine.start_window`; default ``True``);
            ``False``: every start is sent at once, up to ``max_live_sandboxes``.
        agent_timeout: seconds of tool time a rollout may use (the sum of its
            commands) when its task sets no ``[agent] timeout_sec``; ``None``: no limit.
        timeout_multiplier, agent_timeout_multiplier, verifier_timeout_multiplier,
        environment_build_timeout_multiplier: Harbor's multipliers of the
            task's (or these) timeouts; see :meth:`harbor_async.core.policy.Timeouts.for_task`.
        max_failure_share: when more than this share of a batch's rollouts
            failed for infrastructure reasons, the reward raises
            :class:`~harbor_async.core.errors.InfrastructureBudgetError` and stops
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
            see :mod:`harbor_async.tasks.host_variables`).
        strict_verify: end every process the agent left running before the
            verifier starts (default on; ``False``: they keep running, as in
            Harbor; see :mod:`harbor_async.verification.isolation`).
        resource_telemetry: read what each sandbox used (CPU seconds, peak
            memory, disk written, processes) into its record's ``resources``
            and the trainer's ``env/cpu_seconds`` and ``env/memory_peak_mb``
            (default on; :mod:`harbor_async.core.usage`).
        reap_stale: when the engine opens, remove what killed runs left on this
            machine (sandboxes, mounts, cgroups and folders of dead owners only;
            their docker containers at the first docker sandbox; logged). Default on.
        job_dir: a job folder that every rollout's record is appended to when its
            sandbox stops (``episodes.jsonl``, as ``run`` and ``eval`` write it;
            made if missing, appended to if it exists). ``None``: records are
            kept in memory only (``env.record``). Under several ranks give each
            rank its own folder.
    """

    model_config = ConfigDict(frozen=True)  # hashable: option sets key the shared engines

    # The shared knobs (timeouts, retries, multipliers, the cluster's) are EngineSettings'; these are the shim's.
    max_live_sandboxes: int | None = knob("limits", "live_sandboxes")
    creates_per_second: float | None = knob("limits", "creates_per_second")
    concurrent_execs: int | None = knob("limits", "concurrent_execs")
    exec_timeout: float | None = knob("timeouts", "exec")
    verify_timeout: float | None = knob("timeouts", "verify")
    stop_timeout: float | None = knob("timeouts", "stop")
    agent_timeout: float | None = knob("timeouts", "agent")
    max_failure_share: float | None = Field(0.5, ge=0, le=1)
    max_start_failures_in_a_row: int | None = Field(8, gt=0)
    per_rank_limits: bool = False
    reap_stale: bool = True
    job_dir: str | None = None

    @field_validator("job_dir", mode="before")
    @classmethod
    def path_as_text(cls, value: Any) -> Any:
        """A job folder given as a path is kept as text (hashable, and as records name it)."""
        return fspath(value)

    def engine_limits(self) -> Limits:
        """The engine's :class:`~harbor_async.core.policy.Limits` (per rank with ``per_rank_limits``)."""
        limits = super().engine_limits()
        if self.per_rank_limits:
            from harbor_async.cluster.ranks import divide_limits

            limits = divide_limits(limits)
        return limits

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineOptions:
        """Build from keyword arguments.

        Raises:
            UnknownSettingError: a name that is no option (a ``TypeError``).
            SettingError: a value of the wrong type or out of its range, named as the option.
        """
        return cls(**kwargs)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~harbor_async.engine.engine.Engine`.

        ``max_output`` stays at the engine default (8000 characters), the cut
        TRL's env applies, so tool outputs match TRL's byte for byte.
        """
        knobs = self.engine_knobs()
        if self.budget == "ray":
            from harbor_async.cluster.ranks import current_world
            from harbor_async.cluster.ray_budget import factory

            limits, world = knobs["limits"], current_world().size
            if limits.live_sandboxes is None and world > 1 and self.cluster_max_live is not None:
                # Ranks need their batches live at once: without a batch given, each rank's
                # batch is its share of the cluster cap (a larger rollout batch is refused).
                knobs["limits"] = limits = replace(limits, live_sandboxes=max(1, self.cluster_max_live // world))
            knobs["budget"] = factory(
                address=self.ray_address,
                max_live=self.cluster_max_live,
                creates_per_second=self.cluster_creates_per_second,
                batch=limits.live_sandboxes,
            )
        return {**knobs, "reap_stale": self.reap_stale}

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments."""
        return self.model_dump()


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
    """The keyword arguments :class:`EngineOptions` accepts, for ``HarborSpec``/``HarborEnv``'s ``**engine_options``.

    Type checkers read ``EngineOptions(...)``'s keywords off the model itself;
    ``**kwargs`` can only be typed by a ``TypedDict``, so this one lists the
    model's fields again (a test keeps the two equal).
    """

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
    adaptive_starts: bool
    agent_timeout: float | None
    timeout_multiplier: float
    agent_timeout_multiplier: float | None
    verifier_timeout_multiplier: float | None
    environment_build_timeout_multiplier: float | None
    max_failure_share: float | None
    max_start_failures_in_a_row: int | None
    per_rank_limits: bool
    budget: Literal["local", "ray"]
    ray_address: str | None
    cluster_max_live: int | None
    cluster_creates_per_second: float | None
    env_allow: tuple[str, ...]
    strict_verify: bool
    resource_telemetry: bool
    reap_stale: bool
