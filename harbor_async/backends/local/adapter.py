"""The Harbor environment: ``LocalEnvironment``, a sandbox that commands join like ``docker exec``."""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import subprocess
import time
import weakref
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process
from harbor.environments.base import (
    BaseEnvironment,
    ExecResult,
    HealthcheckError,
    SandboxBuildFailedError,
)
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.models.task.config import EnvironmentConfig, HealthcheckConfig
from harbor.models.trial.paths import TrialPaths

from harbor_async.backends.local.dockerfile import CopyStep, DockerfileSpec, parse_dockerfile
from harbor_async.backends.local.errors import ExecTimeoutError, SandboxPathError
from harbor_async.backends.local.keeper import (
    Keeper,
    Tools,
    find_tools,
    sandbox_caps,
    spawn_from_keeper_thread,
)
from harbor_async.backends.local.layout import (
    BASE_ENV,
    KEEPER_INIT,
    KEEPER_START_TIMEOUT,
    RUN_LABEL_ENV,
    SANDBOX_CAPS,
    SANDBOX_DIRS,
    SPECIAL_DIRS,
    SYSTEM_DIRS,
    under,
)
from harbor_async.backends.local.output import OUTPUT_SINK, OutputPipe, read_available
from harbor_async.backends.local.proctree import end_exec
from harbor_async.files import remove_tree
from harbor_async.naming import DEFAULT_LOCAL_ROOT, LOCAL_ROOT_ENV, MARKER_NAME, local_folder_name


class LocalEnvironment(BaseEnvironment):
    """A Harbor environment on bubblewrap: one long-lived sandbox, commands join it.

    Constructor keywords, besides Harbor's own (all optional; from Harbor's CLI
    pass them as ``--ek key=value``):

    - ``sandbox_root``: base folder of the sandbox folders (default
      ``$HARBOR_ASYNC_LOCAL_ROOT`` or ``/tmp/harbor-async-local``).
    - ``run_label``: names the run in folder names and markers, so a reaper can
      tell runs apart (default ``$HARBOR_ASYNC_RUN_LABEL`` or ``"adhoc"``).
    """

    #: written with anyio only: safe to drive from trio as well as asyncio.
    ANYIO_NATIVE = True

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
        **kwargs: Any,
    ) -> None:
        base = Path(sandbox_root or os.environ.get(LOCAL_ROOT_ENV) or DEFAULT_LOCAL_ROOT)
        self.run_label: str = run_label or os.environ.get(RUN_LABEL_ENV) or "adhoc"
        self._base = base.absolute()
        self._root = self._base / local_folder_name(self.run_label, session_id)
        self._fs = self._root / "fs"
        self._spec = DockerfileSpec()
        self._workdir = "/"
        self._running: dict[int, Process] = {}  # exec nsenter pid -> process
        self._launching = 0  # processes being spawned, not yet in _running / _keeper
        self._keeper: Keeper | None = None
        self._keeper_finalizer: weakref.finalize[Any, Any] | None = None
        self._tools: Tools | None = None
        self._started = False
        self._marker_live = False  # the marker may be (re)written: between start and stop
        self._warned_user = False
        self._created_at = ""
        super().__init__(
            environment_dir, environment_name, session_id, trial_paths, task_env_config,
            logger=logger, **kwargs,
        )  # fmt: skip

    # -- Harbor's description of this backend --------------------------------

    @staticmethod
    def type() -> str:
        """Harbor environment type name."""
        return "local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        """No network at all (so "no-network" tasks are honoured); no host mounts."""
        return EnvironmentCapabilities(disable_internet=True, mounted=False)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        """CPU and memory are not limited; tasks that only state them still run."""
        return EnvironmentResourceCapabilities(fractional_cpus=True)

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
        """Read the optional Dockerfile; warn once about everything not honoured."""
        dockerfile = self.environment_dir / "Dockerfile"
        if dockerfile.is_file():
            self._spec = parse_dockerfile(dockerfile.read_text(), BASE_ENV)
        ignored = self._spec.ignored
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
        if self._host_mounts:
            ignored.append(f"mounts {[m.get('target') for m in self._host_mounts]}")
        if ignored:
            self.logger.warning(
                "local environment %s ignores %d item(s) of its definition: %s",
                self.environment_name, len(ignored), "; ".join(ignored),
            )  # fmt: skip

    # -- lifecycle ------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        """Create the sandbox folder, apply the Dockerfile and launch the keeper (milliseconds; no image).

        Raises:
            SandboxBuildFailedError: ``bwrap``, ``nsenter`` or ``setpriv`` is
                missing, or bubblewrap cannot create the sandbox.
        """
        self._tools = find_tools()
        await anyio.to_thread.run_sync(self._build_tree)
        await self._start_keeper()
        self._started = True
        self._write_marker()
        # Prebuilt-image tasks without a Dockerfile ship loose files for the workdir.
        await self._upload_environment_dir_after_start()

    async def _start_keeper(self) -> None:
        """Launch the sandbox's long-lived bwrap and take hold of its namespaces.

        bwrap reports the host pid of the sandbox's PID 1 on ``--info-fd``; the
        init prints ``ready`` once bwrap has finished the setup (mounts, pivot,
        capabilities), and only then are the namespaces worth joining. Their
        files are opened here and kept open until ``stop()``: an exec enters
        them through ``/proc/<our pid>/fd/N``, so a recycled pid can never send
        it into another process's namespaces.
        """
        assert self._tools is not None
        info_read, info_write = os.pipe()
        ready = OutputPipe()
        try:
            argv = self._keeper_argv(self._tools, info_write)
            self._launching += 1
            try:
                with open(self._root / "keeper.log", "wb") as log, anyio.CancelScope(shield=True):
                    keeper = Keeper(
                        await spawn_from_keeper_thread(
                            argv, stdin=subprocess.DEVNULL, stdout=ready.write_fd, stderr=log,
                            pass_fds=(info_write,), start_new_session=True,
                        )  # fmt: skip
                    )
            finally:
                self._launching -= 1
                os.close(info_write)
                ready.close_write_end()
            self._keeper = keeper  # from here on stop() ends it, whatever happens next
            self._keeper_finalizer = weakref.finalize(self, keeper.abandon)
            # At exit the engine stops its sandboxes (a finalizer would kill them
            # first); what is left then dies with this process (--die-with-parent).
            self._keeper_finalizer.atexit = False
            with anyio.move_on_after(KEEPER_START_TIMEOUT) as waited:
                while not ready.eof and b"\n" not in b"".join(ready.chunks):
                    if not ready._read_some():
                        await anyio.wait_readable(ready.read_fd)
            if waited.cancelled_caught:
                raise RuntimeError(
                    f"local sandbox {self.session_id}: bubblewrap did not come up "
                    f"within {KEEPER_START_TIMEOUT:g} s"
                )
            if (ready.text() or "").strip() != "ready":
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await keeper.wait()
                detail = (self._root / "keeper.log").read_text(errors="replace").strip()
                raise SandboxBuildFailedError(
                    f"bubblewrap could not create local sandbox {self.session_id}: "
                    f"{detail or f'exit code {keeper.process.returncode}'}"
                )
            keeper.attach(json.loads(read_available(info_read) or b"{}"))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._end_keeper()
            raise
        finally:
            os.close(info_read)
            ready.close()

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
        keeper.close()

    def _build_tree(self) -> None:
        if self._root.exists():  # left by a killed run with the same label and session
            self.logger.warning("removing stale local sandbox %s", self._root)
            remove_tree(self._root)
        if not self._base.exists():
            # 0700: set-uid files made inside must not be reachable by other host users.
            self._base.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._root.mkdir(mode=0o700)
        self._created_at = datetime.now(UTC).isoformat()
        self._marker_live = True
        self._write_marker()
        for name in SANDBOX_DIRS:
            (self._fs / name).mkdir(parents=True, exist_ok=True)
        (self._fs / "tmp").chmod(0o1777)
        (self._fs / "var/tmp").chmod(0o1777)
        (self._fs / "root").chmod(0o700)
        for name in SYSTEM_DIRS:  # mount points; bwrap makes /proc and /dev itself
            mount_point = self._fs / name.lstrip("/")
            if os.path.islink(name):  # merged /usr: /bin -> usr/bin, same inside
                mount_point.symlink_to(os.readlink(name))
            elif os.path.isdir(name):
                mount_point.mkdir(exist_ok=True)
        self._host_path(self._workdir, writable=True).mkdir(parents=True, exist_ok=True)
        for step in self._spec.copies:
            self._apply_copy(step)

    def _apply_copy(self, step: CopyStep) -> None:
        context = self.environment_dir.resolve()
        for pattern in step.sources:
            relative = posixpath.normpath(pattern.lstrip("/"))
            if relative.startswith(".."):
                raise SandboxBuildFailedError(f"COPY source {pattern!r} is outside the build context")
            matches = sorted(context.glob(relative)) if relative != "." else [context]
            if not matches:
                raise SandboxBuildFailedError(
                    f"Dockerfile line {step.line}: COPY source {pattern!r} not found in {context}"
                )
            for source in matches:
                if source.is_dir():  # a folder's contents go into dest
                    self._put_tree(source, step.dest)
                elif step.dest_is_dir:
                    self._put_file(source, posixpath.join(step.dest, source.name))
                else:
                    self._put_file(source, step.dest)

    async def stop(self, delete: bool = True) -> None:
        """Kill every process of this sandbox and (``delete``) remove its folder.

        Killing the keeper ends the sandbox's PID namespace: every process in
        it dies, background processes included; running execs return 137.
        Idempotent. With ``delete=False`` the folder stays for inspection.
        """
        self._started = False
        # An exec finishing during the removal must not write its marker back.
        self._marker_live = False
        with anyio.CancelScope(shield=True):  # teardown must finish even when cancelled
            # A process being spawned now would escape the kill below, and an
            # nsenter must not find the namespace files closed (their numbers
            # reused); spawns take milliseconds, so wait for them.
            while self._launching:
                await anyio.sleep(0.005)
            if self._keeper is not None:
                self._keeper.kill_init()
            for process in list(self._running.values()):
                await end_exec(process)  # it ends with its command, killed with the namespace
            # No nsenter is running now: the namespace files may be closed.
            await self._end_keeper()
            if delete:
                try:
                    await anyio.to_thread.run_sync(remove_tree, self._root)
                except RuntimeError:  # no new threads at interpreter shutdown
                    remove_tree(self._root)
            elif self._root.exists():
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
        when the caller cancels it, the command's whole process tree is killed:
        its session, its process group and every descendant, not what earlier
        execs left running.

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
        argv = self._exec_argv(variables, workdir, command)
        out, err = OutputPipe(), OutputPipe()
        self._launching += 1  # no await since the _started check: stop() waits for this
        try:
            with anyio.CancelScope(shield=True):  # a cancelled spawn must not leak a process
                # Own session: the whole tree can be found and killed without touching ours.
                process = await anyio.open_process(
                    argv, stdin=subprocess.DEVNULL, stdout=out.write_fd, stderr=err.write_fd,
                    start_new_session=True, env={},
                )  # fmt: skip
        except BaseException:
            out.close()
            err.close()
            raise
        finally:
            self._launching -= 1
            out.close_write_end()
            err.close_write_end()
        self._running[process.pid] = process  # no await since the launch: stop() sees it
        self._write_marker()
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
                    await end_exec(process)
                await process.aclose()
            self._running.pop(process.pid, None)
            for pipe in (out, err):
                pipe.settle()
            OUTPUT_SINK.adopt([pipe.read_fd for pipe in (out, err) if not pipe.eof])
            for pipe in (out, err):
                if pipe.eof:
                    pipe.close()
            self._write_marker()
        stdout, stderr = out.text(), err.text()
        if deadline.cancelled_caught:
            raise ExecTimeoutError(timeout_sec or 0, stdout, stderr)
        code = process.returncode or 0
        # Killed by a signal (stop() during the command): report it like a shell.
        return ExecResult(stdout=stdout, stderr=stderr, return_code=128 - code if code < 0 else code)

    def _keeper_argv(self, tools: Tools, info_fd: int) -> list[str]:
        """The long-lived bwrap: the sandbox's namespaces, mounts and capabilities, with a waiting init."""
        # --as-pid-1: the init shell is the namespace's PID 1 (bwrap's own init
        # would show bwrap's host command line inside the sandbox).
        argv = [
            tools.bwrap, "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session",
            "--hostname", BASE_ENV["HOSTNAME"], "--bind", str(self._fs), "/",
        ]  # fmt: skip
        for name in SYSTEM_DIRS:
            if os.path.isdir(name) and not os.path.islink(name):
                argv += ["--ro-bind", name, name]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        if os.geteuid() == 0:
            argv += ["--cap-drop", "ALL"]
            for capability in SANDBOX_CAPS:
                argv += ["--cap-add", capability]
        else:  # unprivileged: a user namespace makes us root inside, powerless outside
            argv += ["--unshare-user", "--uid", "0", "--gid", "0"]
        argv += ["--clearenv", "--setenv", "PATH", BASE_ENV["PATH"], "--chdir", "/"]
        argv += ["--info-fd", str(info_fd)]
        return [*argv, "--", tools.sh, "-c", KEEPER_INIT]

    def _exec_argv(self, env: dict[str, str], cwd: str, command: str) -> list[str]:
        """nsenter into the keeper's namespaces, setpriv to its privileges, env to a clean environment."""
        assert self._keeper is not None and self._tools is not None
        tools, me = self._tools, os.getpid()
        argv = [tools.nsenter]
        if os.geteuid() != 0:
            # Unprivileged, the sandbox's user namespace maps our uid to root
            # and denies setgroups(), which nsenter would call to become root.
            argv.append("--preserve-credentials")
        for name, fd in self._keeper.namespaces.items():
            # Entering the mount namespace also makes its root (the sandbox's) ours.
            argv.append(f"--{'mount' if name == 'mnt' else name}=/proc/{me}/fd/{fd}")
        # What bwrap gives its command: as root, SANDBOX_CAPS in every set (a
        # root shell keeps them across exec); unprivileged, none at all.
        caps = ",".join(["-all", *(f"+{c.removeprefix('CAP_').lower()}" for c in sandbox_caps())])
        argv += [
            "--", tools.setpriv, f"--inh-caps={caps}", f"--ambient-caps={caps}",
            f"--bounding-set={caps}", "--no-new-privs",
            "--", tools.env, "-i", "-C", cwd, "--", *(f"{key}={value}" for key, value in env.items()),
        ]  # fmt: skip
        # Resolved with the sandbox's PATH, as bwrap did.
        return [*argv, "bash" if shutil.which("bash") else "sh", "-c", command]

    async def run_healthcheck(self, healthcheck: HealthcheckConfig | None = None) -> None:
        """Harbor's healthcheck loop, with anyio sleeps so that it also runs under trio."""
        check = healthcheck if healthcheck is not None else self.task_env_config.healthcheck
        if check is None:
            return
        start_period_end = time.monotonic() + check.start_period_sec
        failures = 0
        while True:
            in_start_period = time.monotonic() < start_period_end
            result = await self.exec(check.command, timeout_sec=int(check.timeout_sec))
            if result.return_code == 0:
                return
            if in_start_period:
                await anyio.sleep(check.start_interval_sec)
                continue
            failures += 1
            if failures >= check.retries:
                raise HealthcheckError(
                    f"Healthcheck failed after {check.retries} consecutive retries: {check.command}"
                )
            await anyio.sleep(check.interval_sec)

    # -- files --------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy a host file to ``target_path`` in the sandbox."""
        await anyio.to_thread.run_sync(self._put_file, Path(source_path), target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy a host folder's contents into ``target_dir`` in the sandbox."""
        await anyio.to_thread.run_sync(self._put_tree, Path(source_dir), target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a sandbox file to ``target_path`` on the host."""
        await anyio.to_thread.run_sync(self._get_file, source_path, Path(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox folder's regular files into ``target_dir`` on the host (overwriting)."""
        await anyio.to_thread.run_sync(self._get_tree, source_dir, Path(target_dir))

    def _host_path(self, sandbox_path: str, *, writable: bool) -> Path:
        """The host path behind ``sandbox_path``, resolving symlinks as the sandbox would.

        Resolving here, not on the host, matters: a symlink the sandbox made to
        ``/etc/passwd`` means the sandbox's ``/etc/passwd``; followed on the host
        it would let an upload overwrite a host file.

        Raises:
            SandboxPathError: the path is under /proc, /dev, /sys, or (``writable``)
                under a read-only host folder, or has a symlink loop.
        """
        pending = posixpath.join(self._workdir, sandbox_path).split("/")
        resolved = "/"
        hops = 0
        while pending:
            name = pending.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                resolved = posixpath.dirname(resolved)
                continue
            candidate = posixpath.join(resolved, name)
            host = self._host_location(candidate)
            if host.is_symlink():
                hops += 1
                if hops > 40:
                    raise SandboxPathError(f"too many symlinks in {sandbox_path!r}")
                target = os.readlink(host)
                pending = target.split("/") + pending
                if target.startswith("/"):
                    resolved = "/"
                continue
            resolved = candidate
        if under(resolved, SPECIAL_DIRS):
            raise SandboxPathError(f"{sandbox_path!r} is a kernel file system in the sandbox")
        if writable and under(resolved, SYSTEM_DIRS):
            raise SandboxPathError(
                f"{sandbox_path!r} is on a read-only host folder in the local sandbox "
                f"({', '.join(SYSTEM_DIRS)} are read-only; every other path is writable)"
            )
        return self._host_location(resolved)

    def _host_location(self, resolved: str) -> Path:
        """Where a symlink-free sandbox path lives on the host."""
        if under(resolved, SYSTEM_DIRS):
            return Path(resolved)  # bound read-only at the same path
        return self._fs / resolved.lstrip("/")

    def _put_file(self, source: Path, target: str) -> None:
        host = self._host_path(target, writable=True)
        if host.is_dir():  # like cp: a file copied onto a folder lands inside it
            host = self._host_path(posixpath.join(target, source.name), writable=True)
        host.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, host)

    def _put_tree(self, source: Path, target: str) -> None:
        if not source.is_dir():
            raise NotADirectoryError(f"{source} is not a folder")
        self._host_path(target, writable=True).mkdir(parents=True, exist_ok=True)
        for folder, dirnames, filenames in os.walk(source):
            relative = Path(folder).relative_to(source).as_posix()
            base = posixpath.normpath(posixpath.join(target, relative))
            for name in [*dirnames, *filenames]:
                entry = Path(folder, name)
                if entry.is_symlink():  # kept as a link: it names a sandbox path
                    # Resolve only the parent: an existing link there is replaced, not followed.
                    link = self._host_path(base, writable=True) / name
                    if link.is_dir() and not link.is_symlink():
                        remove_tree(link)
                    link.unlink(missing_ok=True)
                    link.symlink_to(os.readlink(entry))
                elif entry.is_dir():
                    self._host_path(posixpath.join(base, name), writable=True).mkdir(exist_ok=True)
                elif entry.is_file():
                    self._put_file(entry, posixpath.join(base, name))

    def _get_file(self, source: str, target: Path) -> None:
        host = self._host_path(source, writable=False)
        if not host.is_file():
            raise FileNotFoundError(f"{source!r} is not a file in local sandbox {self.session_id}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(host, target)

    def _get_tree(self, source: str, target: Path) -> None:
        host = self._host_path(source, writable=False)
        if not host.is_dir():
            raise FileNotFoundError(f"{source!r} is not a folder in local sandbox {self.session_id}")
        target.mkdir(parents=True, exist_ok=True)
        for folder, _dirnames, filenames in os.walk(host):  # symlinked folders: not entered
            relative = Path(folder).relative_to(host)
            (target / relative).mkdir(parents=True, exist_ok=True)
            for name in filenames:
                # Follow file symlinks the sandbox way; skip FIFOs, sockets, devices.
                entry = self._host_path(f"{source}/{relative.as_posix()}/{name}", writable=False)
                if entry.is_file():
                    shutil.copy2(entry, target / relative / name)

    # -- bookkeeping ------------------------------------------------------------

    def _write_marker(self) -> None:
        """Record who owns this sandbox and which processes run it, for a reaper."""
        if not self._marker_live:
            return
        marker = {
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
        }
        temporary = self._root / f"{MARKER_NAME}.tmp"
        temporary.write_text(json.dumps(marker))
        temporary.replace(self._root / MARKER_NAME)  # atomic: a reaper never reads half

