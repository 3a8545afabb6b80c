"""Engine options: the knobs TRL's env does not have, as flat keyword arguments.

``HarborSpec(...)`` and ``HarborEnv(...)`` accept every field of
:class:`EngineOptions` as a keyword argument (``max_live_sandboxes=16,
exec_timeout=60``); an unknown keyword raises ``TypeError``. The options are
frozen and hashable: every env of the process with the same options shares one
:class:`~harbor_async.engine.Engine` (see :mod:`shim.engines`), so limits apply
across the whole batch, not per env.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, TypedDict

from harbor_async.policy import Limits, RetryPolicy, Timeouts


@dataclass(frozen=True)
class EngineOptions:
    """Limits, per-phase timeouts and retries of the shared engine.

    Attributes:
        max_live_sandboxes: sandboxes alive at once across every env with these
            options (a sandbox counts from its create call until its stop is
            confirmed). Further starts wait for a slot. ``None``: unlimited.
            Keep it at least the number of rollouts in flight (GRPOTrainer: the
            generation batch, plus the previous batch's sandboxes while they
            stop): GRPOTrainer verifies, and so frees slots, only after every
            rollout of the batch has finished its tool calls, so a rollout
            waiting for a slot held by its own batch would wait until the
            engine's slot timeout (600 s) and then see a start error.
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
        start_attempts: start attempts for transient failures (jittered
            exponential backoff); a permanent failure is not retried.
        per_rank_limits: under torchrun/accelerate (``WORLD_SIZE`` set), divide
            ``max_live_sandboxes``, ``concurrent_execs`` and
            ``creates_per_second`` by the world size, so that the numbers given
            hold for all ranks together (see :mod:`harbor_async.cluster.ranks`).
        budget: ``"local"`` (default: this process's limits only) or ``"ray"``:
            every engine of every rank and node also leases from one Ray budget
            actor (``pip install 'harbor-async[ray]'``; see
            :mod:`harbor_async.cluster.ray_budget`). With ``"ray"``,
            ``max_live_sandboxes`` is this process's batch, leased all or
            nothing (set it to the rank's generation batch; ``None``: one lease
            per sandbox), and ``cluster_max_live`` / ``cluster_creates_per_second``
            are the caps of the whole cluster.
        ray_address: the Ray cluster (``None``: ``RAY_ADDRESS`` or the local one).
        cluster_max_live: live sandboxes across the cluster (``budget="ray"``;
            ``None`` with no rate either: join the running budget actor as it is).
        cluster_creates_per_second: sandbox creations per second across the cluster.
    """

    max_live_sandboxes: int | None = 64
    creates_per_second: float | None = None
    concurrent_execs: int | None = None
    start_timeout: float | None = 600.0
    exec_timeout: float | None = 180.0
    verify_timeout: float | None = 600.0
    stop_timeout: float | None = 120.0
    episode_timeout: float | None = None
    start_attempts: int = 3
    per_rank_limits: bool = False
    budget: str = "local"
    ray_address: str | None = None
    cluster_max_live: int | None = None
    cluster_creates_per_second: float | None = None

    def __post_init__(self) -> None:
        if self.budget not in ("local", "ray"):
            raise ValueError(f"budget must be 'local' or 'ray', got {self.budget!r}")
        for name in ("max_live_sandboxes", "concurrent_execs", "cluster_max_live"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in (
            "creates_per_second",
            "cluster_creates_per_second",
            "start_timeout",
            "exec_timeout",
            "verify_timeout",
            "stop_timeout",
            "episode_timeout",
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value)
            ):
                raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
        if isinstance(self.start_attempts, bool) or not isinstance(self.start_attempts, int) or self.start_attempts < 1:
            raise ValueError(f"start_attempts must be an integer >= 1, got {self.start_attempts!r}")

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
        limits = Limits(
            live_sandboxes=self.max_live_sandboxes,
            creates_per_second=self.creates_per_second,
            concurrent_execs=self.concurrent_execs,
        )
        if self.per_rank_limits:
            from harbor_async.cluster.ranks import divide_limits

            limits = divide_limits(limits)
        kwargs: dict[str, Any] = {}
        if self.budget == "ray":
            from harbor_async.cluster.ray_budget import factory

            kwargs["budget"] = factory(
                address=self.ray_address,
                max_live=self.cluster_max_live,
                creates_per_second=self.cluster_creates_per_second,
                batch=limits.live_sandboxes,
            )
        return {
            **kwargs,
            "limits": limits,
            "timeouts": Timeouts(
                start=self.start_timeout,
                exec=self.exec_timeout,
                verify=self.verify_timeout,
                stop=self.stop_timeout,
                episode=self.episode_timeout,
            ),
            "retry": RetryPolicy(attempts=self.start_attempts),
        }

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments."""
        return asdict(self)


class EngineOptionsKwargs(TypedDict, total=False):
    """The keyword arguments :class:`EngineOptions` accepts (for type checkers)."""

    max_live_sandboxes: int | None
    creates_per_second: float | None
    concurrent_execs: int | None
    start_timeout: float | None
    exec_timeout: float | None
    verify_timeout: float | None
    stop_timeout: float | None
    episode_timeout: float | None
    start_attempts: int
    per_rank_limits: bool
    budget: str
    ray_address: str | None
    cluster_max_live: int | None
    cluster_creates_per_second: float | None
