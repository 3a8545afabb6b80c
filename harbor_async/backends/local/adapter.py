"""The Harbor environment: ``LocalEnvironment``, a sandbox that commands join like ``docker exec``."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import posixpath
import shutil
import subprocess
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.models.task.config import EnvironmentConfig, HealthcheckConfig
from harbor.models.trial.paths import TrialPaths

from harbor_async.backends.local.cleanup import abandon, stale_mount
from harbor_async.backends.local.dockerfile import DockerfileSpec, parse_dockerfile
from harbor_async.backends.local.enter_server import open_join
from harbor_async.backends.local.errors import ExecTimeoutError
from harbor_async.backends.local.healthcheck import run_healthcheck
from harbor_async.backends.local.images import image_mismatch
from harbor_async.backends.local.keeper import Keeper, Tools, find_tools
from harbor_async.backends.local.layout import (
    BASE_ENV,
    DEFAULT_MEMORY_MB,
    DEFAULT_OUTPUT_LIMIT,
    DEFAULT_PIDS,
    DEFAULT_STORAGE_MB,
    RUN_LABEL_ENV,
    SPECIAL_DIRS,
    SYSTEM_DIRS,
    VERIFIER_EXTRA_CAPS,
    under,
)
from harbor_async.backends.local.limits import (
    Cgroups,
    ResourceLimits,
    UidLease,
    cgroup_version,
    exec_groups,
    parse_limit,
)
from harbor_async.backends.local.loader_files import reset_loader_files
from harbor_async.backends.local.output import MAX_ADOPTED, OUTPUT_SINK, OutputPipe
from harbor_async.backends.local.pool import (
    POOL,
    Piece,
    build_piece,
    discard_piece,
    start_keeper,
)
from harbor_async.backends.local.proctree import end_exec
from harbor_async.backends.local.rootfs import (
    apply_copy,
    check_task_paths,
    chown_made,
    host_path,
    remove_sandbox_folder,
)
from harbor_async.backends.local.sandboxing import Confinement, host_binds, join_spec
from harbor_async.backends.local.template import task_entries, write_entries
from harbor_async.backends.local.transfers import (
    DEFAULT_TRANSFER_LIMIT_MB,
    SandboxTransfers,
)
from harbor_async.backends.local.usage import cgroup_usage, used_bytes
from harbor_async.backends.local.verifier_ns import VerifierNamespace
from harbor_async.core.naming import (
    DEFAULT_LOCAL_ROOT,
    LOCAL_ROOT_ENV,
    MARKER_NAME,
    local_folder_name,
)
from harbor_async.core.offload import off_loop
from harbor_async.core.printing import escape_controls
from harbor_async.core.usage import ResourceUsage
from harbor_async.tasks.resources import cap, host_cpus, host_memory_mb
from harbor_async.verification.isolation import HIDDEN_SUFFIX

#: Set to 0 to stop open engines keeping local sandboxes ready ahead of starts (see ``engine_hold``).
POOL_ENV = "HARBOR_ASYNC_LOCAL_POOL"
#: Seconds a killed exec's cgroup waits (in a worker thread) for its processes to be reaped before it is removed.
KILLED_GROUP_WAIT = 2.0


_WARNED: set[tuple[str, tuple[str, ...]]] = set()  # (environment folder, what it ignores) already warned of


class LocalEnvironment(SandboxTransfers, VerifierNamespace, BaseEnvironment):
    """A Harbor environment on bubblewrap: one long-lived sandbox, commands join it.

    Constructor keywords, besides Harbor's own (all optional; from Harbor's CLI
    pass them as ``--ek key=value``):

    - ``sandbox_root``: base folder of the sandbox folders (default
      ``$HARBOR_ASYNC_LOCAL_ROOT`` or ``/tmp/harbor-async-local``).
    - ``run_label``: names the run in folder names and markers, so a reaper can
      tell runs apart (default ``$HARBOR_ASYNC_RUN_LABEL`` or ``"adhoc"``).
    - ``memory_mb``, ``cpus``, ``storage_mb``: defaults of the per-sandbox
      limits when ``task.toml``'s ``[environment]`` does not state them
      (4096 MB, no CPU quota, 2048 MB); ``pids_limit``: processes (1024).
    - ``output_limit``: bytes of each exec stream kept, head and tail halves
      (1 MiB; what falls between is counted and dropped).
    - ``require_limits``: as root, a sandbox whose cgroups (memory, CPU,
      processes) cannot be made fails to start (``LimitUnavailableError``)
      instead of running unlimited (default true; false: warn and run with
      rlimits only).
    - ``transfer_limit_mb``: the most one download may bring to the host,
      counting apparent sizes (512 MiB; past it the download fails with
      ``TransferLimitError``).
    - ``allow_offline``: run tasks whose ``network_mode`` is ``"public"`` without
      network (a sandbox has none; by default such a task is refused).

    Harbor's own ``mounts`` (``--mounts``) are bound by bwrap, read-only where they say so.
    """

    #: written with anyio only: safe to drive from trio as well as asyncio.
    ANYIO_NATIVE = True
    #: what of ``--mounts`` it can bind, checked before a run starts (harbor_async.tasks.mounts.check_backend)
    check_host_mounts = staticmethod(host_binds)

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: TrialPaths,
        task_env_config: EnvironmentConfig,
        logger: logging.Logger | None = None,
        *,
        sandbox_root: str | Path | None = None,
        run_label: str | None = None,
        memory_mb: int | str | None = DEFAULT_MEMORY_MB,
        cpus: float | str | None = None,
        storage_mb: int | str | None = DEFAULT_STORAGE_MB,
        pids_limit: int | str | None = DEFAULT_PIDS,
        output_limit: int | str | None = DEFAULT_OUTPUT_LIMIT,
        transfer_limit_mb: int | str | None = DEFAULT_TRANSFER_LIMIT_MB,
        require_limits: bool | str = True,
        allow_offline: bool | str = False,  # read by the run's task check (harbor_async.agents.task_checks)
        **kwargs: Any,
    ) -> None:
        base = Path(sandbox_root or os.environ.get(LOCAL_ROOT_ENV) or DEFAULT_LOCAL_ROOT)
        self.run_label: str = run_label or os.environ.get(RUN_LABEL_ENV) or "adhoc"
        self._base = base.absolute()
        self._root = self._base / local_folder_name(self.run_label, session_id)
        self._fs = self._root / "fs"
        self._spec = DockerfileSpec()
        self._workdir = "/"
        self._running: dict[int, Any] = {}  # exec helper pid -> process (anyio Process or ServedProcess)
        self._adopted: collections.deque[tuple[int, object]] = collections.deque()  # pipes of returned execs
        self._launching = 0  # processes being spawned, not yet in _running / _keeper
        self._keeper: Keeper | None = None
        self._keeper_finalizer: weakref.finalize[Any, Any] | None = None
        self._tools: Tools | None = None
        self._started = False
        self._marker_live = False  # the marker may be (re)written: between start and stop
        # Markers are written in worker threads (a file write is milliseconds under load, not the loop's to wait
        # for): one at a time, the newest snapshot last, none once the stop has begun.
        self._marker_lock = threading.Lock()
        self._marker_seq = self._marker_written = 0
        self._warned_user = False
        self._created_at = ""
        self._defaults = ResourceLimits(
            pids=parse_limit(pids_limit, int), memory_mb=parse_limit(memory_mb, int),
            cpus=parse_limit(cpus, float), storage_mb=parse_limit(storage_mb, int),
        )  # fmt: skip
        self._output_limit = parse_limit(output_limit, int)
        limit_mb = parse_limit(transfer_limit_mb, int)
        self._transfer_limit = None if limit_mb is None else limit_mb * 2**20
        self._require_limits = require_limits not in (False, "false", "False", "0", 0)
        self._root_fd: int | None = None  # the sandbox's root, for transfers (hostfs)
        self._private_dirs: dict[str, int] = {}  # the verifier's own folders (verifier_ns)
        self._verifier_mnt: int | None = None  # the verifier's mount namespace, while it runs
        self._confinement: Confinement | None = None
        self._uid_lease: UidLease | None = None
        self._mount: Path | None = None  # the sandbox's tmpfs (as root), fs/ links to it
        self._disk_at_start: int | None = None  # bytes in use on that tmpfs when the start was done
        super().__init__(
            environment_dir, environment_name, session_id, trial_paths, task_env_config,
            logger=logger, **kwargs,
        )  # fmt: skip
        self._binds = host_binds(self._host_mounts)  # Harbor's mounts (--mounts): bound by the keeper

    # -- Harbor's description of this backend --------------------------------

    @staticmethod
    def type() -> str:
        """Harbor environment type name."""
        return "local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        """No network at all (so "no-network" tasks are honoured); no mounts of Harbor's output folders."""
        return EnvironmentCapabilities(disable_internet=True, mounted=False)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        """CPU and memory limits where this process can make cgroups (root); fractional CPUs."""
        limited = cgroup_version() is not None
        return EnvironmentResourceCapabilities(cpu_limit=limited, memory_limit=limited, fractional_cpus=True)

    @property
    def limits(self) -> ResourceLimits:
        """This sandbox's limits: ``task.toml``'s ``[environment]`` values, else the backend's defaults."""
        config, task = self.task_env_config, self.environment_name
        memory = host_memory_mb()  # no more than this host has (the task may ask for 1e8 MB)
        return ResourceLimits(
            pids=self._defaults.pids,
            memory_mb=cap("memory_mb", config.memory_mb or self._defaults.memory_mb, memory, task),
            cpus=cap("cpus", config.cpus or self._defaults.cpus, host_cpus(), task),
            storage_mb=cap("storage_mb", config.storage_mb or self._defaults.storage_mb, memory, task),
        )

    @property
    def host_uid(self) -> int:
        """The host uid that root inside this sandbox is (the caller's own without root)."""
        if self._confinement is not None and self._confinement.uid is not None:
            return self._confinement.uid
        return os.getuid()

    @property
    def root(self) -> Path:
        """The sandbox's folder on the host (marker file + ``fs/``)."""
        return self._root

    @property
    def workdir(self) -> str:
        """Default working directory of ``exec`` (task workdir, else WORKDIR, else ``/``)."""
        return self._workdir

    @property
    def ignored(self) -> list[str]:
        """What of the task's environment definition this backend does not honour."""
        return list(self._spec.ignored)

    def _validate_definition(self) -> None:
        """Read the optional Dockerfile; warn once about everything not honoured.

        Raises:
            TaskPathEscapeError: the task's instruction, tests, solution or
                environment is a symlink out of the task folder.
        """
        task_dir = self.environment_dir.parent
        if (task_dir / "task.toml").is_file():
            check_task_paths(task_dir)
        dockerfile = self.environment_dir / "Dockerfile"
        text = ""
        if dockerfile.is_file():
            text = dockerfile.read_text()
            self._spec = parse_dockerfile(text, BASE_ENV)
        ignored = self._spec.ignored
        mismatch = image_mismatch(text, self.task_env_config.docker_image)
        if mismatch is not None:
            ignored.append(mismatch)
        for step in list(self._spec.copies):
            if under(step.dest, SYSTEM_DIRS + SPECIAL_DIRS):
                self._spec.copies.remove(step)
                ignored.append(f"line {step.line}: COPY into read-only {step.dest}")
        workdir = self._spec.workdir or "/"
        if under(workdir, SYSTEM_DIRS + SPECIAL_DIRS):
            ignored.append(f"WORKDIR {workdir} (read-only host folder; using /)")
            workdir = "/"
        self._workdir = self.task_env_config.workdir or workdir
        if (self.environment_dir / "docker-compose.yaml").exists():
            ignored.append("docker-compose.yaml (single sandbox only)")
        if self.task_env_config.docker_image and not dockerfile.is_file():
            ignored.append(f"docker_image {self.task_env_config.docker_image} (host /usr is used)")
        if ignored and (key := (str(self.environment_dir), tuple(ignored))) not in _WARNED:  # once a process
            _WARNED.add(key)
            self.logger.warning(  # the task's names and lines, made safe to print
                "local environment %s ignores %d item(s) of its definition: %s",
                escape_controls(self.environment_name), len(ignored), escape_controls("; ".join(ignored)),
            )  # fmt: skip

    # -- lifecycle ------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        """Take a ready sandbox (:mod:`.pool`) or make one, then apply the Dockerfile (milliseconds; no image).

        Raises:
            SandboxBuildFailedError: ``bwrap``, ``setpriv`` or ``prlimit`` is
                missing, or bubblewrap cannot create the sandbox.
            LimitUnavailableError: cgroups are required and cannot be made.
        """
        self._tools = tools = find_tools()
        limits = self.limits
        try:
            if self._root.exists():  # left by a killed run with the same label and session
                self.logger.warning("removing stale local sandbox %s", self._root)
                await anyio.to_thread.run_sync(remove_sandbox_folder, self._root, stale_mount(self._root))
            key = (str(self._base), self.run_label, limits, self._require_limits, self._binds)
            with POOL.building_own():
                piece = POOL.take(key, tools)
                if piece is None:
                    # Shielded: a cancelled start must not leave a sandbox being built behind.
                    with anyio.CancelScope(shield=True):
                        piece = await anyio.to_thread.run_sync(
                            build_piece, self._root, self.run_label, limits, self._require_limits, tools,
                            self.session_id, self._binds,
                        )  # fmt: skip
            self._adopt(piece)  # type: ignore[arg-type]  # built if None (nothing cancels that scope); no await since the build: from here on stop() removes it
            await self._save_marker()
            await anyio.to_thread.run_sync(self._apply_task)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._end_keeper()
                await anyio.to_thread.run_sync(self._teardown, True)
            raise
        self._started = True
        await self._save_marker()
        # Prebuilt-image tasks without a Dockerfile ship loose files for the workdir.
        await self._upload_environment_dir_after_start()
        self._disk_at_start = used_bytes(self._mount)  # what the sandbox writes is counted from here

    async def resource_usage(self) -> ResourceUsage | None:
        """What the sandbox used so far, from its cgroups and its tmpfs root (:mod:`.usage`); ``None`` without root."""
        confinement = self._confinement
        if confinement is None:
            return None
        return await anyio.to_thread.run_sync(cgroup_usage, confinement.cgroups, self._mount, self._disk_at_start)

    def _adopt(self, piece: Piece) -> None:
        """Make ``piece`` this sandbox's: its folder is renamed to ours, its resources are ours to free."""
        if piece.folder != self._root:
            try:
                piece.folder.rename(self._root)
            except OSError:
                discard_piece(piece)
                raise
            piece.folder = self._root
        self._confinement, self._uid_lease, self._mount = piece.confinement, piece.lease, piece.mount
        self._keeper, self._root_fd = piece.keeper, piece.root_fd
        self._created_at = piece.created_at
        self._marker_live = True
        self._guard_keeper()

    def _guard_keeper(self) -> None:
        """An environment dropped without ``stop()`` ends its keeper (a finalizer)."""
        assert self._keeper is not None
        self._keeper_finalizer = weakref.finalize(self, abandon, self._keeper, self._confinement, self._mount, self._uid_lease)
        # At exit the engine stops its sandboxes (a finalizer would kill them
        # first); what is left then dies with this process (--die-with-parent).
        self._keeper_finalizer.atexit = False

    def _apply_task(self) -> None:
        """The task's part of the root: its WORKDIR and COPY lines, given to the sandbox's uid.

        While an engine holds the pool for this run, that part is read once
        per task from its second start on (:func:`.template.task_entries`, as Docker builds a
        task's image once per run) and written by plain calls; else it is
        copied here.
        """
        uid = self._sandbox_uid()
        entries = None
        if POOL.holds(self.run_label):
            entries = task_entries(self.run_label, self.environment_dir, self._spec.copies, self._workdir)
        if entries is not None:
            write_entries(self._mount or self._fs, entries, uid)
            return
        made = [host_path(self._fs, "/", self._workdir, writable=True)]
        made[0].mkdir(parents=True, exist_ok=True)
        for step in self._spec.copies:
            apply_copy(self._fs, self.environment_dir, step, "/")
            made.append(host_path(self._fs, "/", step.dest, writable=True))
        if uid is not None:  # the base tree is the sandbox's already; only what was made here
            chown_made(self._fs, made, uid)

    @classmethod
    def engine_hold(cls, run_label: str) -> Callable[[], None]:
        """Keep sandboxes of ``run_label`` ready ahead of starts until the returned function is called.

        An engine holds its run's label while open (:mod:`.pool`): a start then
        takes a sandbox made ahead (folder, uid, cgroups, tmpfs, keeper) and
        applies only its task's files. ``HARBOR_ASYNC_LOCAL_POOL=0`` turns it
        off: each start then builds its sandbox itself.
        """
        if os.environ.get(POOL_ENV, "").strip().lower() in ("0", "false", "no", "off"):
            return lambda: None
        return POOL.hold(run_label)

    async def _end_keeper(self) -> None:
        """Kill the sandbox's PID 1 (the kernel then kills every process in its PID namespace)."""
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return
        if self._keeper_finalizer is not None:
            self._keeper_finalizer.detach()
        keeper.kill_init()
        # The outer bwrap reaps its child and exits; kill it only if it lingers
        # (killed first, it would leave the init to the host's init as a zombie).
        with anyio.move_on_after(5):
            await keeper.wait()
        if keeper.process.returncode is None:
            keeper.process.kill()
            await keeper.wait()
        # Closing the last descriptor of a namespace frees it in the kernel (a mount namespace waits for RCU): off the loop.
        await off_loop(keeper.close)

    async def _end_processes(self) -> None:
        """Kill every process of the sandbox, its PID 1 included; call shielded."""
        # A process being spawned now would escape the kill (or join an old
        # namespace), and an nsenter must not find the namespace files closed
        # (their numbers reused); spawns take milliseconds, so wait for them.
        with anyio.move_on_after(5):  # never hang on one
            while self._launching:
                await anyio.sleep(0.005)
        if self._keeper is not None:
            self._keeper.kill_init()
        for process in list(self._running.values()):
            await end_exec(process, self._procs_files())  # it ends with its command, killed with the namespace
        await self._end_keeper()  # no nsenter is running now: the namespace files may be closed

    async def end_agent_processes(self) -> None:
        """End every process of the sandbox before the verifier: a new PID namespace over the same files.

        The keeper's PID 1 is killed, so the kernel kills every process in its
        namespace, whatever the agent attached to by ptrace, re-parented or hid
        under the init; a new keeper then starts over the same root, cgroups
        and uid, as ``docker restart`` keeps a container's files. What lived
        only in the old namespaces goes with them: ``/dev/shm``, listeners on
        the sandbox's loopback, IPC objects. Before the new init starts, the
        loader's files the agent could have written (``/etc/ld.so.preload``,
        ``/etc/ld.so.cache``) are put back to the host's (:mod:`.loader_files`).

        Raises:
            RuntimeError: the sandbox is not started.
            SandboxBuildFailedError: the new keeper could not start (the host's failure).
        """
        if not self._started or self._keeper is None or self._tools is None or self._confinement is None:
            raise RuntimeError(f"local sandbox {self.session_id} is not started")
        with anyio.CancelScope(shield=True):  # half done, the sandbox would have no keeper
            await self._end_processes()
            # No process of the sandbox runs now: the new init must not load a library the agent named.
            if self._root_fd is not None:
                changed = await anyio.to_thread.run_sync(reset_loader_files, self._root_fd, self._sandbox_uid())
                if changed:
                    self.logger.info("local sandbox %s: before the verifier, %s put back to the host's (the "
                                     "agent's kept as *%s)", self.session_id, ", ".join(changed), HIDDEN_SUFFIX)
            piece = Piece(folder=self._root, confinement=self._confinement, mount=self._mount)
            await anyio.to_thread.run_sync(functools.partial(start_keeper, piece, self._tools, restart=True))
            self._keeper = piece.keeper
            self._guard_keeper()
            await self._save_marker()

    def _sandbox_uid(self) -> int | None:
        """The host uid files made for the sandbox belong to (None: the caller's, root inside already)."""
        return self._confinement.uid if self._confinement is not None else None

    def _procs_files(self) -> list[str]:
        """The sandbox's ``cgroup.procs`` files, which hold every process of its execs (none without cgroups)."""
        confinement = self._confinement
        if confinement is None or confinement.cgroups is None:
            return []
        folders = confinement.cgroups.folders
        return [*confinement.cgroups.procs_files, *(str(g / "cgroup.procs") for g in exec_groups(folders))]

    def _teardown(self, delete: bool) -> None:
        """Remove the cgroups, unmount and (``delete``) remove the folder, release the uid (no process left)."""
        if self._root_fd is not None:  # an open fd would keep the tmpfs busy
            os.close(self._root_fd)
            self._root_fd = None
        confinement, self._confinement = self._confinement, None
        if confinement is not None and confinement.cgroups is not None:
            left = confinement.cgroups.remove()
            if left:
                self.logger.warning("local sandbox %s: cgroups not removed: %s", self.session_id, left)
        if delete:
            remove_sandbox_folder(self._root, self._mount)
            self._mount = None
        if self._uid_lease is not None:
            self._uid_lease.release()
            self._uid_lease = None

    async def stop(self, delete: bool = True) -> None:
        """Kill every process of this sandbox and (``delete``) remove its folder.

        Killing the keeper ends the sandbox's PID namespace: every process in
        it dies, background processes included; running execs return 137.
        Idempotent. With ``delete=False`` the folder stays for inspection.
        """
        self._started = False
        # An exec finishing during the removal must not write its marker back (one being written finishes first).
        with self._marker_lock:
            self._marker_live = False
        with anyio.CancelScope(shield=True):  # teardown must finish even when cancelled
            await self._end_processes()
            try:
                await anyio.to_thread.run_sync(self._teardown, delete)
            except RuntimeError:  # no new threads at interpreter shutdown
                self._teardown(delete)
            if not delete and self._root.exists():
                self.logger.info("local sandbox kept at %s", self._root)

    # -- commands ---------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` with bash (sh without bash) inside the running sandbox.

        The command joins the sandbox's namespaces, so what it starts in the
        background keeps running after it returns. Every command runs as root;
        ``user`` is accepted and ignored (warned once). Past ``timeout_sec``, or
        when the caller cancels it, everything the command started is killed
        (by its own cgroup's ``cgroup.kill`` where the host has one, daemons
        that left its tree included; else its session, its process group and
        every descendant), not what earlier execs left running.

        Raises:
            ExecTimeoutError: past ``timeout_sec`` (the process tree is killed first).
            RuntimeError: the sandbox is not started, or its keeper has died.
        """
        if not self._started or self._keeper is None:
            raise RuntimeError(f"local sandbox {self.session_id} is not started")
        if not self._keeper.alive():
            raise RuntimeError(
                f"local sandbox {self.session_id} is gone: its init process (the keeper) has exited"
            )
        user = self._resolve_user(user)
        if user not in (None, 0, "0", "root") and not self._warned_user:
            self._warned_user = True
            self.logger.warning("local environment runs every command as root, not %r", user)
        variables = {**BASE_ENV, **self._spec.env, **(self._merge_env(env) or {})}
        workdir = posixpath.join(self._workdir, cwd or self._workdir)
        shell = _shell()
        cgroups = self._confinement.cgroups if self._confinement is not None else None
        out, err = OutputPipe(self._output_limit), OutputPipe(self._output_limit)
        kill_group: Path | None = None
        self._launching += 1  # no await since the _started check: stop() waits for this
        try:
            with anyio.CancelScope(shield=True):  # a cancelled spawn must not leak a process (or a cgroup)
                # A cgroup's mkdir waits for the kernel's cgroup lock, which a neighbour's fork bomb can hold: off the loop.
                kill_group = await off_loop(cgroups.exec_group) if cgroups is not None else None
                spec = self._join(variables, workdir, [shell, "-c", command], kill_group=kill_group)
                # Own session: the whole tree can be found and killed without touching ours.
                process = await open_join(spec, stdin=subprocess.DEVNULL, stdout=out.write_fd, stderr=err.write_fd)
        except BaseException:
            out.close()
            err.close()
            if kill_group is not None:
                with anyio.CancelScope(shield=True):
                    await off_loop(Cgroups.drop_exec_group, kill_group)
            raise
        finally:
            self._launching -= 1
            out.close_write_end()
            err.close_write_end()
        self._running[process.pid] = process  # no await since the launch: stop() sees it
        with anyio.CancelScope(shield=True):  # its pid recorded for a reaper before anything can end the exec
            await self._save_marker()
        ended = False
        try:
            with anyio.move_on_after(timeout_sec or None) as deadline:
                async with anyio.create_task_group() as group:
                    group.start_soon(out.pump)
                    group.start_soon(err.pump)
                    await process.wait()
                    # The shell has ended. Background processes it started may
                    # hold the pipes open for ever: do not wait for their EOF.
                    group.cancel_scope.cancel()
                ended = True
        finally:
            with anyio.CancelScope(shield=True):
                if not ended:  # timed out or cancelled
                    await end_exec(process, self._procs_files(), kill_group=kill_group)
                await process.aclose()
                if kill_group is not None:  # a killed exec's processes leave its group as they are reaped: wait for them
                    await off_loop(Cgroups.drop_exec_group, kill_group, 0.0 if ended else KILLED_GROUP_WAIT)
            self._running.pop(process.pid, None)
            for pipe in (out, err):
                pipe.settle()
            self._adopted.extend(OUTPUT_SINK.adopt([pipe.read_fd for pipe in (out, err) if not pipe.eof]))
            if len(self._adopted) > MAX_ADOPTED:  # host descriptors stay bounded: the oldest go
                OUTPUT_SINK.drop([self._adopted.popleft() for _ in range(len(self._adopted) - MAX_ADOPTED)])
            for pipe in (out, err):
                if pipe.eof:
                    pipe.close()
            with anyio.CancelScope(shield=True):
                await self._save_marker()
        stdout, stderr = out.text(), err.text()
        if deadline.cancelled_caught:
            raise ExecTimeoutError(timeout_sec or 0, stdout, stderr)
        code = process.returncode or 0
        # Killed by a signal (stop() during the command): report it like a shell.
        return ExecResult(stdout=stdout, stderr=stderr, return_code=128 - code if code < 0 else code)

    def _join(self, env: dict[str, str], cwd: str, command: list[str], kill_group: Path | None = None) -> dict[str, Any]:
        """The ``enter.py`` SPEC that runs ``command`` inside the sandbox (joining ``kill_group``, the exec's own cgroup)."""
        assert self._keeper is not None and self._tools is not None and self._confinement is not None
        if self._verifier_mnt is not None:  # the verifier's: its own namespace, one capability more
            return join_spec(
                self._keeper, self._confinement, env, cwd, command,
                mnt=self._verifier_mnt, extra_caps=VERIFIER_EXTRA_CAPS, kill_group=kill_group,
            )  # fmt: skip
        return join_spec(self._keeper, self._confinement, env, cwd, command, kill_group=kill_group)

    async def run_healthcheck(self, healthcheck: HealthcheckConfig | None = None) -> None:
        """Harbor's healthcheck loop, with anyio sleeps so that it also runs under trio."""
        await run_healthcheck(self, healthcheck if healthcheck is not None else self.task_env_config.healthcheck)

    # -- bookkeeping ------------------------------------------------------------

    async def _save_marker(self) -> None:
        """Record who owns this sandbox and which processes run it, for a reaper (written in a worker thread)."""
        if not self._marker_live:
            return
        self._marker_seq += 1
        await off_loop(self._store_marker, self._marker(), self._marker_seq)

    def _store_marker(self, marker: dict[str, Any], seq: int) -> None:
        """Write ``marker`` unless the stop has begun or a newer one is written already."""
        with self._marker_lock:
            if not self._marker_live or seq <= self._marker_written:
                return
            temporary = self._root / f"{MARKER_NAME}.tmp"
            temporary.write_text(json.dumps(marker))
            temporary.replace(self._root / MARKER_NAME)  # atomic: a reaper never reads half
            self._marker_written = seq

    def _marker(self) -> dict[str, Any]:
        """The marker's content now (read on the loop, where the state changes)."""
        return {
            "run_label": self.run_label,
            "session_id": self.session_id,
            "environment_name": self.environment_name,
            "created_at": self._created_at,
            "owner_pid": os.getpid(),
            # the sandbox's bwrap (host pid) and its PID 1 as the host sees it:
            # killing the latter ends every process of the sandbox
            "keeper_pid": self._keeper.process.pid if self._keeper is not None else None,
            "keeper_init_pid": self._keeper.init_pid if self._keeper is not None else None,
            "pids": sorted(self._running),  # the nsenter of each running exec
            "host_uid": self._confinement.uid if self._confinement is not None else None,
            "cgroups": [str(f) for f in self._confinement.cgroups.folders]
            if self._confinement is not None and self._confinement.cgroups is not None
            else [],
            "mount": str(self._mount) if self._mount is not None else None,
        }


@functools.cache
def _shell() -> str:
    """The shell each exec runs its command with: bash where the host has one (the sandbox sees the host's), else sh."""
    return "bash" if shutil.which("bash") else "sh"

