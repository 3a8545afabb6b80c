"""A Harbor environment with no processes: configurable latencies and faults.

For benchmarks at cloud latencies and for fault injection. Every phase sleeps
for a draw from its latency distribution; faults are drawn from a seeded RNG
shared by all simulated sandboxes of one seed, so a run with the same seed and
the same call order sees the same faults.

Latencies are given as seconds (``0.5``) or as a distribution string:
``"uniform:LOW:HIGH"``, ``"lognormal:MEDIAN:SIGMA"`` or ``"exp:MEAN"``.

A provider's faults (a cloud sandbox service, not one sandbox's) are shared by
every simulated sandbox of one ``provider`` name: a create rate (a token
bucket: a create over it is answered with a rate-limit error, as a 429), a
quota of live sandboxes (a create over it is answered with a quota error),
and bursts of failures (every start fails transiently while a burst lasts;
bursts begin at exponentially spaced times). With a heavy-tailed start
latency (``lognormal:MEDIAN:SIGMA``) these make the provider profiles of
``harbor-async bench starts``.

The verifier's test script is recognised by Harbor's command that runs it
(a script under ``/tests/``, its output redirected to ``test-stdout.txt``):
that exec takes the verify latency (and may fail), and the verifier then reads
the configured ``reward``. An exec prints nothing but the verifier reset's
marker, as a shell would.
"""

from __future__ import annotations

import math
import random
import re
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import anyio
from harbor.environments.base import (
    BaseEnvironment,
    ExecResult,
    SandboxBuildFailedError,
)
from harbor.environments.capabilities import EnvironmentCapabilities

from harbor_async.core.errors import (
    BackendQuotaError,
    BackendRateLimitError,
    BackendStartError,
)
from harbor_async.core.token_bucket import TokenBucket
from harbor_async.verification.reward_files import RESET_DONE


class SimulatedTransientError(BackendStartError, ConnectionError):
    """A simulated start failure that a retry can fix (like a provider's 503)."""

    transient = True


class SimulatedRateLimitError(BackendRateLimitError):
    """The simulated provider's create rate was exceeded (its 429)."""


class SimulatedQuotaError(BackendQuotaError):
    """The simulated provider's quota of live sandboxes was reached."""


class Provider:
    """The state a simulated cloud provider keeps across its sandboxes (see the module's docstring).

    Args:
        create_rate: creates accepted per second (``None``: any), in bursts of up to ``create_burst``.
        quota: live sandboxes allowed at once (``None``: any).
        burst_every: mean seconds between bursts of failures (``None``: none).
        burst_seconds: how long a burst lasts.
        rng: the draws of the bursts' times.
    """

    def __init__(
        self,
        create_rate: float | None,
        create_burst: float | None,
        quota: int | None,
        burst_every: float | None,
        burst_seconds: float,
        rng: random.Random,
    ) -> None:
        self.create_rate = create_rate
        self.create_burst = create_burst if create_burst is not None else max(1.0, create_rate or 1.0)
        self.quota = quota
        self.burst_every = burst_every
        self.burst_seconds = burst_seconds
        self._rng = rng
        self._bucket = None if create_rate is None else TokenBucket(create_rate, self.create_burst, self.create_burst)
        self._next_burst: float | None = None
        self.live = 0
        self.rate_limited = 0
        self.quota_refused = 0
        self.burst_failures = 0

    def admit(self, now: float) -> str | None:
        """Take one create at ``now``: ``None`` when accepted, else why not (``rate``, ``quota``, ``burst``)."""
        if self._bucket is not None and not self._bucket.take(now):
            self.rate_limited += 1
            return "rate"
        if self.quota is not None and self.live >= self.quota:
            self.quota_refused += 1
            return "quota"
        if self.burst_every is not None:
            if self._next_burst is None:
                self._next_burst = now + self._rng.expovariate(1.0 / self.burst_every)
            while now >= self._next_burst + self.burst_seconds:
                self._next_burst += self.burst_seconds + self._rng.expovariate(1.0 / self.burst_every)
            if now >= self._next_burst:
                self.burst_failures += 1
                return "burst"
        return None

    def counts(self) -> dict[str, int]:
        """The provider's refusals so far."""
        return {"rate_limited": self.rate_limited, "quota_refused": self.quota_refused, "burst_failures": self.burst_failures}


@dataclass(frozen=True)
class Latency:
    """A latency distribution in seconds."""

    kind: str = "fixed"
    a: float = 0.0
    b: float = 0.0

    @classmethod
    def parse(cls, spec: float | int | str | Latency) -> Latency:
        """Parse ``0.5``, ``"uniform:0.1:0.3"``, ``"lognormal:0.5:0.25"`` or ``"exp:0.2"``."""
        if isinstance(spec, Latency):
            return spec
        if isinstance(spec, (int, float)):
            if spec < 0:
                raise ValueError(f"latency must be >= 0, got {spec}")
            return cls("fixed", float(spec))
        kind, *params = str(spec).split(":")
        try:
            values = [float(p) for p in params]
        except ValueError:
            raise ValueError(f"bad latency {spec!r}: parameters must be numbers") from None
        arity = {"fixed": 1, "uniform": 2, "lognormal": 2, "exp": 1}
        if kind not in arity:
            if not params:
                return cls.parse(float(kind))
            raise ValueError(f"bad latency {spec!r}: use seconds, uniform:LOW:HIGH, lognormal:MEDIAN:SIGMA or exp:MEAN")
        if len(values) != arity[kind] or any(v < 0 for v in values):
            raise ValueError(f"bad latency {spec!r}: {kind} takes {arity[kind]} non-negative numbers")
        return cls(kind, *values)

    def sample(self, rng: random.Random) -> float:
        """Draw one latency."""
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "lognormal":
            return self.a * math.exp(rng.gauss(0.0, self.b)) if self.a else 0.0
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.a) if self.a else 0.0
        return self.a


_RESET_DONE = re.compile(rf"{RESET_DONE}-[0-9a-f]+")

#: Start times kept for tests and benchmarks.
OBSERVATIONS_KEPT = 10_000


class SimulatedEnvironment(BaseEnvironment):
    """A Harbor environment that only sleeps and fails on purpose.

    Constructor keyword arguments (all optional), via Harbor's ``--ek`` or the
    engine's ``backend_kwargs``: ``start_latency``, ``exec_latency``,
    ``verify_latency``, ``stop_latency`` (see module doc), ``reward`` (the
    verifier's reward, default 1.0), ``start_failure_rate`` (transient),
    ``start_permanent_failure_rate``, ``fail_first_starts`` (the first N starts
    of each task fail transiently), ``exec_hang_rate``, ``verify_failure_rate``,
    ``stop_failure_rate``, ``seed``; the provider's (see the module's
    docstring): ``provider`` (its name), ``create_rate``, ``create_burst``,
    ``quota``, ``failure_burst_every``, ``failure_burst_seconds``,
    ``throttle_latency`` (the seconds a refusal takes to come back).
    """

    ANYIO_NATIVE: ClassVar[bool] = True

    # Observations across all instances, for tests and benchmarks.
    live_now: ClassVar[int] = 0
    peak_live: ClassVar[int] = 0
    #: The latest start times (bounded: a long run must not grow memory).
    start_times: ClassVar[deque[float]] = deque(maxlen=OBSERVATIONS_KEPT)
    execs_now: ClassVar[int] = 0
    peak_execs: ClassVar[int] = 0
    _starts_by_task: ClassVar[dict[str, int]] = defaultdict(int)
    _rngs: ClassVar[dict[Any, random.Random]] = {}
    providers: ClassVar[dict[str, Provider]] = {}

    def __init__(
        self,
        *args: Any,
        start_latency: float | str = 0.0,
        exec_latency: float | str = 0.0,
        verify_latency: float | str = 0.0,
        stop_latency: float | str = 0.0,
        reward: float = 1.0,
        start_failure_rate: float = 0.0,
        start_permanent_failure_rate: float = 0.0,
        fail_first_starts: int = 0,
        exec_hang_rate: float = 0.0,
        verify_failure_rate: float = 0.0,
        stop_failure_rate: float = 0.0,
        seed: int | None = 0,
        provider: str = "simulated",
        create_rate: float | None = None,
        create_burst: float | None = None,
        quota: int | None = None,
        failure_burst_every: float | None = None,
        failure_burst_seconds: float = 2.0,
        throttle_latency: float = 0.05,
        run_label: str | None = None,
        **kwargs: Any,
    ) -> None:
        self._latency = {
            "start": Latency.parse(start_latency),
            "exec": Latency.parse(exec_latency),
            "verify": Latency.parse(verify_latency),
            "stop": Latency.parse(stop_latency),
        }
        self._reward = float(reward)
        self._rates = {
            "start": float(start_failure_rate),
            "start_permanent": float(start_permanent_failure_rate),
            "exec_hang": float(exec_hang_rate),
            "verify": float(verify_failure_rate),
            "stop": float(stop_failure_rate),
        }
        for name, rate in self._rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} failure rate must be within [0, 1], got {rate}")
        self._fail_first_starts = int(fail_first_starts)
        if seed not in self._rngs:
            self._rngs[seed] = random.Random(seed)
        self._rng = self._rngs[seed]
        faults = (create_rate, create_burst, quota, failure_burst_every)
        if provider not in self.providers or any(v is not None for v in faults):
            self.providers.setdefault(
                provider,
                Provider(create_rate, create_burst, quota, failure_burst_every, failure_burst_seconds, self._rng),
            )
        self._provider = self.providers[provider]
        self._throttle_latency = float(throttle_latency)
        self._counted = False
        self._running = False
        self._verified = False
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "simulated"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        """Nothing to validate: no image is built."""

    @classmethod
    def reset_observations(cls) -> None:
        """Clear the cross-instance counters (tests call this first)."""
        cls.live_now = 0
        cls.peak_live = 0
        cls.start_times = deque(maxlen=OBSERVATIONS_KEPT)
        cls.execs_now = 0
        cls.peak_execs = 0
        cls._starts_by_task.clear()
        cls._rngs.clear()
        cls.providers.clear()

    def _chance(self, name: str) -> bool:
        rate = self._rates[name]
        return rate > 0 and self._rng.random() < rate

    async def _sleep(self, phase: str) -> None:
        delay = self._latency[phase].sample(self._rng)
        if delay > 0:  # zero latency costs no loop iteration, as an in-process call would
            await anyio.sleep(delay)

    async def start(self, force_build: bool) -> None:
        type(self).start_times.append(anyio.current_time())
        counts = type(self)._starts_by_task
        counts[self.environment_name] += 1
        refused = self._provider.admit(anyio.current_time())
        if refused is not None:
            if self._throttle_latency > 0:
                await anyio.sleep(self._throttle_latency)
            if refused == "rate":
                raise SimulatedRateLimitError(f"simulated 429: create rate exceeded ({self.session_id})")
            if refused == "quota":
                raise SimulatedQuotaError(f"simulated quota of {self._provider.quota} live sandboxes ({self.session_id})")
            raise SimulatedTransientError(f"simulated burst of failures ({self.session_id})")
        self._provider.live += 1
        self._counted = True
        await self._sleep("start")
        if self._chance("start_permanent"):
            raise SandboxBuildFailedError(f"simulated permanent start failure ({self.session_id})")
        if counts[self.environment_name] <= self._fail_first_starts or self._chance("start"):
            raise SimulatedTransientError(f"simulated transient start failure ({self.session_id})")
        self._running = True
        cls = type(self)
        cls.live_now += 1
        cls.peak_live = max(cls.peak_live, cls.live_now)

    async def stop(self, delete: bool) -> None:
        try:
            await self._sleep("stop")
        finally:  # the delete request went out even if the caller stopped waiting
            was_running, self._running = self._running, False
            if was_running:
                type(self).live_now -= 1
            if self._counted:
                self._counted = False
                self._provider.live -= 1
        if self._chance("stop"):
            raise RuntimeError(f"simulated stop failure ({self.session_id})")

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if not self._running:
            raise RuntimeError("simulated sandbox is not running")
        # What a shell would print of it: only the verifier reset's marker (see harbor_async.verification.reward_files).
        printed = "\n".join(_RESET_DONE.findall(command)) if RESET_DONE in command else ""
        if "/tests/" in command and "test-stdout" in command:  # Harbor's run of the tests (their output redirected)
            await self._sleep("verify")
            self._verified = not self._chance("verify")
            return ExecResult(stdout=printed, stderr="", return_code=0)
        cls = type(self)
        cls.execs_now += 1
        cls.peak_execs = max(cls.peak_execs, cls.execs_now)
        try:
            if self._chance("exec_hang"):
                await anyio.sleep_forever()
            await self._sleep("exec")
        finally:
            cls.execs_now -= 1
        return ExecResult(stdout=printed, stderr="", return_code=0)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Uploads are accepted and dropped."""

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Uploads are accepted and dropped."""

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        Path(target_path).write_text("")

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """The verifier dir comes back with the reward when the test script ran and passed.

        With the test's (empty) stdout file too, as from a real sandbox, where
        the verifier's command redirects it there.
        """
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        if source_dir.rstrip("/").endswith("/logs/verifier") and self._verified:
            (target / "test-stdout.txt").write_text("")
            (target / "reward.txt").write_text(f"{self._reward}\n")
