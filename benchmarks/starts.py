"""Adaptive starts against fixed limits on a simulated cloud provider (``harbor-async bench starts``).

Each run drives ``episodes`` episodes (start, the agent's time, verify, stop)
on the simulated backend, at most ``ceiling`` at once (``run -n``), against a
provider profile: a create rate answered with 429s over it, a quota of live
sandboxes, a heavy-tailed start latency, and (one profile) bursts of failures.
The policies:

- ``fixed-N``: ``-n N`` with every start sent at once (``--fixed-starts``);
- ``adaptive-N``: ``-n N`` with the adaptive start window (the default).

A run's figures: **goodput** (judged episodes finished per second of wall
time), episodes not judged (their starts failed past the retries), the
provider's refusals (429s, quota answers), and the p50/p99 of an episode's
seconds from its start request to its stop. ``speedup`` divides every
latency and multiplies every rate (and the engine's retry waits) by the same
factor: the provider's dynamics keep their shape, in less wall time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import anyio

#: Provider profiles, each with its source. Start latencies: lognormal with a
#: median of 0.5 s and a sigma of 0.99, a p99 of 5 s (the published p50s of
#: 0.4-0.7 s and p99s of 4-8 s that issue 48 cites).
PROFILES: dict[str, dict[str, Any]] = {
    "e2b-pro": {
        "create_rate": 5.0,
        "quota": 100,
        "source": "E2B's rate limits, Pro plan: 5 sandbox creations per second, 100 concurrent sandboxes "
        "(https://e2b.dev/docs/sandbox/rate-limits)",
    },
    "e2b-hobby": {
        "create_rate": 1.0,
        "quota": 20,
        "source": "E2B's rate limits, Hobby plan: 1 creation per second, 20 concurrent sandboxes "
        "(https://e2b.dev/docs/sandbox/rate-limits)",
    },
    "coreweave-free": {
        "create_rate": 10.0,
        "quota": 20,
        "source": "CoreWeave Sandboxes' default concurrent-sandbox quota for W&B Free accounts: 20 "
        "(https://docs.coreweave.com/products/sandboxes/reference/limits-and-quotas); its create rate is "
        "not published: 10 per second assumed",
    },
    "bursty": {
        "create_rate": 10.0,
        "quota": 1000,
        "failure_burst_every": 20.0,
        "failure_burst_seconds": 2.0,
        "source": "a stress profile (not a provider's figures): 10 creations per second, a quota of 1,000 "
        "(Render's concurrent sandboxes per group, https://render.com/docs/sandboxes-limits), and a 2 s burst "
        "of failed starts every 20 s on average",
    },
}
START_LATENCY = (0.5, 0.99)  # lognormal median (s), sigma
#: The rest of an episode (seconds): the agent's time, the verifier's, the stop's.
AGENT_SECONDS, VERIFY_SECONDS, STOP_SECONDS = 4.0, 1.0, 0.5


@dataclass(frozen=True)
class Policy:
    """A start policy: ``ceiling`` episodes at once, with or without the adaptive window."""

    ceiling: int
    adaptive: bool

    @property
    def name(self) -> str:
        return f"{'adaptive' if self.adaptive else 'fixed'}-{self.ceiling}"

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``fixed-8``, ``adaptive-64``."""
        kind, _, number = text.partition("-")
        if kind not in ("fixed", "adaptive") or not number.isdigit() or int(number) < 1:
            raise ValueError(f"a policy is fixed-N or adaptive-N, got {text!r}")
        return cls(int(number), kind == "adaptive")


def _backend_kwargs(profile: dict[str, Any], speedup: float, seed: int) -> dict[str, Any]:
    median, sigma = START_LATENCY
    kwargs: dict[str, Any] = {
        "start_latency": f"lognormal:{median / speedup}:{sigma}",
        "exec_latency": f"exp:{AGENT_SECONDS / speedup}",
        "verify_latency": VERIFY_SECONDS / speedup,
        "stop_latency": STOP_SECONDS / speedup,
        "throttle_latency": 0.05 / speedup,
        "create_rate": profile["create_rate"] * speedup,
        "quota": profile["quota"],
        "seed": seed,
    }
    if "failure_burst_every" in profile:
        kwargs["failure_burst_every"] = profile["failure_burst_every"] / speedup
        kwargs["failure_burst_seconds"] = profile["failure_burst_seconds"] / speedup
    return kwargs


async def run_policy(
    profile: str, policy: Policy, *, episodes: int = 200, speedup: float = 1.0, seed: int = 0
) -> dict[str, Any]:
    """One run of ``episodes`` episodes under ``policy`` against ``profile``; its figures."""
    from harbor_async.backends.simulated import SimulatedEnvironment
    from harbor_async.core.policy import Limits, RetryPolicy
    from harbor_async.engine.engine import Engine
    from harbor_async.tasks.suite import load_suite

    SimulatedEnvironment.reset_observations()
    kwargs = _backend_kwargs(PROFILES[profile], speedup, seed)
    retry = RetryPolicy(initial_wait=0.5 / speedup, max_wait=10.0 / speedup, max_total=120.0 / speedup)
    tasks = load_suite(None).tasks
    latencies: list[float] = []
    judged = failed = 0
    windows: list[int] = []
    limits = Limits(live_sandboxes=policy.ceiling, adaptive_starts=policy.adaptive)
    async with Engine(limits=limits, retry=retry, backend_kwargs=kwargs) as engine:
        driver = anyio.CapacityLimiter(policy.ceiling)

        async def episode(index: int) -> None:
            nonlocal judged, failed
            async with driver:
                began = anyio.current_time()
                try:
                    async with engine.sandbox(tasks[index % len(tasks)], "simulated") as sandbox:
                        if sandbox.start_window is not None:
                            windows.append(sandbox.start_window)
                        await sandbox.exec("agent")
                        result = await sandbox.verify()
                except Exception:  # a start that failed past its retries: not judged
                    failed += 1
                    return
                latencies.append(anyio.current_time() - began)
                judged += result.reward is not None

        began = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for index in range(episodes):
                tg.start_soon(episode, index)
        seconds = anyio.current_time() - began
        stats = engine.stats()
    provider = SimulatedEnvironment.providers["simulated"].counts()
    ordered = sorted(latencies)
    return {
        "profile": profile,
        "policy": policy.name,
        "episodes": episodes,
        "judged": judged,
        "not_judged": failed,
        "seconds": round(seconds, 3),
        "goodput": round(judged / seconds, 3),
        "episode_p50_s": round(statistics.median(ordered), 3) if ordered else None,
        "episode_p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3) if ordered else None,
        "start_attempts_throttled": stats.throttled,
        **provider,
        "start_window": stats.start_window,
        "start_window_median": statistics.median(windows) if windows else None,
    }


def run_starts(
    profiles: list[str], policies: list[Policy], *, repeats: int = 3, episodes: int = 200, speedup: float = 1.0
) -> dict[str, Any]:
    """Every policy against every profile, ``repeats`` times (alternating order); the medians per policy."""
    runs: list[dict[str, Any]] = []
    for profile in profiles:
        for repeat in range(repeats):
            order = policies if repeat % 2 == 0 else list(reversed(policies))
            for policy in order:
                runs.append(
                    anyio.run(
                        lambda p=policy, r=repeat: run_policy(profile, p, episodes=episodes, speedup=speedup, seed=r)
                    )
                )
    summary: dict[str, dict[str, Any]] = {}
    for profile in profiles:
        for policy in policies:
            mine = [r for r in runs if r["profile"] == profile and r["policy"] == policy.name]
            summary.setdefault(profile, {})[policy.name] = {
                key: statistics.median(r[key] for r in mine if r[key] is not None)
                for key in ("goodput", "episode_p99_s", "rate_limited", "quota_refused", "not_judged", "seconds")
            }
    return {
        "episodes": episodes,
        "repeats": repeats,
        "speedup": speedup,
        "episode": {
            "start_latency": f"lognormal, median {START_LATENCY[0]} s, sigma {START_LATENCY[1]}",
            "agent_s": f"exponential, mean {AGENT_SECONDS}",
            "verify_s": VERIFY_SECONDS,
            "stop_s": STOP_SECONDS,
        },
        "profiles": {name: PROFILES[name] for name in profiles},
        "runs": runs,
        "summary": summary,
    }


def run_backend(env: str, *, repeats: int = 3, episodes: int = 64, levels: tuple[int, ...] = (8, 32)) -> dict[str, Any]:
    """Throughput on a real backend with the window on and off (alternating), per concurrency level.

    Neither local nor docker answers with 429s: the window may only cost
    here, and this measures what it costs (``ratio``: adaptive over fixed
    episodes per second, the median of the rounds).
    """
    from benchmarks.throughput import run_throughput

    rounds: list[dict[str, Any]] = []
    for level in levels:
        for repeat in range(repeats):
            order = (True, False) if repeat % 2 == 0 else (False, True)
            rates: dict[bool, float] = {}
            for adaptive in order:
                result = anyio.run(
                    lambda a=adaptive: run_throughput(
                        episodes=episodes, concurrency=level, backend=env, sample_memory=False, floor_samples=0,
                        adaptive_starts=a,
                    )  # fmt: skip
                )
                rates[adaptive] = result.episodes_per_second
            rounds.append({"concurrency": level, "adaptive_eps": rates[True], "fixed_eps": rates[False],
                           "ratio": round(rates[True] / rates[False], 4)})  # fmt: skip
    summary = {
        str(level): {
            "ratio_median": statistics.median(r["ratio"] for r in rounds if r["concurrency"] == level),
            "ratio_min": min(r["ratio"] for r in rounds if r["concurrency"] == level),
            "ratio_max": max(r["ratio"] for r in rounds if r["concurrency"] == level),
        }
        for level in levels
    }
    return {"env": env, "episodes": episodes, "repeats": repeats, "rounds": rounds, "summary": summary}
