"""Episodes sharded over a Ray cluster: one engine per node in an async actor, records streamed to the driver.

The driver keeps the queue. Each worker (an :class:`EpisodeWorker` actor
pinned to one node) runs up to ``concurrency`` episodes at once in its own
:class:`~harbor_async.engine.engine.Engine`; each finished episode comes back as
one record, which the driver appends to the job folder at once (so the files
are those of a local run, and ``--resume`` works the same).

An episode is in flight on one worker at a time and is recorded only when its
worker returns it: a worker lost mid-run (node gone, process killed) fails
its in-flight calls, whose episodes go back to the front of the queue and
run on another worker; none is lost and none is recorded twice.

The episode function is any importable ``async def fn(engine, item) ->
EpisodeRecord`` (``run``- and ``eval``-style episodes alike): it and its
items are pickled to the workers, so the workers need the same code and the
task folders at the same paths (a shared file system, or the same image).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harbor_async.cluster.connect import DEFAULT_NAMESPACE, ensure_connected, import_ray
from harbor_async.cluster.errors import ClusterError, WorkerClosedError
from harbor_async.core.logs import get_logger
from harbor_async.core.records import EpisodeRecord
from harbor_async.engine.engine import Engine
from harbor_async.jobs.folder import JobFolder

log = get_logger()

EpisodeFn = Callable[[Any, Any], Awaitable[EpisodeRecord]]


class WorkersLostError(ClusterError):
    """Every worker was lost (and none could be started again) with episodes left to run."""


class EpisodeWorker:
    """One node's engine, as a Ray async actor; episodes run concurrently on the actor's loop."""

    def __init__(self, episode_fn: EpisodeFn, engine_kwargs: Mapping[str, Any]) -> None:
        self._fn = episode_fn
        self._engine_kwargs = dict(engine_kwargs)
        self._engine: Any = None
        self._holder: asyncio.Task | None = None  # the task the engine is open in, until close()
        self._closing: asyncio.Event | None = None
        self._opening = asyncio.Lock()  # bound to the actor's loop at its first use
        self._closed = False
        self._running: set[Any] = set()  # the cancel scopes of the episodes in flight
        self._stopping = False

    async def _ensure_engine(self) -> Any:
        # The actor runs several episodes at once: the first ones arrive together, and each must not
        # open an engine of its own (only the last would be closed; the others' warm sandboxes would
        # outlive the worker). Each call is a task of its own, so the engine is entered and left in
        # one task of its own (a task group is left in the task that entered it).
        async with self._opening:
            if self._closed:
                raise WorkerClosedError("this worker was closed: it opens no engine after close()")
            if self._engine is None:
                opened: asyncio.Future = asyncio.get_running_loop().create_future()
                self._closing = asyncio.Event()
                self._holder = asyncio.create_task(self._hold_engine(opened, self._closing))
                try:
                    self._engine = await opened
                except BaseException:
                    self._holder = None
                    raise
        return self._engine

    async def _hold_engine(self, opened: asyncio.Future, closing: asyncio.Event) -> None:
        try:
            async with Engine(**self._engine_kwargs) as engine:
                opened.set_result(engine)
                await closing.wait()
        except BaseException as exc:
            if opened.done():
                raise  # to close(), which waits for this task
            opened.set_exception(exc)

    async def run(self, item: Any) -> dict[str, Any]:
        """Run one episode; its record as plain JSON (an episode :meth:`stop` cancelled returns its record too)."""
        import anyio

        from harbor_async.episodes.runner import record_sink

        engine = await self._ensure_engine()
        kept: list[EpisodeRecord] = []
        token = record_sink.set(kept.append)  # the episode's own finally hands its record here
        try:
            with anyio.CancelScope() as scope:
                self._running.add(scope)
                if self._stopping:
                    scope.cancel()
                try:
                    kept.append(await self._fn(engine, item))
                finally:
                    self._running.discard(scope)
        finally:
            record_sink.reset(token)
        if not kept:  # an episode function that records nothing when cancelled
            raise WorkerClosedError("the episode was stopped before it had a record")
        return kept[-1].to_dict()

    async def stop(self) -> None:
        """Cancel the episodes running here (each records itself as cancelled) and any sent later."""
        self._stopping = True
        for scope in list(self._running):
            scope.cancel()

    async def close(self) -> None:
        """Stop the engine's sandboxes; later episodes raise :class:`WorkerClosedError`."""
        async with self._opening:  # an engine being opened is closed too
            self._closed = True
            holder, self._holder, self._engine = self._holder, None, None
            if holder is not None and self._closing is not None:
                self._closing.set()
                await holder

    def pid(self) -> int:
        """The worker's process id (tests kill it)."""
        return os.getpid()


@dataclass
class ShardStats:
    """What a sharded run did: episodes recorded, per worker, and the reruns a lost worker caused."""

    recorded: int = 0
    rerun: int = 0
    workers_lost: int = 0
    per_worker: dict[int, int] = field(default_factory=dict)


class ShardedRunner:
    """Runs episodes over the Ray cluster's nodes; use as a context manager (workers end on exit).

    Args:
        episode_fn: ``async def fn(engine, item) -> EpisodeRecord``, importable on the workers.
        engine_kwargs: keyword arguments of each worker's :class:`~harbor_async.engine.engine.Engine`
            (limits, timeouts, ``budget=ray_budget.factory(...)`` for one cap across nodes).
        address: the Ray cluster (``None``: ``RAY_ADDRESS`` or the local one).
        workers: how many workers (default: one per alive node), spread over the nodes.
        concurrency: episodes in flight per worker.
        max_restarts: workers started to replace lost ones before giving up.
        env_vars: environment variables set in each worker's process (what the driver read, such as the
            model server's key named by ``--api-key-name``: the workers' own environment may lack it).
    """

    def __init__(
        self,
        episode_fn: EpisodeFn,
        *,
        engine_kwargs: Mapping[str, Any] | None = None,
        address: str | None = None,
        workers: int | None = None,
        concurrency: int = 8,
        max_restarts: int = 4,
        namespace: str = DEFAULT_NAMESPACE,
        env_vars: Mapping[str, str] | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.episode_fn = episode_fn
        self.engine_kwargs = dict(engine_kwargs or {})
        self.address, self.namespace = address, namespace
        self.n_workers, self.concurrency, self.max_restarts = workers, concurrency, max_restarts
        self.env_vars = dict(env_vars or {})
        self.workers: dict[int, Any] = {}
        self.stats = ShardStats()
        self._next_id = 0
        self._ray: Any = None

    # ── workers ──────────────────────────────────────────────────────────

    def __enter__(self) -> ShardedRunner:
        self._ray = ensure_connected(self.address, self.namespace)
        nodes = self._nodes()
        for i in range(self.n_workers or len(nodes)):
            self._spawn(nodes[i % len(nodes)])
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker's engine (bounded), then end the actors."""
        ray = self._ray
        if ray is None:
            return
        closing = [worker.close.remote() for worker in self.workers.values()]
        ray.wait(closing, num_returns=len(closing), timeout=120)
        for worker in self.workers.values():
            ray.kill(worker)
        self.workers.clear()

    def _nodes(self) -> list[str]:
        alive = [n["NodeID"] for n in self._ray.nodes() if n.get("Alive")]
        if not alive:
            raise ClusterError("the Ray cluster has no alive node")
        return alive

    def _spawn(self, node_id: str) -> int:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        worker_id, self._next_id = self._next_id, self._next_id + 1
        self.workers[worker_id] = (
            self._ray.remote(EpisodeWorker)
            .options(
                num_cpus=0,  # episodes wait on sandboxes, not on this process's CPU
                max_concurrency=self.concurrency + 2,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True),
                **({"runtime_env": {"env_vars": self.env_vars}} if self.env_vars else {}),
            )
            .remote(self.episode_fn, self.engine_kwargs)
        )
        self.stats.per_worker[worker_id] = 0
        return worker_id

    def worker_pids(self) -> dict[int, int]:
        """Each worker's process id."""
        ray = self._ray
        return {wid: ray.get(worker.pid.remote()) for wid, worker in self.workers.items()}

    # ── the run ──────────────────────────────────────────────────────────

    def run(
        self,
        items: Iterable[tuple[str, Any]],
        *,
        job: JobFolder | None = None,
        on_record: Callable[[EpisodeRecord], None] | None = None,
        stop: threading.Event | None = None,
    ) -> dict[str, EpisodeRecord]:
        """Run every ``(key, item)`` once; records by key, appended to ``job`` as they arrive.

        Once ``stop`` is set (a signal, a failure budget), nothing more is sent;
        the episodes in flight are cancelled on their workers and their records
        (cancelled) still come back before this returns.

        Raises :class:`WorkersLostError` when no worker is left and none can be
        started; the records that arrived are in the job folder (resume it).
        """
        ray = import_ray()
        exceptions = _lost_worker_errors(ray)
        queue: deque[tuple[str, Any]] = deque(items)
        keys = [key for key, _ in queue]
        if len(set(keys)) != len(keys):
            raise ValueError("episode keys must be unique")
        in_flight: dict[Any, tuple[int, str, Any]] = {}
        load = dict.fromkeys(self.workers, 0)
        done: dict[str, EpisodeRecord] = {}
        restarts = 0
        stopping = False
        while queue or in_flight:
            if stop is not None and stop.is_set() and not stopping:
                stopping = True
                queue.clear()
                stops = [w.stop.remote() for w in self.workers.values()]
                if stops:
                    ray.wait(stops, num_returns=len(stops), timeout=30)
                if not in_flight:
                    break
            for wid in list(self.workers):  # fill every worker up to its concurrency, in turn
                while queue and load.get(wid, 0) < self.concurrency:
                    key, item = queue.popleft()
                    in_flight[self.workers[wid].run.remote(item)] = (wid, key, item)
                    load[wid] = load.get(wid, 0) + 1
            if not in_flight:
                if restarts >= self.max_restarts:
                    raise WorkersLostError(f"every worker was lost; {len(queue)} episodes were not run")
                restarts += 1
                self._spawn(self._nodes()[0])
                continue
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=0.5)  # short: a stop is seen soon
            for ref in ready:
                wid, key, item = in_flight.pop(ref)
                load[wid] -= 1
                try:
                    data = ray.get(ref)
                except Exception as exc:
                    if stopping:  # stopped before it had a record, or its worker went: a resume runs it
                        if not isinstance(exc, exceptions) and not isinstance(getattr(exc, "cause", None), WorkerClosedError):
                            log.warning("cluster.episode_failed_while_stopping", episode=key, error=repr(exc)[:300])
                        continue
                    if not isinstance(exc, exceptions):
                        raise
                    queue.appendleft((key, item))  # never recorded: run it again, elsewhere
                    self.stats.rerun += 1
                    if wid in self.workers:
                        del self.workers[wid]
                        self.stats.workers_lost += 1
                        log.warning("cluster.worker_lost", worker=wid, error=str(exc)[:200])
                    continue
                record = EpisodeRecord.from_dict(data)
                if key in done:  # cannot happen: an episode is in flight once; kept as a guard
                    continue
                done[key] = record
                self.stats.recorded += 1
                self.stats.per_worker[wid] += 1
                if job is not None:
                    job.append(record)
                if on_record is not None:
                    on_record(record)
        return done


def _lost_worker_errors(ray: Any) -> tuple[type[BaseException], ...]:
    """The errors that say the worker, not the episode, failed."""
    from ray.exceptions import (
        ActorDiedError,
        ActorUnavailableError,
        RayActorError,
        WorkerCrashedError,
    )

    return (RayActorError, ActorDiedError, ActorUnavailableError, WorkerCrashedError)


def run_on_cluster(
    episode_fn: EpisodeFn,
    items: Iterable[tuple[str, Any]],
    *,
    job: JobFolder | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    address: str | None = None,
    concurrency: int = 8,
    on_record: Callable[[EpisodeRecord], None] | None = None,
) -> dict[str, EpisodeRecord]:
    """One call for ``run --ray`` / ``eval --ray``: start one worker per node, run ``items``, end the workers.

    ``items`` are ``(episode key, picklable item)``; pass only the pending ones
    on a resume (``job.pending(keys)``). Records are appended to ``job`` as
    they arrive and returned by key.
    """
    with ShardedRunner(episode_fn, engine_kwargs=engine_kwargs, address=address, concurrency=concurrency) as runner:
        return runner.run(items, job=job, on_record=on_record)


async def run_on_cluster_async(
    episode_fn: EpisodeFn,
    items: Iterable[tuple[str, Any]],
    *,
    sink: Callable[[EpisodeRecord], None],
    budget: Any = None,
    stop: Callable[[Callable[[], None]], None] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    address: str | None = None,
    concurrency: int = 8,
    env_vars: Mapping[str, str] | None = None,
) -> dict[str, EpisodeRecord]:
    """:func:`run_on_cluster` from the driver's event loop, with the rules of a local batch.

    Each record goes to ``sink`` (the job folder: ``run``'s and ``eval``'s own
    writer) as it arrives, then to ``budget`` (a :class:`~harbor_async.episodes.runner.FailureBudget`):
    when it says stop, nothing more is sent and the episodes in flight are
    cancelled and recorded, as :func:`harbor_async.episodes.runner.run_suite` does on one
    engine. ``stop`` is given the function that starts that stop (the interrupt policy arms it).
    """
    import anyio

    stopping = threading.Event()
    if stop is not None:
        stop(stopping.set)

    def on_record(record: EpisodeRecord) -> None:
        sink(record)
        if budget is not None and budget.observe(record):
            stopping.set()

    return await anyio.to_thread.run_sync(
        functools.partial(
            _run_until_stopped, episode_fn, items, engine_kwargs=engine_kwargs, address=address,
            concurrency=concurrency, on_record=on_record, stop=stopping, env_vars=env_vars,
        )  # fmt: skip
    )


def _run_until_stopped(episode_fn: EpisodeFn, items: Iterable[tuple[str, Any]], *, stop: threading.Event, **kwargs: Any) -> dict[str, EpisodeRecord]:
    engine_kwargs, address, concurrency = kwargs.pop("engine_kwargs"), kwargs.pop("address"), kwargs.pop("concurrency")
    env_vars = kwargs.pop("env_vars", None)
    with ShardedRunner(
        episode_fn, engine_kwargs=engine_kwargs, address=address, concurrency=concurrency, env_vars=env_vars
    ) as runner:
        return runner.run(items, stop=stop, **kwargs)
