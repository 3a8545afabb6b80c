"""Harbor's docker environment with its host side bounded, as the local backend's is.

Harbor buffers a ``docker exec``'s whole output in the host process (512 MiB
printed in a sandbox cost 1.1 GiB of host memory) and copies files out with
``docker compose cp``, which brings a 1 GiB sparse file to the host disk at
full size and copies a symlink the sandbox planted as a link, which the host
then follows to a host file. Here:

- each exec stream keeps its head and tail within ``output_limit`` bytes
  (:class:`~harbor_async.core.bounded_output.HeadTail`), as on the local backend;
- downloads stream ``docker cp CONTAINER:PATH -`` (the daemon reads the
  container's files; nothing runs inside it) through a tar reader that takes
  regular files and folders only (links, devices and FIFOs are skipped, no
  name leaves the target), counts apparent sizes against
  ``transfer_limit_mb`` before writing, stops at 64 levels or 100,000 entries,
  and checks for cancellation between chunks;
- every download also charges its episode's and job's disk bounds
  (:mod:`harbor_async.verification.disk_bounds`), and a task's ``storage_mb`` is the
  daemon's quota where it enforces one, else a watch of the container's
  writable layer that kills it past the bound (:mod:`.storage`);
- a task whose every phase is ``no-network`` runs with Compose's
  ``network_mode: none`` where Harbor's egress-control sidecar is not
  available (its images come from Docker Hub): the policy is honoured, not refused;
- a sandbox cannot reach this host's own addresses unless ``host_access=true``
  (:mod:`.host_network`: where the daemon forwards no IPv4, its default network
  leaves the host without an address on it);
- the daemon's OS (Harbor's check that the task's OS matches it) is asked
  once per process and Docker endpoint, in a worker thread: Harbor runs
  ``docker info`` synchronously at every start, on the event loop, so under a
  batch of starts every other sandbox's command waited for it (0.1-0.3 s a
  start on a busy daemon, one start after another).

The engine uses this class for the ``docker`` type and ``docker-fast``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import posixpath
import re
import subprocess
import tarfile
import time
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, cast

import anyio
import anyio.from_thread
import httpx
from harbor.environments.base import ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.docker import COMPOSE_NO_NETWORK_PATH
from harbor.environments.docker.docker import (
    DockerEnvironment,
    _sanitize_docker_compose_project_name,
)
from harbor.models.task.config import NetworkMode

from harbor_async.backends.docker import host_network, storage
from harbor_async.backends.docker.cleanup import docker_is_local
from harbor_async.backends.docker.loader_files import reset_loader_files
from harbor_async.backends.docker.usage import container_usage, side_services
from harbor_async.core.bounded_output import HeadTail
from harbor_async.core.errors import TransferLimitError
from harbor_async.core.offload import off_loop
from harbor_async.core.usage import ResourceUsage
from harbor_async.tasks.resources import capped_environment_config
from harbor_async.verification import disk_bounds
from harbor_async.verification.disk_bounds import StorageLimitError
from harbor_async.verification.isolation import HIDDEN_SUFFIX
from harbor_async.verification.transfer_budget import MAX_DEPTH, Budget

#: Defaults of the bounds (the local backend's).
DEFAULT_TRANSFER_LIMIT_MB = 512
DEFAULT_OUTPUT_LIMIT = 1024 * 1024
#: Host variables Docker Compose itself reads (the daemon's address and credentials store, proxies, locale,
#: paths); a task's compose file interpolating any other one gets it only through --env-allow.
COMPOSE_HOST_VARIABLES = re.compile(
    r"PATH|HOME|USER|LOGNAME|SHELL|LANG|LANGUAGE|LC_\w+|TZ|TMPDIR|TERM|XDG_\w+|COMPOSE_\w+|BUILDKIT_\w+"
    r"|DOCKER_(?:HOST|CONTEXT|CONFIG|CERT_PATH|TLS|TLS_VERIFY|BUILDKIT|DEFAULT_PLATFORM|API_VERSION)"
    r"|BUILDX_\w+|SSL_CERT_\w+|(?i:https?_proxy|no_proxy|all_proxy)"
)
_CHUNK = 1 << 20
#: The daemon's OS per Docker endpoint (``DOCKER_HOST``, ``DOCKER_CONTEXT``): (when asked, answer or None).
_DAEMON_OS: dict[tuple[str, str], tuple[float, str | None]] = {}
#: Seconds an unanswered ``docker info`` stands before the next start asks again.
_DAEMON_OS_RETRY = 30.0


class ConfinedDockerEnvironment(DockerEnvironment):
    """Harbor's ``docker`` environment with bounded exec output and bounded, link-free downloads.

    Keyword arguments besides Harbor's:

    - ``transfer_limit_mb``: the most one download may bring to the host,
      counting apparent sizes (512; past it ``TransferLimitError``);
    - ``output_limit``: bytes of each exec stream kept, head and tail halves (1 MiB);
    - ``host_access``: let the sandbox reach this host's own addresses (default
      false; see :mod:`.host_network`);
    - ``compose_env_allow``: the host variables (``--env-allow``) a task's own
      ``docker-compose.yaml`` may interpolate; Compose gets no other host
      variable than those it needs itself (:data:`COMPOSE_HOST_VARIABLES`), so
      a task cannot pull a secret (one ``--env-file`` loaded) into its sandbox.

    A task's ``cpus``, ``memory_mb`` and ``storage_mb`` are lowered to this host's
    when the daemon is local (Docker refuses more CPUs than it has).
    """

    #: the engine hands it the run's --env-allow names (``compose_env_allow``)
    TAKES_COMPOSE_ENV_ALLOW = True

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: Any,
        task_env_config: Any,
        *args: Any,
        transfer_limit_mb: int | None = DEFAULT_TRANSFER_LIMIT_MB,
        output_limit: int | None = DEFAULT_OUTPUT_LIMIT,
        host_access: bool = False,
        compose_env_allow: Collection[str] = (),
        **options: Any,
    ) -> None:
        self._host_access = bool(host_access)
        self._compose_env_allow = frozenset(compose_env_allow)
        self._network_overlay: Path | None = None  # the default network without a host address (.host_network)
        self._transfer_limit = None if transfer_limit_mb is None else int(transfer_limit_mb) * 2**20
        self._output_limit = None if output_limit is None else int(output_limit)
        self._main_container: str | None = None
        self._usage_before_restart: ResourceUsage | None = None  # read before a strict verify's restart
        #: The task's storage_mb, past which the watch killed the container (harbor_async.verification.disk_bounds reads it).
        self.storage_exceeded: StorageLimitError | None = None
        self._watched_container: str | None = None
        self._storage_overlay: Path | None = None  # the daemon's own quota, where it enforces one
        if task_env_config is not None and docker_is_local():  # this host's daemon: its CPUs and memory
            task_env_config = capped_environment_config(task_env_config, environment_name)
        policies = [options.get("network_policy"), *(options.get("phase_network_policies") or ())]
        self._offline = all(getattr(p, "network_mode", None) == NetworkMode.NO_NETWORK for p in policies) and not (
            Path(environment_dir) / "docker-compose.yaml"
        ).exists()  # one container: no service to reach
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config, *args, **options)

    def _compose_env_vars(self, include_os_env: bool = True) -> dict[str, str]:
        """Harbor's Compose environment with the host's reduced to what Compose needs and what the user allowed."""
        env = super()._compose_env_vars(include_os_env=False)
        if not include_os_env:
            return env
        host = {
            name: value for name, value in os.environ.items()
            if name in self._compose_env_allow or COMPOSE_HOST_VARIABLES.fullmatch(name)
        }  # fmt: skip
        return {**host, **env}  # Harbor's order: the host's under the task's and its own

    # -- the daemon's OS: asked once, off the loop ---------------------------------

    async def start(self, force_build: bool) -> None:
        if _known_daemon_os() is None:
            await anyio.to_thread.run_sync(type(self)._detect_daemon_os)
        if not self._host_access:  # off this host's addresses where the daemon's bridges can be (.host_network)
            forwards = await anyio.to_thread.run_sync(host_network.daemon_forwards)
            if forwards is False:
                self._network_overlay = host_network.isolation_overlay(Path(self.trial_paths.trial_dir))
        storage_mb = getattr(self.task_env_config, "storage_mb", None)
        watched = False
        if storage_mb:  # the daemon's quota where it has one, else our watch (harbor_async.backends.docker.storage)
            enforced, _ = await anyio.to_thread.run_sync(storage.daemon_quota)
            if enforced:
                self._storage_overlay = storage.quota_overlay(Path(self.trial_paths.trial_dir), storage_mb)
            watched = not enforced
        await super().start(force_build)
        if watched and (container := await self._find_main_container()) is not None:
            self._watched_container = container
            storage.WATCH.watch(container, int(cast(int, storage_mb)), self._storage_passed)  # set: watched

    def _storage_passed(self, error: StorageLimitError) -> None:
        """Told by the watch's thread, before it kills the container: every later command is refused."""
        self.storage_exceeded = error

    def _check_storage(self) -> None:
        """Refuse a command of a container killed past its ``storage_mb`` (a fresh error: one raised is not re-raised)."""
        found = self.storage_exceeded
        if found is not None:
            raise StorageLimitError(found.container, found.limit_mb, found.size)

    async def exec(self, command: str, *args: Any, **kwargs: Any) -> ExecResult:
        """Harbor's exec, refused once the container went past its ``storage_mb``."""
        self._check_storage()
        return await super().exec(command, *args, **kwargs)

    async def stop(self, delete: bool) -> None:
        if self._watched_container is not None:
            storage.WATCH.unwatch(self._watched_container)
            self._watched_container = None
        await super().stop(delete)

    @classmethod
    def _detect_daemon_os(cls) -> str | None:
        """Harbor's ``docker info`` query, answered from the per-process cache once asked."""
        known = _known_daemon_os()
        if known is not None:
            return known[1]
        found = super()._detect_daemon_os()
        _DAEMON_OS[_daemon_endpoint()] = (time.monotonic(), found)
        return found

    # -- a static no-network policy without the egress sidecar -------------------

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        """Harbor's, plus ``disable_internet`` for a task that is offline in every phase."""
        found = super().capabilities
        if self._offline and not found.disable_internet:
            found = found.model_copy(update={"disable_internet": True})
        return found

    @property
    def _docker_compose_paths(self) -> list[Path]:
        paths = super()._docker_compose_paths
        if self._offline and not self._enable_egress_control:
            paths.append(COMPOSE_NO_NETWORK_PATH)
        if getattr(self, "_storage_overlay", None) is not None:
            paths.append(self._storage_overlay)
        if getattr(self, "_network_overlay", None) is not None:
            paths.append(self._network_overlay)
        return paths

    # -- exec output --------------------------------------------------------------

    async def _collect_buffered_output(
        self, process: asyncio.subprocess.Process, *, timeout_sec: int | None, stdin_data: bytes | None = None
    ) -> ExecResult:
        """Harbor's buffered collection, each stream kept within ``output_limit``."""
        out, err = HeadTail(self._output_limit), HeadTail(self._output_limit)

        async def pump(stream: asyncio.StreamReader | None, into: HeadTail) -> None:
            if stream is not None:
                while chunk := await stream.read(65536):
                    into.keep(chunk)

        async def run() -> None:
            if stdin_data is not None and process.stdin is not None:
                process.stdin.write(stdin_data)
                await process.stdin.drain()
                process.stdin.close()
            await asyncio.gather(pump(process.stdout, out), pump(process.stderr, err))
            await process.wait()

        try:
            await asyncio.wait_for(run(), timeout=timeout_sec or None)
        except asyncio.TimeoutError:
            await DockerEnvironment._terminate_process(process)
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        return ExecResult(stdout=out.text(), stderr=err.text(), return_code=process.returncode or 0)

    # -- downloads ----------------------------------------------------------------

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy a regular file of the container to ``target_path`` (a symlink is not followed).

        Raises:
            FileNotFoundError: no regular file there.
            TransferLimitError: larger than ``transfer_limit_mb``; nothing is kept.
        """
        target = Path(target_path)
        try:
            await self._copy_out(source_path, target, single=True)
        except BaseException:
            target.unlink(missing_ok=True)
            raise

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a container folder's regular files and folders into ``target_dir`` (links, FIFOs skipped).

        Raises:
            FileNotFoundError: no folder there.
            TransferLimitError: the files add up past ``transfer_limit_mb``; what was copied stays.
        """
        await self._copy_out(source_dir.rstrip("/") + "/.", Path(target_dir), single=False)

    async def download_dir_with_exclusions(self, *, source_dir: str, target_dir: Path | str, exclude: list[str]) -> None:
        """:meth:`download_dir` (within the transfer budget), then the ``exclude`` globs dropped.

        Harbor's own route packs a gzip in the sandbox and unpacks it on the
        host, where nothing bounds what it expands to.
        """
        from harbor_async.verification.artifacts import prune_excluded

        await self.download_dir(source_dir, target_dir)
        await off_loop(prune_excluded, Path(target_dir), exclude)  # a walk

    async def _copy_out(self, source: str, target: Path, *, single: bool) -> None:
        container = await self._find_main_container()
        if container is None:
            raise FileNotFoundError(errno.ENOENT, "the sandbox's main container is not running", source)
        budget = Budget(self._transfer_limit, source, anyio.from_thread.check_cancelled, disk_bounds.current())
        argv = ["docker", "cp", f"{container}:{source}", "-"]
        await anyio.to_thread.run_sync(_copy_stream, argv, target, single, budget)

    # -- the verifier alone ----------------------------------------------------------

    async def end_agent_processes(self) -> None:
        """End every process of the sandbox before the verifier (``strict_verify``): restart the main container.

        A restart leaves no process of the agent's (not one it re-parented,
        attached to the main command by ptrace or hid under it: a kill that
        spares the main command spares what it was made to fork) and keeps the
        filesystem, the mounts and the network. While the container is stopped
        its loader's files are put back to the image's (:mod:`.loader_files`).
        A restart that fails is the daemon's failure (infrastructure).
        """
        self._check_storage()  # killed past its storage_mb: restarting it would hand the verifier what outgrew it
        container = await self._find_main_container()
        if container is None:
            raise RuntimeError("the sandbox's main container is not running: it cannot be restarted for the verifier")
        # Stopped, then started: in between, with nothing running, the loader's files are the image's again, so
        # the main command does not load a library the agent named (loader_files).
        before = await self._daemon_usage(container, disk=False)  # the restart makes new counters: this reading is kept
        if before is not None:
            self._usage_before_restart = before if self._usage_before_restart is None else self._usage_before_restart.then(before)
        for command in ("stop", "start"):
            process = await asyncio.create_subprocess_exec(
                "docker", command, *(["--time", "0"] if command == "stop" else []), container,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            output, _ = await process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"docker {command} of the main container failed: {output.decode(errors='replace')[-500:]}")
            if command == "stop":
                changed = await reset_loader_files(container)
                if changed:
                    self.logger.info("docker sandbox %s: before the verifier, %s put back to the image's (the "
                                     "agent's kept as *%s)", self.session_id, ", ".join(changed), HIDDEN_SUFFIX)

    # -- what the sandbox used -----------------------------------------------------

    async def resource_usage(self) -> ResourceUsage | None:
        """What the sandbox used over its life, asked of the daemon (:mod:`.usage`): the main container across a
        strict verify's restart, and beside it the task's other Compose services."""
        container = await self._find_main_container()
        now = None if container is None else await self._daemon_usage(container)
        before = self._usage_before_restart
        usage = now if before is None else before if now is None else before.then(now)
        if usage is None or not self._environment_docker_compose_path.exists():  # no side service to add
            return usage
        project = _sanitize_docker_compose_project_name(self.session_id)
        try:
            services = await off_loop(side_services, project)
        except httpx.HTTPError as exc:
            self.logger.warning("docker sandbox %s: the daemon listed no services: %s", self.session_id, exc)
            return usage
        for service in services:
            other = await self._daemon_usage(service)
            if other is not None:
                usage = usage.beside(other)
        return replace(usage, source=f"{usage.source}, {len(services) + 1} containers") if services else usage

    async def _daemon_usage(self, container: str, *, disk: bool = True) -> ResourceUsage | None:
        try:
            return await off_loop(functools.partial(container_usage, container, disk=disk))
        except httpx.HTTPError as exc:
            self.logger.warning("docker sandbox %s: the daemon gave no usage: %s", self.session_id, exc)
            return None

    async def _find_main_container(self) -> str | None:
        """The id of this project's main container (looked up once, by Compose's labels)."""
        if self._main_container is None:
            project = _sanitize_docker_compose_project_name(self.session_id)
            process = await asyncio.create_subprocess_exec(
                "docker", "ps", "-q", "--no-trunc",
                "--filter", f"label=com.docker.compose.project={project}",
                "--filter", "label=com.docker.compose.service=main",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            stdout, _ = await process.communicate()
            ids = stdout.decode().split()
            if process.returncode != 0 or len(ids) != 1:
                return None  # not exactly one: not ours to guess
            self._main_container = ids[0]
        return self._main_container


def _daemon_endpoint() -> tuple[str, str]:
    return os.environ.get("DOCKER_HOST", ""), os.environ.get("DOCKER_CONTEXT", "")


def _known_daemon_os() -> tuple[float, str | None] | None:
    """The cached answer for this endpoint: an OS for good, no answer for :data:`_DAEMON_OS_RETRY` seconds."""
    known = _DAEMON_OS.get(_daemon_endpoint())
    if known is None or (known[1] is None and time.monotonic() - known[0] >= _DAEMON_OS_RETRY):
        return None
    return known


def _copy_stream(argv: list[str], target: Path, single: bool, budget: Budget) -> None:
    """Run ``docker cp ... -`` and take its tar stream (blocking: a worker thread)."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            _read_tar(process.stdout, target, single, budget)
            while process.stdout.read(_CHUNK):  # what a skipped member left
                budget.checkpoint()
        except BaseException:
            process.kill()
            raise
        finally:
            process.wait()
        if process.returncode != 0:
            detail = process.stderr.read(4096).decode(errors="replace").strip()
            if "Could not find" in detail or "No such" in detail or "not found" in detail.lower():
                raise FileNotFoundError(errno.ENOENT, detail, argv[2])
            raise OSError(f"docker cp failed (exit {process.returncode}): {detail}")


def _read_tar(stream: IO[bytes], target: Path, single: bool, budget: Budget) -> None:
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        first = True
        for member in tar:
            budget.entry()
            if single:
                if not first:
                    break
                first = False
                if not member.isreg():
                    raise FileNotFoundError(errno.ENOENT, "not a regular file", member.name)
                budget.take(member.size)
                target.parent.mkdir(parents=True, exist_ok=True)
                _write(tar, member, target, budget)
                continue
            parts = [p for p in posixpath.normpath(member.name).split("/") if p not in ("", ".")]
            if not parts or ".." in parts or member.name.startswith("/"):
                continue
            if len(parts) > MAX_DEPTH:
                raise TransferLimitError(budget.shown, budget.limit or 0, f"folders deeper than {MAX_DEPTH}")
            path = target.joinpath(*parts)
            if member.isdir():
                _make_folder(target, parts)
            elif member.isreg():
                budget.take(member.size)
                _make_folder(target, parts[:-1])
                _write(tar, member, path, budget)


def _make_folder(target: Path, parts: list[str]) -> None:
    """``target/parts...`` as real folders (a symlink on the way, ours or not, is refused)."""
    current = target
    current.mkdir(parents=True, exist_ok=True)
    for part in parts:
        current = current / part
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            raise FileExistsError(errno.EEXIST, "not a folder", str(current))
        current.mkdir(exist_ok=True)


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path, budget: Budget) -> None:
    source = tar.extractfile(member)
    assert source is not None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as out:
        while chunk := source.read(_CHUNK):
            budget.checkpoint()
            out.write(chunk)
