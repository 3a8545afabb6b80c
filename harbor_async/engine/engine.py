"""The engine: a task group of sandbox lifecycles with limits, a ledger and clean teardown."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import anyio
from anyio.abc import TaskGroup, TaskStatus

from harbor_async.backends import BackendSpec, resolve_backend
from harbor_async.core.collector import TUNING
from harbor_async.core.errors import EngineClosedError
from harbor_async.core.logs import get_logger
from harbor_async.core.naming import new_run_label
from harbor_async.core.policy import Limits, RetryPolicy, Timeouts
from harbor_async.core.results import TRUNCATION_MARKER
from harbor_async.core.stats import EngineStats, StatsRecorder
from harbor_async.engine.budget import Budget, LocalBudget
from harbor_async.engine.sandbox import Sandbox, SandboxContext
from harbor_async.tasks.host_variables import compose_fills, with_allowed_env
from harbor_async.tasks.mounts import check_backend as check_mounts
from harbor_async.tasks.mounts import normalized, refuse_mounting_options
from harbor_async.tasks.overrides import TaskOverrides
from harbor_async.tasks.suite import load_task
from harbor_async.verification.disk_bounds import DiskLimits

if TYPE_CHECKING:
    from concurrent.futures import Future

    import httpx
    from harbor.models.task.task import Task

    from harbor_async.models.capture import CaptureProxy

T = TypeVar("T")


class LoopHost(Protocol):
    """The loop thread an engine runs on when it is not its caller's (:class:`harbor_async.engine.loop.LoopThread`)."""

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop and block for its result (from another thread)."""
        ...

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Schedule ``fn(*args)`` on the loop; a future at once (from another thread)."""
        ...

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the loop thread."""
        ...


class Engine:
    """Runs Harbor sandbox lifecycles as structured-concurrency tasks.

    Use it as ``async with Engine(...) as engine:`` in async code, or let
    :func:`harbor_async.engine.loop.open_engine` run it on the shared loop thread.
    Leaving the block (or :meth:`aclose`) stops every live sandbox.

    Args:
        limits: live sandboxes, create rate, concurrent execs.
        timeouts: per-phase budgets and the episode deadline.
        retry: the start retry policy.
        max_output: characters of exec output kept (``None``: all).
        truncation_marker: appended to cut output.
        run_label: label carried by every sandbox (default: a fresh one).
        backend_kwargs: extra constructor arguments for every Harbor environment.
        reap_stale: remove the sandboxes that dead processes left on this machine
            (:func:`harbor_async.backends.reaper.reap_stale`): local ones and trial
            folders as the engine opens, docker ones beside its first docker sandbox's start.
        docker_overlay: give Harbor's docker sandboxes a Compose overlay with
            run labels and an init process (stops take 0.2 s instead of 10 s);
            see :mod:`harbor_async.backends.docker.overlay`.
        budget: makes the sandbox budget from ``limits`` on the engine's loop
            (default: :class:`~harbor_async.engine.budget.LocalBudget`, this process's limits).
        env_allow: host variables a task's ``${VAR}`` may read (default none;
            see :mod:`harbor_async.tasks.host_variables`).
        strict_verify: end every process the agent left running before the
            verifier starts (default on: the verifier runs alone; off, services the
            agent started stay up for the tests, as in Harbor); see
            :mod:`harbor_async.verification.isolation`.
        disk_limits: what one episode and one job folder may copy to the host
            (default: 2048 MiB and 50 GiB; see :mod:`harbor_async.verification.disk_bounds`).
        force_build: ask the backend to build each task's environment again at
            its start (Harbor's ``force_build``; the docker fast start builds
            each image once per process then).
        delete: Harbor's ``delete`` (``--delete``): at the close, delete what
            the sandboxes' stops kept for later starts (the docker fast start's
            task images, :meth:`~harbor_async.backends.docker.fast_start.FastStartDockerEnvironment.delete_kept_builds`);
            not at each stop, since the run's other sandboxes start from them.
            Containers and volumes are removed at every stop either way.
        mounts: host paths mounted into every sandbox but a separate verifier's
            (harbor run's ``--mounts``), checked by :func:`harbor_async.tasks.mounts.normalized`:
            each read-only, unless ``mounts_writable`` (``--mounts-writable``) lets one
            that does not say ``read_only`` be writable; a backend that cannot honour
            them is refused at launch.
        verify: run each episode's verifier (default); off, as harbor run's
            ``--disable-verification``, the agent runs and its artifacts are
            collected, and the record is not judged (no reward, not rerun).
        task_overrides: what the run sets on every task it starts (harbor
            run's ``--override-*``, ``--artifact``, ``--ve``; see
            :mod:`harbor_async.tasks.overrides`).
        agent_env: variables over every command of the agent phase (harbor run's
            ``--ae``), never the verifier's; literal (the driver fills a
            ``${VAR}`` from its own allowed host variables:
            :func:`harbor_async.tasks.host_variables.fill_values`), so a cluster's workers
            get the driver's values.
        resource_telemetry: read what each sandbox used (CPU seconds, peak
            memory, disk written, processes) just before its stop, into its
            record's ``resources`` (default on; :mod:`harbor_async.core.usage`).
            The seconds each sandbox existed are counted either way.
    """

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        max_output: int | None = 8000,
        truncation_marker: str = TRUNCATION_MARKER,
        run_label: str | None = None,
        backend_kwargs: Mapping[str, Any] | None = None,
        reap_stale: bool = False,
        docker_overlay: bool = True,
        budget: Callable[[Limits], Budget] | None = None,
        env_allow: Collection[str] = (),
        strict_verify: bool = True,
        verify: bool = True,
        trials_dir: str | Path | None = None,
        disk_limits: DiskLimits | None = None,
        force_build: bool = False,
        delete: bool = False,
        mounts: Sequence[Mapping[str, Any]] = (),
        mounts_writable: bool = False,
        task_overrides: TaskOverrides | None = None,
        agent_env: Mapping[str, str] | None = None,
        resource_telemetry: bool = True,
    ) -> None:
        self.limits = limits or Limits()
        self.timeouts = timeouts or Timeouts()
        self.retry = retry or RetryPolicy()
        self.max_output = max_output
        self.truncation_marker = truncation_marker
        self.run_label = run_label or new_run_label()
        self.backend_kwargs = dict(backend_kwargs or {})
        self.reap_stale = reap_stale
        self._docker_reaped = not reap_stale  # the daemon's leftovers go at the first docker sandbox (launch)
        self.docker_overlay = docker_overlay
        self.env_allow = frozenset(env_allow)
        self.strict_verify = strict_verify
        self.verify = verify
        self.disk_limits = disk_limits or DiskLimits()
        self.force_build = force_build
        self.delete = delete
        self._kept: dict[type, set[str]] = {}  # environment class -> what its sandboxes' stops kept (see delete)
        # Checked again here (every caller's, not only the CLI's), read-only unless ``mounts_writable`` lets one not be.
        self.mounts = normalized(list(mounts), writable=mounts_writable)
        self.task_overrides = task_overrides or TaskOverrides()
        self.agent_env = dict(agent_env or {})
        self.resource_telemetry = resource_telemetry
        #: the job folder where each episode keeps a Harbor trial folder: its agent and verifier logs and its
        #: artifacts (``None``: nothing kept; see harbor_async.jobs.harbor_layout and harbor_async.verification.artifacts)
        self.trials_dir = Path(trials_dir) if trials_dir is not None else None
        #: the loop thread this engine runs on when it is not the caller's (``harbor_async.engine.loop``): other threads and
        #: other event loops reach its episodes through it (``None``: the engine runs in the caller's own loop)
        self.host: LoopHost | None = None
        #: the episodes begun on this engine and not yet collected; its close ends those still running, so a
        #: driver that owns no task of theirs (the shim, at interpreter exit) still gets their records
        self.episodes: weakref.WeakSet[Any] = weakref.WeakSet()
        self._budget_factory = budget
        self._ledger: dict[str, Sandbox] = {}
        self._stats = StatsRecorder()
        self._log = get_logger(run=self.run_label)
        self._tg: TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self._closing = False
        self._closed: anyio.Event | None = None
        self._drained = anyio.Event()
        self._close_requested: anyio.Event | None = None
        self._context: SandboxContext | None = None
        self._holds: dict[tuple[type, str], Callable[[], None]] = {}  # (backend class, run label) -> its release
        self._specs: dict[str, BackendSpec] = {}  # backend name -> its spec, one shared by the sandboxes
        #: (upstream URL, its key, what each request asks for) -> the capture proxy serving it until the engine closes
        self._captures: dict[tuple[str, str | None, str, int], CaptureProxy] = {}
        self._capture_lock = anyio.Lock()

    # ── lifecycle of the engine itself ──────────────────────────────────

    async def __aenter__(self) -> Engine:
        if self._stack is not None:
            raise RuntimeError("an Engine can be entered only once")
        self._closed = anyio.Event()
        self._close_requested = anyio.Event()
        self._context = SandboxContext(
            run_label=self.run_label,
            timeouts=self.timeouts,
            retry=self.retry,
            max_output=self.max_output,
            truncation_marker=self.truncation_marker,
            budget=self._budget_factory(self.limits) if self._budget_factory else LocalBudget(self.limits),
            stats=self._stats,
            on_done=self._forget,
            start_options={"docker_overlay": self.docker_overlay, "force_build": self.force_build, "mounts": self.mounts,
                           "env_allow": sorted(self.env_allow)},
            strict_verify=self.strict_verify,
            agent_env=self.agent_env,
            resource_telemetry=self.resource_telemetry,
        )
        if self.reap_stale:
            from harbor_async.backends.reaper import reap_stale_once

            await anyio.to_thread.run_sync(lambda: reap_stale_once(backend_kwargs=self.backend_kwargs))
        self._stack = AsyncExitStack()
        self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self.aclose()
            close_budget = getattr(self._context.budget, "close", None) if self._context else None
            if close_budget is not None:  # a cluster budget gives its leases back now, not at exit
                await anyio.to_thread.run_sync(close_budget)
        finally:
            stack, self._stack = self._stack, None
            if self._tg is not None:
                self._tg.cancel_scope.cancel()
            if stack is not None:
                await stack.__aexit__(*exc_info)
            if self._closed is not None:
                self._closed.set()

    async def serve(self, *, task_status: TaskStatus[Engine] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the engine until :meth:`request_close`; for ``portal.start_task``."""
        async with self:
            task_status.started(self)
            await cast(anyio.Event, self._close_requested).wait()  # set by __aenter__

    def request_close(self) -> None:
        """Ask :meth:`serve` to close the engine (call on the loop)."""
        if self._close_requested is not None:
            self._close_requested.set()

    async def aclose(self) -> None:
        """Stop every live sandbox (shielded, bounded by the stop budget); idempotent."""
        if self._closing:
            with anyio.CancelScope(shield=True):
                await self._drained.wait()
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            sandboxes = list(self._ledger.values())
            if sandboxes:
                self._log.info("engine.close", live=len(sandboxes))
            try:
                async with anyio.create_task_group() as tg:
                    for episode in self._held_episodes():  # recorded as interrupted, and stopped
                        tg.start_soon(episode.end)
                    for sandbox in sandboxes:
                        tg.start_soon(sandbox.stop)
                holds, self._holds = list(self._holds.values()), {}
                for release in holds:
                    await _off_loop(release)
                if self.delete:
                    await self._delete_kept()
            finally:  # a second close waits for this one: it must never wait for ever
                self._drained.set()
        self.request_close()

    def _held_episodes(self) -> list[Any]:
        """The episodes not yet finished (another thread may add one meanwhile: a shim's ``reset()``)."""
        while True:
            try:
                return [e for e in list(self.episodes) if not e.finished]
            except RuntimeError:  # the set changed size while it was copied: copy it again
                continue

    async def capture_proxy(
        self,
        upstream_base_url: str,
        upstream_api_key: str | None = None,
        request_extra: Mapping[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> CaptureProxy:
        """The engine's capture proxy in front of the model server ``upstream_base_url`` (call on the loop).

        One per upstream (URL, key, ``request_extra`` and ``transport``, an in-process upstream), started on
        first use and serving in the engine's task group until the engine closes; each episode opens its own
        session on it.

        Raises:
            EngineClosedError: the engine is closing or closed.
        """
        from harbor_async.models.capture import CaptureProxy

        key = (upstream_base_url, upstream_api_key, repr(sorted((request_extra or {}).items())), id(transport))
        async with self._capture_lock:  # two episodes asking at once get the same proxy, once it listens
            proxy = self._captures.get(key)
            if proxy is None:
                if self._tg is None or self._closing:
                    raise EngineClosedError("the engine is not running")
                proxy = CaptureProxy(
                    upstream_base_url, upstream_api_key=upstream_api_key, request_extra=request_extra, transport=transport
                )
                await self._tg.start(proxy.serve)
                self._captures[key] = proxy
        return proxy

    @property
    def closed(self) -> bool:
        """Whether the engine takes no more sandboxes."""
        return self._closing

    # ── sandboxes ───────────────────────────────────────────────────────

    def launch(
        self,
        task: Task | str | Path,
        backend: str | BackendSpec = "local",
        *,
        backend_kwargs: Mapping[str, Any] | None = None,
        episode_timeout: float | None = None,
        host_mounts: bool = True,
    ) -> Sandbox:
        """Schedule a sandbox's start in the background and return it at once.

        Call on the loop. The start waits for a live-sandbox slot and a create
        turn, then retries transient failures; :meth:`Sandbox.wait_started`
        returns when it is up (or raises its start error).

        Raises:
            BackendError: the backend cannot be loaded, or (as
                :class:`~harbor_async.core.errors.BackendOptionsError`) does not take
                the options: nothing is started.
            TaskEnvError: the task's ``${VAR}`` names a host variable not in
                ``env_allow``, with no default: nothing is started.
            MountError: the engine's ``mounts`` on a backend that cannot honour them: nothing is started.
        """
        if self._tg is None or self._closing:
            raise EngineClosedError("the engine is not running (closed, or not entered)")
        if isinstance(task, (str, Path)):
            task = load_task(task)
        if isinstance(backend, BackendSpec):
            spec = backend
        else:
            found = self._specs.get(backend) if isinstance(backend, str) else None
            if found is None:
                found = resolve_backend(backend)
                self._specs[backend] = found
            spec = found
        spec.check_async_library()  # a bad import path or library fails here, not in the background
        options = {**self.backend_kwargs, **(backend_kwargs or {})}
        spec.check_options(options)  # so do options the backend does not take
        refuse_mounting_options(options)  # Harbor's own host mounts (writable, unchecked): only ours, --mounts
        cls = spec.environment_class()
        check_mounts(cls, spec.name, self.mounts)  # a backend that cannot honour --mounts: nothing starts
        task = self.task_overrides.apply(task)  # the run's flags over every task, wherever it was loaded
        task = with_allowed_env(task, self.env_allow, compose=compose_fills(cls))  # raises TaskEnvError: nothing starts
        # What the backend keeps warm for this run (e.g. the local backend's ready sandboxes), under the label
        # its sandboxes get (the user's ``run_label`` option, if given, else the engine's).
        label = str(options.get("run_label") or self.run_label)
        if (cls, label) not in self._holds and hasattr(cls, "engine_hold"):
            self._holds[(cls, label)] = cls.engine_hold(label)
        sandbox = Sandbox(
            cast(SandboxContext, self._context),  # set while running (checked above)
            task,
            spec,
            backend_kwargs=options,
            episode_timeout=episode_timeout,
            start_options=None if host_mounts else {"mounts": []},
        )
        self._ledger[sandbox.id] = sandbox
        TUNING.add()  # the collector's young threshold follows the ledger (harbor_async.core.collector)
        self._stats.launched += 1
        if not self._docker_reaped and spec.uses_docker:
            self._docker_reaped = True  # beside the starts: they make sandboxes of a live owner, which it leaves alone
            self._tg.start_soon(self._reap_docker, name="reap stale docker sandboxes")
        self._tg.start_soon(sandbox.run_start, name=f"start {sandbox.id}")
        return sandbox

    async def _reap_docker(self) -> None:
        from harbor_async.backends.reaper import reap_stale_once

        await anyio.to_thread.run_sync(lambda: reap_stale_once(backend_kwargs=self.backend_kwargs, docker=True))

    def stop_soon(self, sandbox: Sandbox) -> None:
        """Schedule ``sandbox``'s stop in the background (call on the loop)."""
        if sandbox.done or self._closing:  # a closing engine stops every sandbox itself
            return
        if self._tg is None:
            raise EngineClosedError("the engine is not running")
        self._tg.start_soon(sandbox.stop, name=f"stop {sandbox.id}")

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any, name: str | None = None) -> None:
        """Run ``fn(*args)`` in the engine's task group (call on the loop); for work that outlives its caller.

        Raises:
            EngineClosedError: the engine is closing or closed (it stops its sandboxes itself).
        """
        if self._tg is None or self._closing:
            raise EngineClosedError("the engine is not running")
        self._tg.start_soon(fn, *args, name=name)  # type: ignore[arg-type]  # anyio takes any awaitable; typed for coroutines

    @asynccontextmanager
    async def sandbox(
        self,
        task: Task | str | Path,
        backend: str | BackendSpec = "local",
        **kwargs: Any,
    ) -> AsyncIterator[Sandbox]:
        """A started sandbox for the block; stopped on the way out, even on cancellation.

        Only the sandbox: no agent, no verdict, no record (an episode is
        :class:`harbor_async.episodes.episode.Episode`, run by :func:`harbor_async.episodes.runner.run_episode`).
        """
        sandbox = self.launch(task, backend, **kwargs)
        try:
            await sandbox.wait_started()
            yield sandbox
        finally:
            await sandbox.stop()

    def episode(
        self, task: Task | str | Path, backend: str | BackendSpec = "local", **kwargs: Any
    ) -> AbstractAsyncContextManager[Sandbox]:
        """Deprecated name of :meth:`sandbox` (it yields a sandbox, not an episode); goes in the next release."""
        warnings.warn(
            "Engine.episode() is Engine.sandbox(): it yields a Sandbox, not an episode; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.sandbox(task, backend, **kwargs)

    def live_sandboxes(self) -> list[Sandbox]:
        """The ledger: every sandbox launched and not yet confirmed stopped."""
        return list(self._ledger.values())

    def stats(self) -> EngineStats:
        """A snapshot of the counters, latency percentiles and the start window."""
        budget = self._context.budget if self._context is not None else None
        return self._stats.snapshot(budget.start_window() if budget is not None else None)

    def _forget(self, sandbox: Sandbox) -> None:
        if self._ledger.pop(sandbox.id, None) is not None:  # once per sandbox: its stop runs once
            TUNING.remove()
        if sandbox.kept_build is not None:
            self._kept.setdefault(sandbox.backend.environment_class(), set()).add(sandbox.kept_build)

    async def _delete_kept(self) -> None:
        """``delete``: what the sandboxes' stops kept goes now; one left (in use elsewhere) is a warning, not an error."""
        kept, self._kept = self._kept, {}
        for cls, builds in kept.items():
            delete = getattr(cls, "delete_kept_builds", None)
            if delete is None:
                continue
            try:
                left = await _off_loop(delete, sorted(builds))
            except Exception as exc:  # noqa: BLE001 - the run's results stand; the builds stay, said once
                left = [f"{len(builds)} kept builds: {exc!r}"]
            if left:
                self._log.warning("delete: builds left", left=left)


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread (blocking work off the loop), or here at interpreter shutdown (no threads)."""
    try:
        return await anyio.to_thread.run_sync(fn, *args)
    except RuntimeError:  # no new threads at interpreter shutdown
        return fn(*args)
