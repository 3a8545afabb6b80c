"""The cluster budget: one named, detached Ray actor that every engine of the cluster leases from.

It holds the live-sandbox cap, the create rate (a token bucket), the
concurrent-exec cap and the ledger of live sandboxes (holder process, node,
sandbox id, backend). Holders are processes (an engine's
:class:`~harbor_async.cluster.ray_budget.RayBudget`); each sends a heartbeat,
and a holder silent for longer than ``lease_timeout`` loses every lease it
held, so a killed rank never keeps quota.

Leases are granted first come, first served, and a lease of ``n`` slots is
all or nothing: a request waits until ``n`` slots are free at once and holds
none while it waits. That is what keeps ranks from deadlocking on a cap below
the sum of their batches (see :class:`~harbor_async.cluster.errors.BatchExceedsCapError`
for the one request that can never be granted and is refused at once).

The class is plain Python on asyncio (Ray runs it as an async actor); Ray is
needed only by :func:`get_or_create`. Replies are plain dicts, not raised
exceptions, so that the client raises its own typed errors.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from harbor_async.cluster.connect import (
    DEFAULT_ACTOR_NAME,
    DEFAULT_NAMESPACE,
    ensure_connected,
)
from harbor_async.cluster.errors import ClusterBudgetConfigError
from harbor_async.core.token_bucket import TokenBucket
from harbor_async.engine.start_window import StartOutcome, StartTicket, StartWindow

#: Seconds a holder may stay silent before its leases are taken back (sized for
#: a busy 2-core machine: a heartbeat thread can stall for seconds under load).
DEFAULT_LEASE_TIMEOUT = 30.0
#: Orphans kept for ``sandboxes list --ray`` (oldest dropped first).
MAX_ORPHANS = 1000


@dataclass(frozen=True)
class Caps:
    """The cluster-wide limits (``None``: unlimited) and the lease timeout."""

    max_live: int | None = None
    creates_per_second: float | None = None
    concurrent_execs: int | None = None
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT

    def __post_init__(self) -> None:
        for name in ("max_live", "concurrent_execs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.creates_per_second is not None and not self.creates_per_second > 0:
            raise ValueError(f"creates_per_second must be positive or None, got {self.creates_per_second!r}")
        if not self.lease_timeout > 0:
            raise ValueError(f"lease_timeout must be positive, got {self.lease_timeout!r}")


@dataclass
class _Request:
    request_id: str
    holder: str
    n: int
    future: asyncio.Future


@dataclass
class _Lease:
    lease_id: str
    holder: str
    n: int
    pool: str
    since: float
    request_id: str
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)


class _Pool:
    """``capacity`` slots granted all-or-nothing per request, strictly in arrival order."""

    def __init__(self, name: str, capacity: int | None) -> None:
        self.name = name
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.queue: deque[_Request] = deque()

    def free(self) -> float:
        return float("inf") if self.capacity is None else self.capacity - self.used

    def take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)


class BudgetActor:
    """The state behind the named actor; every method runs on the actor's event loop."""

    def __init__(self, caps: dict[str, Any]) -> None:
        self.caps = Caps(**caps)
        self.pools = {"live": _Pool("live", self.caps.max_live), "exec": _Pool("exec", self.caps.concurrent_execs)}
        self.holders: dict[str, dict[str, Any]] = {}
        self.leases: dict[str, _Lease] = {}
        self.granted: dict[str, str] = {}  # request id -> lease id (a cancel after the grant releases it)
        self.orphans: deque[dict[str, Any]] = deque(maxlen=MAX_ORPHANS)
        self.expired_holders = 0
        self.grants = 0
        self._creates = TokenBucket(rate=0.0, burst=1.0, tokens=1.0, refilled=time.monotonic())
        self._reaper: asyncio.Task | None = None
        self.worlds: dict[str, dict[str, Any]] = {}  # distributed runs: group -> size, members, event
        self.start_window: StartWindow | None = None  # made on the first start that asks for it
        self.start_tickets: dict[str, tuple[str, StartTicket]] = {}  # request id -> (holder, ticket)
        self.start_waits: dict[str, asyncio.Task] = {}

    # ── configuration ────────────────────────────────────────────────────

    def get_caps(self) -> dict[str, Any]:
        """The caps in force."""
        return asdict(self.caps)

    def set_caps(self, caps: dict[str, Any]) -> dict[str, Any]:
        """Change the caps (a larger cap wakes waiters; a smaller one takes effect as leases end)."""
        self.caps = Caps(**caps)
        self.pools["live"].capacity = self.caps.max_live
        self.pools["exec"].capacity = self.caps.concurrent_execs
        for pool in self.pools.values():
            self._grant(pool)
        return self.get_caps()

    # ── holders and heartbeats ───────────────────────────────────────────

    def register(self, holder: str, info: dict[str, Any]) -> dict[str, Any]:
        """Make ``holder`` known (pid, node, host, batch); returns the caps."""
        self._ensure_reaper()
        self.holders[holder] = {**info, "holder": holder, "seen": time.monotonic(), "registered": time.time()}
        return self.get_caps()

    def heartbeat(self, holder: str) -> bool:
        """``holder`` is alive; ``False`` if it is unknown (expired): it must register again."""
        entry = self.holders.get(holder)
        if entry is None:
            return False
        entry["seen"] = time.monotonic()
        return True

    def unregister(self, holder: str) -> int:
        """A clean exit: give back everything ``holder`` holds; returns the leases freed."""
        leases = sum(1 for lease in self.leases.values() if lease.holder == holder)
        self._drop_holder(holder, orphan=False)
        return leases

    def reap(self, older_than: float | None = None) -> list[dict[str, Any]]:
        """Expire holders silent for ``older_than`` seconds (default: the lease timeout) now.

        Returns the sandboxes they held (now orphans: the quota is back, the
        sandboxes themselves may still exist at the provider).
        """
        limit = self.caps.lease_timeout if older_than is None else older_than
        now = time.monotonic()
        rows: list[dict[str, Any]] = []
        for holder, entry in list(self.holders.items()):
            if now - entry["seen"] > limit:
                rows += self._drop_holder(holder, orphan=True)
                self.expired_holders += 1
        return rows

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.caps.lease_timeout / 4))
            self.reap()

    def _drop_holder(self, holder: str, *, orphan: bool) -> list[dict[str, Any]]:
        """Take back every lease and request of ``holder``; returns the sandboxes it held."""
        self.holders.pop(holder, None)
        for group, world in list(self.worlds.items()):
            world["members"] = {r: m for r, m in world["members"].items() if m["holder"] != holder}
            if not world["members"]:
                del self.worlds[group]
            elif len(world["members"]) < world["size"] and world["event"].is_set():
                world["event"] = asyncio.Event()  # a restarted rank waits for the others again
        rows: list[dict[str, Any]] = []
        for lease in [lease for lease in self.leases.values() if lease.holder == holder]:
            rows += [{**row, "orphaned": time.time()} for row in lease.sandboxes.values()]
            self._release(lease.lease_id)
        if orphan:
            self.orphans.extend(rows)
        for request_id in [r for r, (h, _) in self.start_tickets.items() if h == holder]:
            self.start_release(request_id, StartOutcome.FAILED.value, 0.0)
        for pool in self.pools.values():
            for request in [r for r in pool.queue if r.holder == holder]:
                pool.queue.remove(request)
                if not request.future.done():
                    request.future.set_result({"expired": True})
            self._grant(pool)
        return rows

    # ── distributed runs ─────────────────────────────────────────────────

    async def join_world(
        self, group: str, size: int, rank: int, holder: str, batch: int, timeout: float
    ) -> dict[str, Any]:
        """Wait until all ``size`` ranks of ``group`` joined, then check that their batches fit the cap together.

        Replies ``{"ok": True}``, ``{"refused": {cap, batch (the sum), batches}}``
        or ``{"timeout": [ranks that joined]}``.
        """
        world = self.worlds.setdefault(group, {"size": size, "members": {}, "event": asyncio.Event()})
        world["members"][rank] = {"holder": holder, "batch": batch}
        if len(world["members"]) >= world["size"]:
            world["event"].set()
        try:
            await asyncio.wait_for(world["event"].wait(), timeout)
        except TimeoutError:
            return {"timeout": sorted(world["members"])}
        batches = {f"rank {r}": m["batch"] for r, m in sorted(world["members"].items())}
        total = sum(batches.values())
        cap = self.caps.max_live
        if cap is not None and total > cap:
            return {"refused": {"cap": cap, "batch": total, "batches": batches}}
        return {"ok": True}

    # ── leases ───────────────────────────────────────────────────────────

    async def acquire(
        self, holder: str, request_id: str, n: int = 1, pool: str = "live", sandbox: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Wait until ``n`` slots of ``pool`` are free at once and lease them to ``holder``.

        Replies ``{"lease": id}``; ``{"refused": ...}`` for a batch larger than
        the cap (it could never be granted); ``{"expired": True}`` when the
        holder is unknown (its leases were taken back: register again).
        """
        self._ensure_reaper()
        if holder not in self.holders:
            return {"expired": True}
        slots = self.pools[pool]
        if slots.capacity is not None and n > slots.capacity:
            batches = {lease.holder: lease.n for lease in self.leases.values() if lease.pool == pool} | {
                r.holder: r.n for r in slots.queue
            }
            return {"refused": {"cap": slots.capacity, "batch": n, "batches": batches, "pool": pool}}
        future = asyncio.get_running_loop().create_future()
        slots.queue.append(_Request(request_id, holder, n, future))
        self._grant(slots)
        reply = await future
        if "lease" in reply and sandbox:
            self.leases[reply["lease"]].sandboxes[sandbox["sandbox"]] = self._row(holder, sandbox)
        return reply

    def cancel(self, request_id: str) -> int:
        """The client stopped waiting: drop the request, or release its lease if it was granted meanwhile."""
        for pool in self.pools.values():
            for request in pool.queue:
                if request.request_id == request_id:
                    pool.queue.remove(request)
                    if not request.future.done():
                        request.future.set_result({"cancelled": True})
                    self._grant(pool)  # a cancelled head no longer blocks those behind it
                    return 0
        lease_id = self.granted.get(request_id)
        return self._release(lease_id) if lease_id else 0

    def release(self, lease_id: str) -> int:
        """Give a lease back; returns the slots freed (0 if it was already gone)."""
        return self._release(lease_id)

    def attach(self, lease_id: str, sandbox: dict[str, Any]) -> bool:
        """Note a sandbox that lives under a (batch) lease, for the ledger."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        lease.sandboxes[sandbox["sandbox"]] = self._row(lease.holder, sandbox)
        return True

    def detach(self, lease_id: str, sandbox_id: str) -> bool:
        """Forget a sandbox of a lease (it stopped)."""
        lease = self.leases.get(lease_id)
        return lease is not None and lease.sandboxes.pop(sandbox_id, None) is not None

    def create_turn(self) -> float:
        """Reserve one create from the token bucket; returns the seconds the caller waits for it."""
        rate = self.caps.creates_per_second
        if not rate:
            return 0.0
        self._creates.rate, self._creates.burst = rate, max(1.0, rate)  # at most one second's worth at once
        return self._creates.reserve(time.monotonic())

    # ── the start window, shared by every holder ─────────────────────────

    async def start_acquire(self, holder: str, request_id: str) -> dict[str, Any]:
        """Wait for a place in the cluster's start window (:mod:`harbor_async.engine.start_window`).

        Replies ``{"epoch", "window"}``; ``{"cancelled": True}`` when
        :meth:`start_cancel` came first.
        """
        if self.start_window is None:
            self.start_window = StartWindow(self.caps.max_live, clock=time.monotonic)
        self.start_waits[request_id] = asyncio.current_task()  # type: ignore[assignment]  # an actor call runs as a task
        try:
            ticket = await self.start_window.acquire()
        except asyncio.CancelledError:
            return {"cancelled": True}
        finally:
            self.start_waits.pop(request_id, None)
        self.start_tickets[request_id] = (holder, ticket)
        return {"epoch": ticket.epoch, "window": ticket.window}

    def start_release(self, request_id: str, outcome: str, latency: float, latency_signal: bool = True) -> bool:
        """The start of ``request_id`` ended with ``outcome`` (a :class:`StartOutcome` value) after ``latency`` s."""
        entry = self.start_tickets.pop(request_id, None)
        if entry is None or self.start_window is None:
            return False
        self.start_window.release(entry[1], StartOutcome(outcome), latency, latency_signal=latency_signal)
        return True

    def start_cancel(self, request_id: str) -> bool:
        """The client stopped waiting: drop its wait, or its place if it was granted meanwhile."""
        task = self.start_waits.get(request_id)
        if task is not None:
            task.cancel()
            return True
        return self.start_release(request_id, StartOutcome.FAILED.value, 0.0)

    def start_state(self) -> dict[str, Any] | None:
        """The shared start window's state (``None`` before any start asked for it)."""
        return None if self.start_window is None else self.start_window.snapshot()

    def _grant(self, pool: _Pool) -> None:
        while pool.queue and pool.queue[0].n <= pool.free():
            request = pool.queue.popleft()
            if request.future.done():
                continue
            pool.take(request.n)
            lease_id = f"{pool.name}-{self.grants}"
            self.grants += 1
            self.leases[lease_id] = _Lease(
                lease_id, request.holder, request.n, pool.name, time.time(), request.request_id
            )
            self.granted[request.request_id] = lease_id
            request.future.set_result({"lease": lease_id})

    def _release(self, lease_id: str) -> int:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return 0
        self.granted.pop(lease.request_id, None)
        pool = self.pools[lease.pool]
        pool.used -= lease.n
        self._grant(pool)
        return lease.n

    def _row(self, holder: str, sandbox: dict[str, Any]) -> dict[str, Any]:
        info = self.holders.get(holder, {})
        return {
            "sandbox": sandbox.get("sandbox"),
            "backend": sandbox.get("backend"),
            "run_label": sandbox.get("run_label"),
            "holder": holder,
            "pid": info.get("pid"),
            "node": info.get("node"),
            "host": info.get("host"),
            "since": time.time(),
        }

    # ── what the CLI and tests read ──────────────────────────────────────

    def ledger(self) -> dict[str, Any]:
        """Live sandboxes, holders (with seconds since their last heartbeat) and orphans."""
        now = time.monotonic()
        holders = []
        for entry in self.holders.values():
            row = {k: v for k, v in entry.items() if k != "seen"}
            row["silent_s"] = round(now - entry["seen"], 3)
            row["slots"] = sum(lease.n for lease in self.leases.values() if lease.holder == entry["holder"])
            holders.append(row)
        live = [row for lease in self.leases.values() for row in lease.sandboxes.values()]
        return {"caps": self.get_caps(), "holders": holders, "sandboxes": live, "orphans": list(self.orphans)}

    def clear_orphans(self, sandbox_ids: list[str]) -> int:
        """Forget orphans that were removed (``sandboxes reap --ray``)."""
        keep = [row for row in self.orphans if row.get("sandbox") not in set(sandbox_ids)]
        removed = len(self.orphans) - len(keep)
        self.orphans = deque(keep, maxlen=MAX_ORPHANS)
        return removed

    def stats(self) -> dict[str, Any]:
        """Slots in use, their peak, waiting requests, holders and grants."""
        return {
            "caps": self.get_caps(),
            **{
                f"{name}_{key}": value
                for name, pool in self.pools.items()
                for key, value in (("used", pool.used), ("peak", pool.peak), ("waiting", len(pool.queue)))
            },
            "holders": len(self.holders),
            "leases": len(self.leases),
            "grants": self.grants,
            "expired_holders": self.expired_holders,
        }

    def reset_peaks(self) -> None:
        """Start the peaks afresh (benchmarks)."""
        for pool in self.pools.values():
            pool.peak = pool.used


def get_or_create(
    caps: Caps | None = None,
    *,
    address: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    name: str = DEFAULT_ACTOR_NAME,
) -> Any:
    """The budget actor named ``name`` in ``namespace``, created (detached) if missing.

    ``caps=None`` joins an existing actor with whatever caps it has (none
    running: :class:`ClusterBudgetConfigError`, as a cap must come from
    somewhere). An existing actor whose caps
    differ from ``caps`` raises :class:`ClusterBudgetConfigError`: two jobs
    must not silently disagree about what the provider allows. The actor needs
    no CPU and lives until killed (``ray.kill`` or the cluster's end).
    """
    ray = ensure_connected(address, namespace)
    if caps is None:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise ClusterBudgetConfigError(
                f"no budget actor {namespace}/{name} is running and no cap was given; "
                "give the cluster caps (--max-live, cluster_max_live=...) to create it"
            ) from None
    remote = ray.remote(BudgetActor).options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=100_000,  # every waiting acquire is one pending call
        max_restarts=0,
    )
    actor = remote.remote(asdict(caps))
    have = ray.get(actor.get_caps.remote())
    if have != asdict(caps):
        raise ClusterBudgetConfigError(
            f"the budget actor {namespace}/{name} already runs with caps {have}, not {asdict(caps)}; "
            "pass the same caps, none (join it as it is), or another name"
        )
    return actor
