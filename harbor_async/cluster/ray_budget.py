"""``RayBudget``: a :class:`~harbor_async.engine.budget.Budget` that leases from the cluster's budget actor.

Wire it into an engine with the factory::

    from harbor_async.cluster import ray_budget

    engine = Engine(limits=Limits(live_sandboxes=8),
                    budget=ray_budget.factory(max_live=20, creates_per_second=5))

``Engine(budget=...)`` calls the factory on the engine's loop with the
engine's :class:`~harbor_async.core.policy.Limits`: the process-local limits still
apply first, then the cluster's. The shim does this for
``HarborSpec(..., budget="ray", cluster_max_live=20)``, the CLI for
``--budget ray --max-live 20``.

Two lease modes:

- ``batch=None`` (``run``/``eval``: every episode needs one sandbox): one
  lease per sandbox; a waiting start holds nothing.
- ``batch=n``: the process leases ``n`` slots all or nothing on its first
  start, its sandboxes use them, and the block goes back when its last
  sandbox stops. Independent processes (jobs, evals) then take turns instead
  of each holding part of a batch; a batch above the cluster cap raises
  :class:`~harbor_async.cluster.errors.BatchExceedsCapError` at once.
  The ranks of one torch.distributed/accelerate run cannot take turns: they
  meet in collectives between a batch's start and its reward, so every rank's
  batch must be live at once. Their engines meet at the actor when they open
  (``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE`` name the run) and, if the
  batches add up to more than the cap, every rank fails at once with
  :class:`~harbor_async.cluster.errors.WorldExceedsCapError` naming the cap
  and each rank's batch, instead of hanging in the first step.

A daemon thread sends a heartbeat every ``lease_timeout / 6`` seconds; the
actor takes back the leases of a holder silent for ``lease_timeout``.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import socket
import sys
import threading
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import anyio
import sniffio

from harbor_async.cluster.budget_actor import DEFAULT_LEASE_TIMEOUT, Caps, get_or_create
from harbor_async.cluster.connect import (
    DEFAULT_ACTOR_NAME,
    DEFAULT_NAMESPACE,
    node_name,
)
from harbor_async.cluster.errors import (
    BatchExceedsCapError,
    LeaseExpiredError,
    WorldExceedsCapError,
    WorldRendezvousError,
)
from harbor_async.cluster.ranks import World, current_world
from harbor_async.core.logs import get_logger
from harbor_async.core.policy import Limits
from harbor_async.engine.budget import LocalBudget
from harbor_async.engine.start_window import StartOutcome, StartTicket

if TYPE_CHECKING:
    from harbor_async.jobs.settings import JobSettings

log = get_logger()


async def _resolve(ref: Any) -> Any:
    """Await a Ray object ref from any anyio loop (cancelling stops only the wait)."""
    if sniffio.current_async_library() == "asyncio":
        return await asyncio.wrap_future(ref.future())
    import ray

    return await anyio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)


class RayBudget:
    """Process-local limits, then leases from the cluster's budget actor.

    Make it with :func:`factory` (on the engine's loop). ``holder`` names this
    process's leases in the ledger.
    """

    def __init__(self, actor: Any, limits: Limits, *, batch: int | None = None, caps: dict[str, Any]) -> None:
        if batch is not None and batch < 1:
            raise ValueError(f"batch must be a positive integer or None, got {batch!r}")
        self.actor = actor
        # The start window is the actor's, shared by every process: none of this process's own.
        self.adaptive_starts = limits.adaptive_starts
        self.local = LocalBudget(replace(limits, adaptive_starts=False))
        self._window: int | None = None
        self.batch = batch
        self.caps = caps
        self.live_limit = caps["max_live"] if caps["max_live"] is not None else limits.live_sandboxes
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._info = {"pid": os.getpid(), "host": socket.gethostname(), "node": node_name(), "batch": batch or 1}
        self._leases: dict[int, str] = {}  # id(sandbox) -> lease (per-sandbox mode)
        self._block: str | None = None
        self._block_lock = anyio.Lock()
        self._block_slots = anyio.CapacityLimiter(batch) if batch else None
        self.expired = False
        self._register()
        self._heartbeat = _Heartbeat(self, interval=max(0.2, caps["lease_timeout"] / 6))
        self._heartbeat.start()

    # ── the Budget protocol ──────────────────────────────────────────────

    async def acquire_live(self, owner: Any) -> None:
        """A local slot, then a cluster lease (per sandbox, or this process's batch block)."""
        await self.local.acquire_live(owner)
        try:
            if self._block_slots is None:
                self._leases[id(owner)] = await self._lease(1, "live", _sandbox_row(owner))
                return
            await self._block_slots.acquire_on_behalf_of(owner)
            try:
                async with self._block_lock:
                    if self._block is None:
                        self._block = await self._lease(cast(int, self.batch), "live", None)  # set: _block_slots is
            except BaseException:
                self._block_slots.release_on_behalf_of(owner)
                self._maybe_return_block()
                raise
            self.actor.attach.remote(self._block, _sandbox_row(owner))
        except BaseException:
            self.local.release_live(owner)
            raise

    def release_live(self, owner: Any) -> None:
        """Give back the sandbox's lease (or its share of the block; the block goes when the last one does)."""
        try:
            if self._block_slots is None:
                lease = self._leases.pop(id(owner), None)
                if lease is not None:
                    self.actor.release.remote(lease)
            else:
                self._block_slots.release_on_behalf_of(owner)
                if self._block is not None:
                    self.actor.detach.remote(self._block, getattr(owner, "id", str(id(owner))))
                self._maybe_return_block()
        finally:
            self.local.release_live(owner)

    async def begin_start(self) -> StartTicket | None:
        """A place in the cluster's start window (one round trip to the actor), or ``None`` when starts are fixed."""
        if not self.adaptive_starts:
            return None
        request_id = uuid.uuid4().hex
        try:
            reply = await _resolve(self.actor.start_acquire.remote(self.holder, request_id))
        except BaseException:
            self.actor.start_cancel.remote(request_id)
            raise
        if reply.get("cancelled"):
            raise LeaseExpiredError(f"the budget actor dropped start {request_id} of {self.holder}")
        self._window = reply["window"]
        return StartTicket(anyio.current_time(), reply["epoch"], reply["window"], key=request_id)

    def end_start(
        self, ticket: StartTicket | None, outcome: StartOutcome, latency: float, latency_signal: bool = True
    ) -> None:
        """Tell the actor how the start ended (no wait for its answer)."""
        if ticket is not None:
            self.actor.start_release.remote(ticket.key, outcome.value, latency, latency_signal)

    def start_window(self) -> dict[str, Any] | None:
        """The shared window as this process last saw it (``None``: starts are fixed)."""
        return None if not self.adaptive_starts else {"window": self._window, "shared": True}

    async def create_turn(self) -> None:
        """The local create rate, then the cluster's token bucket."""
        await self.local.create_turn()
        if self.caps["creates_per_second"]:
            delay = await _resolve(self.actor.create_turn.remote())
            if delay > 0:
                await anyio.sleep(delay)

    def exec_slot(self) -> AbstractAsyncContextManager[Any]:
        """A local exec slot, then a cluster one when the cluster caps execs."""
        if not self.caps["concurrent_execs"]:
            return self.local.exec_slot()
        return self._cluster_exec()

    # ── the rest ─────────────────────────────────────────────────────────

    def join_world(self, world: World, group: str, timeout: float) -> None:
        """Meet the other ranks of a distributed run at the actor; refuse if their batches exceed the cap.

        Blocks (up to ``timeout``) until every rank opened its engine: ranks
        cannot take turns (see :class:`WorldExceedsCapError`), so a cap too
        small for all of them together fails on every rank, at once.
        """
        import ray

        reply = ray.get(
            self.actor.join_world.remote(group, world.size, world.rank, self.holder, self.batch or 1, timeout)
        )
        if "refused" in reply:
            refused = reply["refused"]
            raise WorldExceedsCapError(refused["cap"], refused["batch"], refused["batches"])
        if "timeout" in reply:
            raise WorldRendezvousError(
                f"only ranks {reply['timeout']} of {world.size} joined the cluster budget within {timeout:g} s"
            )

    def close(self) -> None:
        """Stop the heartbeat and give back every lease now (idempotent; also at interpreter exit)."""
        if self._heartbeat.stop():
            try:
                self.actor.unregister.remote(self.holder)
            except Exception:  # noqa: BLE001 - Ray may already be shut down at exit
                pass

    @asynccontextmanager
    async def _cluster_exec(self) -> AsyncIterator[None]:
        async with self.local.exec_slot():
            lease = await self._lease(1, "exec", None)
            try:
                yield
            finally:
                self.actor.release.remote(lease)

    async def _lease(self, n: int, pool: str, sandbox: dict[str, Any] | None) -> str:
        """Wait for ``n`` slots of ``pool`` at once; a cancelled wait is withdrawn at the actor.

        A holder the actor expired (its heartbeats stalled past the timeout)
        registers again and asks once more.
        """
        for _ in range(2):
            request_id = uuid.uuid4().hex
            ref = self.actor.acquire.remote(self.holder, request_id, n, pool, sandbox)
            try:
                reply = await _resolve(ref)
            except BaseException:
                self.actor.cancel.remote(request_id)  # ordered after the acquire: drops or releases it
                raise
            if "lease" in reply:
                return reply["lease"]
            if "refused" in reply:
                refused = reply["refused"]
                raise BatchExceedsCapError(refused["cap"], refused["batch"], refused["batches"])
            if not reply.get("expired"):
                break
            log.warning("cluster.lease_expired", holder=self.holder)
            self._forget_leases()
            await anyio.to_thread.run_sync(self._register)
        raise LeaseExpiredError(
            f"holder {self.holder} lost its leases (no heartbeat for {self.caps['lease_timeout']} s): {reply}"
        )

    def _forget_leases(self) -> None:
        """The actor took our leases back: stop counting on them (live sandboxes keep their local slots)."""
        self._leases.clear()
        self._block = None
        self.expired = False

    def _maybe_return_block(self) -> None:
        """Return the batch block once no sandbox of this process uses or waits for it."""
        slots = self._block_slots
        if self._block is None or slots is None:
            return
        if slots.borrowed_tokens == 0 and slots.statistics().tasks_waiting == 0:
            block, self._block = self._block, None
            self.actor.release.remote(block)

    def _register(self) -> None:
        import ray

        ray.get(self.actor.register.remote(self.holder, self._info))
        self.expired = False


class _Heartbeat(threading.Thread):
    """Tells the actor every ``interval`` seconds that the budget's process is alive.

    A thread, not a loop task: a busy or blocked loop must not cost the
    process its leases. It holds the budget weakly and ends with it.
    """

    def __init__(self, budget: RayBudget, interval: float) -> None:
        super().__init__(name=f"harbor-async-heartbeat-{budget.holder}", daemon=True)
        self._budget = weakref.ref(budget)
        self._actor, self._holder = budget.actor, budget.holder
        self._interval = interval
        self._stopped = threading.Event()
        atexit.register(self._at_exit)

    def run(self) -> None:
        import ray

        while not self._stopped.wait(self._interval):
            if sys.is_finalizing():  # the interpreter is going: atexit unregisters
                return
            if self._budget() is None:
                self._at_exit()
                return
            if not ray.is_initialized():  # disconnected: a call now would start a local Ray instance
                self.stop()
                return
            try:
                alive = ray.get(self._actor.heartbeat.remote(self._holder), timeout=self._interval * 3)
            except ray.exceptions.RayActorError:  # the actor is gone (killed): nobody to tell
                self.stop()
                return
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried; the timeout is generous
                log.warning("cluster.heartbeat_failed", holder=self._holder, error=str(exc))
                continue
            budget = self._budget()
            if not alive and budget is not None and not budget.expired:
                budget.expired = True
                log.warning("cluster.lease_expired", holder=self._holder)

    def stop(self) -> bool:
        """Stop beating; ``True`` the first time."""
        first = not self._stopped.is_set()
        self._stopped.set()
        return first

    def _at_exit(self) -> None:
        if self.stop():
            try:
                self._actor.unregister.remote(self._holder)
            except Exception:  # noqa: BLE001 - Ray may already be down at exit
                pass


def _sandbox_row(owner: Any) -> dict[str, Any]:
    backend = getattr(owner, "backend", None)
    context = getattr(owner, "context", None)
    return {
        "sandbox": getattr(owner, "id", None) or str(id(owner)),
        "backend": getattr(backend, "name", None),
        "run_label": getattr(context, "run_label", None),
    }


@dataclass(frozen=True)
class RayBudgetFactory:
    """``Engine(budget=RayBudgetFactory(...))``: joins (or creates) the actor on the engine's loop.

    Frozen and hashable, so that it can live in the shim's engine options.
    """

    address: str | None = None
    max_live: int | None = None
    creates_per_second: float | None = None
    concurrent_execs: int | None = None
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT
    batch: int | None = None
    namespace: str = DEFAULT_NAMESPACE
    name: str = DEFAULT_ACTOR_NAME
    rendezvous_timeout: float = 600.0

    def caps(self) -> Caps | None:
        """The caps to create the actor with; ``None`` (no cap given): join the running actor as it is."""
        if self.max_live is None and self.creates_per_second is None and self.concurrent_execs is None:
            return None
        return Caps(self.max_live, self.creates_per_second, self.concurrent_execs, self.lease_timeout)

    def __call__(self, limits: Limits) -> RayBudget:
        import ray

        actor = get_or_create(self.caps(), address=self.address, namespace=self.namespace, name=self.name)
        caps = ray.get(actor.get_caps.remote())
        if self.batch is not None and caps["max_live"] is not None and self.batch > caps["max_live"]:
            raise BatchExceedsCapError(caps["max_live"], self.batch)
        budget = RayBudget(actor, limits, batch=self.batch, caps=caps)
        world, group = current_world(), _world_group()
        if self.batch is not None and world.size > 1 and group is not None:
            try:
                budget.join_world(world, group, self.rendezvous_timeout)
            except BaseException:
                budget.close()
                raise
        return budget


def _world_group() -> str | None:
    """What names this distributed run for the actor: its rendezvous address (torchrun, accelerate)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return f"{addr}:{port}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('WORLD_SIZE', '')}"


def factory(
    *,
    address: str | None = None,
    max_live: int | None = None,
    creates_per_second: float | None = None,
    concurrent_execs: int | None = None,
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
    batch: int | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    name: str = DEFAULT_ACTOR_NAME,
) -> RayBudgetFactory:
    """A budget factory for ``Engine(budget=...)``: cluster caps (``None``: unlimited), lease mode, actor name.

    ``batch``: lease ``batch`` slots all or nothing per process (see the module
    doc); ``None``: one lease per sandbox.
    """
    return RayBudgetFactory(
        address, max_live, creates_per_second, concurrent_execs, lease_timeout, batch, namespace, name
    )


def job_budget(settings: JobSettings) -> RayBudgetFactory | None:
    """The ``Engine(budget=...)`` factory a job's settings ask for: ``None`` (this process's limits) or the cluster's.

    Here, not on the settings: the settings are read by the cluster's workers, so they import nothing of it.
    """
    if settings.budget != "ray":
        return None
    return factory(
        address=settings.ray_address, max_live=settings.cluster_max_live, creates_per_second=settings.cluster_creates_per_second
    )
