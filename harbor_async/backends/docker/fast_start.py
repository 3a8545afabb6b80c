"""Cheaper Harbor ``docker`` starts: each image built once, no pointless Compose calls, a per-call profile.

This is what ``docker`` (and its older name ``docker-fast``) runs by default,
in ``run``, ``eval`` and the shim. ``--ek fast_start=false`` (the shim:
``backend_kwargs={"fast_start": False}``) gives Harbor's exact start; a task
with its own ``docker-compose.yaml`` (several services) always gets Harbor's
start, since its services' images are the task's to name.

Harbor's ``DockerEnvironment.start`` runs, for every sandbox, a ``compose
build`` (a cache hit after the first, but still a Compose process that loads
the project and asks the daemon), a ``docker inspect`` of the image's OS, a
``compose down --remove-orphans`` for a project name that was made fresh a
moment ago (nothing to remove), then ``compose up`` and a few execs. On a small
machine each Compose process costs about a second of CPU, and a batch's
starts queue for the cores.

:class:`FastStartDockerEnvironment` keeps Harbor's start and changes only the
calls it makes (by overriding the two helpers the start goes through):

- the image is built once per task per process: Harbor's build file gives the
  ``main`` service no image name and ``pull_policy: build``, so every
  sandbox's ``compose up`` rebuilds (a layer-cache hit, but a full Compose
  build) an image named after its own project, and its ``down --rmi local``
  deletes it. A small overlay names the image with Harbor's content-addressed
  tag (``hb__<environment id>``: an unchanged task reuses it) and sets
  ``pull_policy: never``; the first start of a task asks the daemon for the
  tag (``docker image inspect``: the id hashes the environment folder, so an
  image under it is this folder's build, from this run or an earlier one) and
  runs ``compose build`` only when it is missing or ``force_build`` is asked
  (Harbor's per-image lock serialises it), the others reuse the image, and the
  stop's ``down`` runs without ``--rmi local`` (which would delete it). The images stay in the
  daemon's cache after the run, as Harbor's prebuilt images do (``docker rmi
  'hb__*'`` or ``harbor-async sandboxes prune`` removes them), unless the run
  asks for Harbor's ``--delete``: its engine then removes the images its
  sandboxes kept (:attr:`~FastStartDockerEnvironment.kept_build`,
  :meth:`~FastStartDockerEnvironment.delete_kept_builds`) when it closes, not at
  each stop (the run's other sandboxes start from them). Tasks with a prebuilt image are left as they are.
- the image's OS is inspected once per image per process;
- a command in the ``main`` container runs through ``docker exec`` on the
  container (found once, by its Compose labels) instead of ``docker compose
  exec``, which loads the whole project in a new Compose process for every
  command; same flags (``-w``, ``-e``, ``-u``), same shell, no TTY, stdout and
  stderr merged, as Harbor's call gives them. Other services go through Compose.
- ``compose cp`` to or from the ``main`` container (Harbor's uploads of the
  tests and the solution) runs as ``docker cp`` on the container: the same
  copy, without a Compose process that loads the project (about 0.4 s of CPU);
- ``compose up`` runs without ``--wait`` when nothing has a healthcheck to
  wait for (the image declares no ``HEALTHCHECK``, checked once per image per
  process, and no egress-control sidecar): Compose's wait polls the
  container's state on a half-second tick, which added about 0.45 s to every
  start for a container that was running when ``up`` returned. An image with
  a healthcheck, or one not yet on the daemon, keeps ``--wait``;
- ``compose down`` before this sandbox's first ``up`` is skipped: the project
  name is the sandbox's fresh session id, so there is nothing to tear down.
  The ``down`` of ``stop()`` removes what Compose would, found by the
  project's Compose label: every container, stopped as Compose stops it
  (SIGTERM, then the grace period) and removed with its anonymous volumes, the project's networks, and with ``--volumes`` its
  named volumes; three light CLI calls instead of a Compose process (about a
  second of CPU). Any failure there falls back to ``compose down``.

Every Compose call and inspection is timed into the sandbox's
:attr:`~FastStartDockerEnvironment.call_profile` (and the process-wide
:data:`PROFILES`), so a benchmark can say where a start's time goes.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from harbor.environments.base import ExecResult
from harbor.environments.docker.docker import _sanitize_docker_compose_project_name

from harbor_async.backends.docker.cleanup import remove_task_images
from harbor_async.backends.docker.confined import ConfinedDockerEnvironment

#: ``docker compose exec`` flags that take a value, as Harbor passes them (``_compose_exec``).
_EXEC_FLAGS = ("-w", "-e", "-u")


@dataclass(frozen=True)
class CallTiming:
    """One call a sandbox made: what, how long, and whether it was skipped."""

    session: str
    call: str  # "compose build", "compose up", "docker inspect", ...
    seconds: float
    skipped: bool = False
    phase: str = "start"  # "start" until start() returns, then "run"


#: Every call of every fast-start sandbox in this process, in the order they finished (for benchmarks).
PROFILES: list[CallTiming] = []


class FastStartDockerEnvironment(ConfinedDockerEnvironment):
    """Harbor's docker environment with the start's redundant calls removed (see the module doc), bounded as ``docker``."""

    #: Images built (or found built) by this process: one build per image per run.
    _built_images: ClassVar[set[str]] = set()
    #: Images whose OS was checked by this process.
    _checked_images: ClassVar[set[str]] = set()
    #: Whether each image inspected by this process declares a healthcheck (``up --wait`` then waits for it).
    _healthchecks: ClassVar[dict[str, bool]] = {}

    def __init__(self, *args: Any, fast_start: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Whether this sandbox takes the fast start: asked for, and a one-service task (see the module doc).
        self.fast_start = bool(fast_start) and not (Path(self.environment_dir) / "docker-compose.yaml").exists()
        self.call_profile: list[CallTiming] = []
        self._went_up = False
        self._phase = "start"
        self._main_container: str | None = None
        self._force_build = False

    @classmethod
    def forget_images(cls) -> None:
        """Forget which images were built and checked (a new run; tests)."""
        cls._built_images.clear()
        cls._checked_images.clear()
        cls._healthchecks.clear()

    @property
    def kept_build(self) -> str | None:
        """The task image this sandbox's stop keeps for later starts (``None``: a prebuilt image, or Harbor's start,
        whose stop removes its per-sandbox image itself)."""
        if self.fast_start and not getattr(self, "_use_prebuilt", True):
            return self._main_image_name
        return None

    @classmethod
    def delete_kept_builds(cls, images: list[str]) -> list[str]:
        """Remove the task images a run's sandboxes kept (Harbor's ``--delete``, at the run's end); the images
        left, each with the daemon's reason (one a container still uses: another run's sandbox)."""

        removed, kept = remove_task_images(images)
        for image in removed:  # a later start in this process builds it again
            cls._built_images.discard(image)
            cls._checked_images.discard(image)
            cls._healthchecks.pop(image, None)
        return kept

    async def start(self, force_build: bool) -> None:
        if not self.fast_start:  # Harbor's own start, call for call
            await super().start(force_build)
            self._phase = "run"
            return
        self._force_build = bool(force_build)
        if force_build:  # the caller asks for a rebuild: honour it once for this image
            self._built_images.discard(self._main_image_name)
        begin = time.perf_counter()
        try:
            await super().start(force_build)
        finally:
            self._record("start (total)", time.perf_counter() - begin)
            self._phase = "run"

    @property
    def _docker_compose_paths(self) -> list[Path]:
        paths = list(super()._docker_compose_paths)
        if not getattr(self, "fast_start", False) or getattr(self, "_use_prebuilt", True):  # prebuilt: nothing to name
            return paths
        return [*paths, self._image_overlay()]

    def _image_overlay(self) -> Path:
        """The overlay naming the task's image (written once into the sandbox's trial folder)."""
        path = Path(self.trial_paths.trial_dir) / "harbor-async-image.json"
        if not path.exists():
            main = {"image": self._main_image_name, "pull_policy": "never"}
            path.write_text(json.dumps({"services": {"main": main}}))
        return path

    async def _run_docker_compose_command(self, command: list[str], *args: Any, **kwargs: Any) -> ExecResult:
        if not self.fast_start:
            return await super()._run_docker_compose_command(command, *args, **kwargs)
        name = f"compose {command[0]}" if command else "compose"
        if command[:1] == ["build"] and self._main_image_name not in self._built_images and not self._force_build:
            begin = time.perf_counter()
            if await self._image_exists():  # the content-addressed tag is on the daemon: this folder's build
                self._built_images.add(self._main_image_name)
            self._record("docker image inspect (built?)", time.perf_counter() - begin)
        if command[:1] == ["build"] and self._main_image_name in self._built_images:
            self._record(name, 0.0, skipped=True)
            return ExecResult(stdout="", stderr="", return_code=0)
        if command[:1] == ["down"] and not self._went_up and self._phase == "start":
            self._record(name, 0.0, skipped=True)  # a fresh project: nothing to take down
            return ExecResult(stdout="", stderr="", return_code=0)
        if command[:1] == ["up"] and "--wait" in command and not await self._needs_wait():
            command = [arg for arg in command if arg != "--wait"]
            self._record("compose up --wait", 0.0, skipped=True)
        direct = {"exec": self._docker_exec_argv, "cp": self._docker_cp_argv}.get(command[0] if command else "")
        if direct is not None and self._went_up:  # the same call on the main container, without Compose
            argv = await direct(command)
            if argv is not None:
                begin = time.perf_counter()
                result = await self._run_docker(argv, **kwargs)
                self._record(f"docker {command[0]}", time.perf_counter() - begin)
                return result
        if command[:1] == ["down"] and self._went_up:
            begin = time.perf_counter()
            result = await self._remove_project(volumes="--volumes" in command)
            if result is not None:
                self._record("docker rm (down)", time.perf_counter() - begin)
                return result
        if command[:1] == ["down"] and "--rmi" in command and not getattr(self, "_use_prebuilt", True):
            # Compose's --rmi local also removes a named image that has a build section: keep the task's image.
            at = command.index("--rmi")
            command = command[:at] + command[at + 2 :]
        begin = time.perf_counter()
        try:
            result = await super()._run_docker_compose_command(command, *args, **kwargs)
        except RuntimeError:
            if command[:1] != ["up"] or self._main_image_name not in self._built_images or await self._image_exists():
                raise
            # The image was removed since this process built it (`harbor-async sandboxes prune`): build it again, once.
            self._built_images.discard(self._main_image_name)
            await self._run_docker_compose_command(["build"])
            result = await super()._run_docker_compose_command(command, *args, **kwargs)
        self._record(name, time.perf_counter() - begin)
        if command[:1] == ["build"] and result.return_code == 0:
            self._built_images.add(self._main_image_name)
        if command[:1] == ["up"]:
            self._went_up = True
        return result

    async def _needs_wait(self) -> bool:
        """Whether ``up`` must wait for health: a healthcheck in the image or the egress sidecar, or not known."""
        if getattr(self, "_enable_egress_control", True):
            return True
        image = self.task_env_config.docker_image if getattr(self, "_use_prebuilt", True) else self._main_image_name
        if not image:
            return True
        if image not in self._healthchecks:
            found = await self._run_docker(["docker", "image", "inspect", "--format", "{{json .Config.Healthcheck}}", image])
            if found.return_code != 0:
                return True  # not on the daemon yet (a prebuilt image Compose will pull): let Compose wait
            try:
                check = json.loads(found.stdout or "") or {}
            except ValueError:  # not the JSON asked for (a warning mixed in): wait, to be sure
                return True
            test = check.get("Test") if isinstance(check, dict) else ["?"]
            self._healthchecks[image] = bool(test) and test != ["NONE"]
        return self._healthchecks[image]

    async def _image_exists(self) -> bool:
        """Whether the task's image is on the daemon."""
        result = await self._run_docker(["docker", "image", "inspect", "--format", "{{.Id}}", self._main_image_name])
        return result.return_code == 0

    async def _docker_exec_argv(self, command: list[str]) -> list[str] | None:
        """``docker exec`` arguments for a ``compose exec`` in the main container; ``None``: use Compose."""
        at = 1
        while at < len(command) and command[at] in _EXEC_FLAGS:
            at += 2
        if at >= len(command) or command[at] != "main":
            return None
        container = await self._find_main_container()
        if container is None:
            return None
        return ["docker", "exec", *command[1:at], container, *command[at + 1 :]]

    async def _docker_cp_argv(self, command: list[str]) -> list[str] | None:
        """``docker cp`` arguments for a ``compose cp`` to or from ``main``; ``None``: use Compose."""
        if len(command) != 3 or sum(arg.startswith("main:") for arg in command[1:]) != 1:
            return None  # flags, or another service: Compose's own resolution
        container = await self._find_main_container()
        if container is None:
            return None
        return ["docker", "cp", *(container + arg[4:] if arg.startswith("main:") else arg for arg in command[1:])]

    async def _remove_project(self, *, volumes: bool) -> ExecResult | None:
        """``compose down`` by the project's label: containers, networks, (named volumes); ``None``: use Compose."""
        label = f"label=com.docker.compose.project={_sanitize_docker_compose_project_name(self.session_id)}"
        kinds = [("container", ["docker", "ps", "-aq", "--no-trunc", "--filter", label], ["docker", "rm", "-f", "-v"])]
        kinds.append(("network", ["docker", "network", "ls", "-q", "--filter", label], ["docker", "network", "rm"]))
        if volumes:
            kinds.append(("volume", ["docker", "volume", "ls", "-q", "--filter", label], ["docker", "volume", "rm", "-f"]))
        for kind, listing, removal in kinds:  # containers first: a network or volume in use can't go
            found = await self._run_docker(listing)
            if found.return_code != 0:
                return None
            ids = (found.stdout or "").split()
            if ids and kind == "container" and (await self._run_docker(["docker", "stop", *ids])).return_code != 0:
                return None  # stopped first, as Compose does: the processes get SIGTERM and the grace period
            if ids and (await self._run_docker([*removal, *ids])).return_code != 0:
                return None
        self._main_container = None
        return ExecResult(stdout="", stderr="", return_code=0)

    async def _find_main_container(self) -> str | None:
        """The id of this project's main container (looked up once, by Compose's labels)."""
        if self._main_container is None:
            project = _sanitize_docker_compose_project_name(self.session_id)
            result = await self._run_docker(
                ["docker", "ps", "-q", "--no-trunc",
                 "--filter", f"label=com.docker.compose.project={project}",
                 "--filter", "label=com.docker.compose.service=main"],
            )  # fmt: skip
            ids = (result.stdout or "").split()
            if result.return_code != 0 or len(ids) != 1:
                return None  # not exactly one: let Compose resolve it
            self._main_container = ids[0]
        return self._main_container

    async def _run_docker(
        self,
        argv: list[str],
        check: bool = False,
        timeout_sec: int | None = None,
        stdin_data: bytes | None = None,
        on_output: Any = None,
    ) -> ExecResult:
        """Run a docker CLI command the way Harbor runs Compose (merged output, its timeout and streaming)."""
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin_data is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        if on_output is not None:
            result = await self._collect_streamed_output(
                process, timeout_sec=timeout_sec, stdin_data=stdin_data, on_output=on_output
            )
        else:
            result = await self._collect_buffered_output(process, timeout_sec=timeout_sec, stdin_data=stdin_data)
        if check and result.return_code != 0:
            raise RuntimeError(f"docker command failed: {' '.join(argv[:3])}: rc={result.return_code}: {result.stdout}")
        return result

    async def _validate_image_os(self, image_name: str) -> None:
        if not self.fast_start:
            return await super()._validate_image_os(image_name)
        if image_name in self._checked_images:
            self._record("docker inspect (image os)", 0.0, skipped=True)
            return
        begin = time.perf_counter()
        await super()._validate_image_os(image_name)
        self._record("docker inspect (image os)", time.perf_counter() - begin)
        self._checked_images.add(image_name)

    def _record(self, call: str, seconds: float, skipped: bool = False) -> None:
        timing = CallTiming(self.session_id, call, seconds, skipped, self._phase)
        self.call_profile.append(timing)
        PROFILES.append(timing)


def summarize_profiles(profiles: list[CallTiming]) -> dict[str, dict[str, float]]:
    """Per call kind and phase: count, skipped, total and mean seconds (a table for the benchmark's output)."""
    summary: dict[str, dict[str, float]] = {}
    for timing in profiles:
        row = summary.setdefault(f"{timing.phase}: {timing.call}", {"count": 0, "skipped": 0, "seconds": 0.0})
        row["count"] += 1
        row["skipped"] += int(timing.skipped)
        row["seconds"] += timing.seconds
    for row in summary.values():
        ran = row["count"] - row["skipped"]
        row["mean_seconds"] = row["seconds"] / ran if ran else 0.0
    return summary
