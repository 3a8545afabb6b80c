"""Cheaper Harbor ``docker`` starts: each image built once per run, no pointless Compose calls, a per-call profile.

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
  ``pull_policy: never``; the first start of a task runs ``compose build``
  (Harbor's per-image lock serialises it), the others reuse the image, and the
  stop's ``down`` runs without ``--rmi local`` (which would delete it). The images stay in the
  daemon's cache after the run, as Harbor's prebuilt images do (``docker rmi
  'hb__*'`` removes them). Tasks with a prebuilt image are left as they are.
- the image's OS is inspected once per image per process;
- ``compose down`` before this sandbox's first ``up`` is skipped: the project
  name is the sandbox's fresh session id, so there is nothing to tear down.
  The ``down`` of ``stop()`` runs as before.

Every Compose call and inspection is timed into the sandbox's
:attr:`~FastStartDockerEnvironment.call_profile` (and the process-wide
:data:`PROFILES`), so a benchmark can say where a start's time goes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from harbor.environments.base import ExecResult
from harbor.environments.docker.docker import DockerEnvironment


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


class FastStartDockerEnvironment(DockerEnvironment):
    """Harbor's docker environment with the start's redundant calls removed (see the module doc)."""

    #: Images built (or found built) by this process: one build per image per run.
    _built_images: ClassVar[set[str]] = set()
    #: Images whose OS was checked by this process.
    _checked_images: ClassVar[set[str]] = set()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.call_profile: list[CallTiming] = []
        self._went_up = False
        self._phase = "start"

    @classmethod
    def forget_images(cls) -> None:
        """Forget which images were built and checked (a new run; tests)."""
        cls._built_images.clear()
        cls._checked_images.clear()

    async def start(self, force_build: bool) -> None:
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
        if getattr(self, "_use_prebuilt", True):  # set by start(); a prebuilt image needs nothing
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
        name = f"compose {command[0]}" if command else "compose"
        if command[:1] == ["build"] and self._main_image_name in self._built_images:
            self._record(name, 0.0, skipped=True)
            return ExecResult(stdout="", stderr="", return_code=0)
        if command[:1] == ["down"] and not self._went_up and self._phase == "start":
            self._record(name, 0.0, skipped=True)  # a fresh project: nothing to take down
            return ExecResult(stdout="", stderr="", return_code=0)
        if command[:1] == ["down"] and "--rmi" in command and not getattr(self, "_use_prebuilt", True):
            # Compose's --rmi local also removes a named image that has a build section: keep the task's image.
            at = command.index("--rmi")
            command = command[:at] + command[at + 2 :]
        begin = time.perf_counter()
        result = await super()._run_docker_compose_command(command, *args, **kwargs)
        self._record(name, time.perf_counter() - begin)
        if command[:1] == ["build"] and result.return_code == 0:
            self._built_images.add(self._main_image_name)
        if command[:1] == ["up"]:
            self._went_up = True
        return result

    async def _validate_image_os(self, image_name: str) -> None:
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
