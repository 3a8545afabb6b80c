"""A Harbor environment backed by bubblewrap: real namespaces, no Docker daemon.

Use it by import path, from Harbor's CLI or from code::

    harbor run -p tasks/ -e harbor_async.backends.local:LocalEnvironment -a oracle

Every sandbox is a folder on the host,
``<base>/harbor-async-<run label>-<session id>/``, holding a marker file
(``.harbor-async.json``, for a reaper) and ``fs/``, the sandbox's own root. Each
``exec`` starts a fresh ``bwrap`` that binds ``fs/`` as ``/`` (writable) and the
host's ``/usr``, ``/etc`` (and ``/bin``, ``/lib``... when they are real folders)
read-only on top, in new PID, mount, IPC, UTS, cgroup and network namespaces
(so: no network at all, only ``lo``). State persists between execs through
``fs/``; processes do not: when a command ends, its PID namespace ends with it.

From the task's ``environment/Dockerfile`` the ``WORKDIR``, ``ENV`` and ``COPY``
lines (and ``ADD`` of local files) are honoured at ``start()``; ``FROM``, ``ARG``
and ``LABEL`` are accepted silently; every other line (``RUN``, ``USER`` ...) is
named in one warning, as are the paths this backend cannot make writable.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteReceiveStream, Process
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

DEFAULT_SANDBOX_ROOT = "/tmp/harbor-async-local"
SANDBOX_ROOT_ENV = "HARBOR_ASYNC_LOCAL_ROOT"
RUN_LABEL_ENV = "HARBOR_ASYNC_RUN_LABEL"
MARKER_NAME = ".harbor-async.json"

# Host folders the sandbox sees read-only. /bin, /lib ... are usually symlinks
# into /usr (merged /usr); those are recreated as symlinks, real folders bound.
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Kernel file systems: never a source or target of a file transfer.
SPECIAL_DIRS = ("/proc", "/dev", "/sys")
# Folders every sandbox has, whatever its Dockerfile says.
SANDBOX_DIRS = (
    "tmp", "var/tmp", "run", "root", "home/user", "workdir",
    "logs/agent", "logs/verifier", "logs/artifacts", "tests", "solution",
)  # fmt: skip
# Docker's default capability set, less the ones that could reach the host
# through the writable folder (MKNOD, SETFCAP) and NET_RAW (no network anyway).
# Root with every capability (bwrap's default for root) could remount /usr rw.
SANDBOX_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE",
)  # fmt: skip
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "HOSTNAME": "sandbox",
}


class ExecTimeoutError(RuntimeError):
    """An ``exec`` ran past its ``timeout_sec``; its whole process tree was killed.

    A ``RuntimeError`` with the message Harbor's docker backend uses, so code
    written for Docker handles it the same way; the output captured before the
    kill is kept on ``stdout`` and ``stderr``.
    """

    def __init__(self, timeout_sec: float, stdout: str | None, stderr: str | None) -> None:
        super().__init__(f"Command timed out after {timeout_sec} seconds")
        self.timeout_sec = timeout_sec
        self.stdout = stdout
        self.stderr = stderr


class SandboxPathError(ValueError):
    """A sandbox path that cannot be transferred (read-only host folder, /proc ...)."""


# ---------------------------------------------------------------------------
# Dockerfile: the subset that can be honoured without building an image
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyStep:
    """One COPY/ADD line: build-context sources (globs allowed) into ``dest``."""

    line: int
    sources: tuple[str, ...]
    dest: str  # absolute sandbox path
    dest_is_dir: bool  # trailing "/" or several sources: copy *into* dest


@dataclass
class DockerfileSpec:
    """What the local backend takes from a Dockerfile's final stage."""

    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    copies: list[CopyStep] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # "line N: INSTRUCTION ..."


_SILENT = {"FROM", "ARG", "LABEL", "MAINTAINER"}
_HEREDOC = re.compile(r"<<-?([\"']?)([A-Za-z_]\w*)\1")
_VAR = re.compile(r"\\\$|\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")
_ARCHIVE = re.compile(r"\.(tar|tgz|tbz2?|txz|tar\.(gz|bz2|xz|zst))$")


def _expand(value: str, variables: dict[str, str]) -> str:
    """Expand ``$VAR``, ``${VAR}``, ``${VAR:-x}``, ``${VAR:+x}`` like a Dockerfile."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        current = variables.get(match.group(1) or match.group(4), "")
        if match.group(2) == "-":
            return current or match.group(3)
        if match.group(2) == "+":
            return match.group(3) if current else ""
        return current

    return _VAR.sub(substitute, value)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) pairs: continuations joined, comments and heredoc bodies dropped."""
    raw = text.splitlines()
    result: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    index = 0
    while index < len(raw):
        line = raw[index].strip()
        index += 1
        # Docker drops comment lines even inside a continuation.
        if not line or line.startswith("#"):
            continue
        if not parts:
            start = index
        if line.endswith("\\"):
            parts.append(line[:-1].strip())
            continue
        parts.append(line)
        instruction = " ".join(p for p in parts if p)
        parts = []
        result.append((start, instruction))
        # A heredoc body (RUN <<EOF ... EOF) is data, not instructions.
        heredocs = _HEREDOC.finditer(instruction) if re.match(r"(?i)(RUN|COPY|ADD)\s", instruction) else ()
        for match in heredocs:
            while index < len(raw) and raw[index].strip() != match.group(2):
                index += 1
            index += 1
    if parts:
        result.append((start, " ".join(p for p in parts if p)))
    return result


def _env_pairs(rest: str) -> list[tuple[str, str]]:
    """``ENV a=1 b="2 3"`` or the legacy ``ENV a 1 2``."""
    tokens = shlex.split(rest)
    if tokens and "=" in tokens[0]:
        return [(t.partition("=")[0], t.partition("=")[2]) for t in tokens]
    key, value = (re.split(r"\s+", rest.strip(), maxsplit=1) + [""])[:2]
    return [(key, " ".join(shlex.split(value)))]


def parse_dockerfile(text: str, base_env: dict[str, str] | None = None) -> DockerfileSpec:
    """Read WORKDIR, ENV and COPY/ADD from the Dockerfile's final stage.

    ``base_env`` seeds variable expansion (``ENV PATH=/x:$PATH``).

    Raises:
        SandboxBuildFailedError: a line cannot be parsed (unbalanced quotes ...).
    """
    spec = DockerfileSpec()
    args: dict[str, str] = {}
    for number, line in _logical_lines(text):
        keyword, rest = (re.split(r"\s+", line, maxsplit=1) + [""])[:2]
        keyword = keyword.upper()
        variables = {**(base_env or {}), **args, **spec.env}
        try:
            if keyword == "FROM":  # a new stage: only the last one is the image
                spec, args = DockerfileSpec(), {}
            elif keyword == "ARG":
                for token in shlex.split(rest):
                    name, has_value, value = token.partition("=")
                    if has_value:
                        args[name] = _expand(value, variables)
            elif keyword == "ENV":
                for key, value in _env_pairs(rest):
                    spec.env[key] = _expand(value, variables)
            elif keyword == "WORKDIR":
                path = _expand(rest, variables)
                spec.workdir = posixpath.normpath(posixpath.join(spec.workdir or "/", path))
            elif keyword in ("COPY", "ADD"):
                step = _copy_step(number, keyword, rest, variables, spec.workdir or "/")
                if step is None:
                    spec.ignored.append(f"line {number}: {_short(line)}")
                else:
                    spec.copies.append(step)
            elif keyword not in _SILENT:
                spec.ignored.append(f"line {number}: {_short(line)}")
        except (ValueError, IndexError) as exc:
            raise SandboxBuildFailedError(f"Dockerfile line {number}: {line!r}: {exc}") from exc
    return spec


def _copy_step(
    number: int, keyword: str, rest: str, variables: dict[str, str], workdir: str
) -> CopyStep | None:
    """Parse a COPY/ADD line; None when it cannot be honoured (--from, URLs, archives, heredocs)."""
    flags = re.match(r"((?:--\S+\s+)*)(.*)", rest, re.S)
    assert flags is not None  # the pattern matches every string
    if "--from" in flags.group(1) or "<<" in rest:
        return None
    body = flags.group(2).strip()
    tokens = json.loads(body) if body.startswith("[") else shlex.split(body)
    tokens = [_expand(token, variables) for token in tokens]
    if len(tokens) < 2:
        raise ValueError(f"{keyword} needs a source and a destination")
    *sources, dest = tokens
    if keyword == "ADD" and any("://" in s or _ARCHIVE.search(s) for s in sources):
        return None  # ADD's URL fetching and archive extraction are not emulated
    is_dir = dest.endswith("/") or len(sources) > 1
    dest = posixpath.normpath(posixpath.join(workdir, dest))
    return CopyStep(number, tuple(sources), dest, is_dir)


def _short(line: str, limit: int = 70) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _slug(text: str) -> str:
    """A folder-name-safe version of a run label or session id."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "x"


# ---------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------


class LocalEnvironment(BaseEnvironment):
    """A Harbor environment that runs each command in a fresh bubblewrap sandbox.

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
        base = Path(sandbox_root or os.environ.get(SANDBOX_ROOT_ENV) or DEFAULT_SANDBOX_ROOT)
        self.run_label: str = run_label or os.environ.get(RUN_LABEL_ENV) or "adhoc"
        self._base = base.absolute()
        self._root = self._base / f"harbor-async-{_slug(self.run_label)}-{_slug(session_id)}"
        self._fs = self._root / "fs"
        self._spec = DockerfileSpec()
        self._workdir = "/"
        self._running: dict[int, Process] = {}
        self._launching = 0  # execs whose bwrap is being spawned, not yet in _running
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
            if _under(step.dest, SYSTEM_DIRS + SPECIAL_DIRS):
                self._spec.copies.remove(step)
                ignored.append(f"line {step.line}: COPY into read-only {step.dest}")
        workdir = self._spec.workdir or "/"
        if _under(workdir, SYSTEM_DIRS + SPECIAL_DIRS):
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
        """Create the sandbox folder and apply the Dockerfile (milliseconds; no image)."""
        await anyio.to_thread.run_sync(self._build_tree)
        self._started = True
        # Prebuilt-image tasks without a Dockerfile ship loose files for the workdir.
        await self._upload_environment_dir_after_start()

    def _build_tree(self) -> None:
        if self._root.exists():  # left by a killed run with the same label and session
            self.logger.warning("removing stale local sandbox %s", self._root)
            _remove_tree(self._root)
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

        Idempotent. With ``delete=False`` the folder stays for inspection.
        """
        self._started = False
        # An exec finishing during the removal must not write its marker back.
        self._marker_live = False
        with anyio.CancelScope(shield=True):  # teardown must finish even when cancelled
            # A bwrap being launched now would create mount points while the
            # folder is removed; launches take milliseconds, so wait for them.
            while self._launching:
                await anyio.sleep(0.005)
            for process in list(self._running.values()):
                _kill_tree(process)
            for process in list(self._running.values()):
                await process.wait()
            if delete:
                try:
                    await anyio.to_thread.run_sync(_remove_tree, self._root)
                except RuntimeError:  # no new threads at interpreter shutdown
                    _remove_tree(self._root)
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
        """Run ``command`` with bash (sh without bash) in a fresh sandbox process.

        Every command runs as root; ``user`` is accepted and ignored (warned once).

        Raises:
            ExecTimeoutError: past ``timeout_sec`` (the process tree is killed first).
            RuntimeError: the sandbox is not started.
        """
        if not self._started:
            raise RuntimeError(f"local sandbox {self.session_id} is not started")
        user = self._resolve_user(user)
        if user not in (None, 0, "0", "root") and not self._warned_user:
            self._warned_user = True
            self.logger.warning("local environment runs every command as root, not %r", user)
        variables = {**BASE_ENV, **self._spec.env, **(self._merge_env(env) or {})}
        workdir = posixpath.join(self._workdir, cwd or self._workdir)
        argv = self._bwrap_argv(variables, workdir, command)
        self._launching += 1
        try:
            # Own session: the whole group can be killed without touching ours.
            process = await anyio.open_process(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            self._launching -= 1
        self._running[process.pid] = process  # no await since the launch: stop() sees it
        self._write_marker()
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            with anyio.move_on_after(timeout_sec or None) as deadline:
                async with anyio.create_task_group() as group:
                    assert process.stdout is not None and process.stderr is not None
                    group.start_soon(_drain, process.stdout, out)
                    group.start_soon(_drain, process.stderr, err)
                    await process.wait()
        finally:
            if process.returncode is None:  # timed out or cancelled
                _kill_tree(process)
            with anyio.CancelScope(shield=True):
                await process.aclose()
            self._running.pop(process.pid, None)
            self._write_marker()
        stdout = b"".join(out).decode(errors="replace") or None
        stderr = b"".join(err).decode(errors="replace") or None
        if deadline.cancelled_caught:
            raise ExecTimeoutError(timeout_sec or 0, stdout, stderr)
        code = process.returncode or 0
        # Killed by a signal (stop() during the command): report it like a shell.
        return ExecResult(stdout=stdout, stderr=stderr, return_code=128 - code if code < 0 else code)

    def _bwrap_argv(self, env: dict[str, str], cwd: str, command: str) -> list[str]:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise RuntimeError("bubblewrap is not installed (apt-get install bubblewrap)")
        # --as-pid-1: the shell is the namespace's init. bwrap's own init would
        # outlive the outer bwrap for a moment and become the host init's zombie.
        argv = [
            bwrap, "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session",
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
        argv += ["--clearenv", "--chdir", cwd]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        shell = "bash" if shutil.which("bash") else "sh"
        return [*argv, "--", shell, "-c", command]

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
        if _under(resolved, SPECIAL_DIRS):
            raise SandboxPathError(f"{sandbox_path!r} is a kernel file system in the sandbox")
        if writable and _under(resolved, SYSTEM_DIRS):
            raise SandboxPathError(
                f"{sandbox_path!r} is on a read-only host folder in the local sandbox "
                f"({', '.join(SYSTEM_DIRS)} are read-only; every other path is writable)"
            )
        return self._host_location(resolved)

    def _host_location(self, resolved: str) -> Path:
        """Where a symlink-free sandbox path lives on the host."""
        if _under(resolved, SYSTEM_DIRS):
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
                        _remove_tree(link)
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
        """Record who owns this sandbox and which bwrap processes run in it, for a reaper."""
        if not self._marker_live:
            return
        marker = {
            "run_label": self.run_label,
            "session_id": self.session_id,
            "environment_name": self.environment_name,
            "created_at": self._created_at,
            "owner_pid": os.getpid(),
            "pids": sorted(self._running),
        }
        temporary = self._root / f"{MARKER_NAME}.tmp"
        temporary.write_text(json.dumps(marker))
        temporary.replace(self._root / MARKER_NAME)  # atomic: a reaper never reads half


async def _drain(stream: ByteReceiveStream, chunks: list[bytes]) -> None:
    async for chunk in stream:
        chunks.append(chunk)


def _kill_tree(process: Process) -> None:
    """SIGKILL bwrap's process group; --die-with-parent and the PID namespace take the rest."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_tree(path: Path) -> None:
    """rmtree that also removes what the sandbox made unwritable (chmod 000 folders)."""

    def retry_writable(function: Any, failed: str, _exc: BaseException) -> None:
        parent = os.path.dirname(failed)
        os.chmod(parent, stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IRWXU)
        function(failed)

    if path.exists() or path.is_symlink():
        shutil.rmtree(path, onexc=retry_writable)
