"""Artifacts: what an episode leaves for the record, collected as Harbor collects them, into the job folder.

After the agent (of each step), the task's declared ``artifacts`` (task-level
and the step's) and the convention folder ``/logs/artifacts`` are downloaded
with Harbor's own ``ArtifactHandler``, best effort, with its ``manifest.json``
of every attempt, into the episode's Harbor trial folder, ``<job>/<trial>/artifacts/``
(a step's into ``<job>/<trial>/steps/<name>/artifacts/``), where Harbor keeps them. Every download goes through the backend's bounded
transfers (the local backend's and the confined docker's: a size budget, no
links followed out), so a sandbox cannot fill the host disk through them.

A separate verifier (``[verifier] environment_mode = "separate"``) gets these
files back in its own, fresh sandbox of the task's environment, through
Harbor's sanitising upload (setuid bits cleared, links out of an artifact
skipped).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task

log = logging.getLogger(__name__)

#: Seconds one collection may take (every artifact of one episode or step).
COLLECT_TIMEOUT = 300.0


def _handler(task: Task, step: StepConfig | None):
    from harbor.trial.artifact_handler import ArtifactHandler

    return ArtifactHandler(artifacts=[*task.config.artifacts, *(step.artifacts if step else [])], logger=log)


async def collect_artifacts(environment: BaseEnvironment, task: Task, target: Path, step: StepConfig | None = None) -> None:
    """Download the artifacts into ``target`` (best effort: a failure is in the manifest, not raised)."""
    from harbor.models.trial.paths import EnvironmentPaths

    paths = EnvironmentPaths.for_os(environment.os)
    with anyio.move_on_after(COLLECT_TIMEOUT):
        await _handler(task, step).download_artifacts(environment, target, source_artifacts_dir=paths.artifacts_dir)


async def upload_artifacts(environment: BaseEnvironment, task: Task, source: Path, step: StepConfig | None = None) -> None:
    """Put the collected artifacts back at their paths in a separate verifier's sandbox."""
    from harbor.models.trial.paths import EnvironmentPaths

    paths = EnvironmentPaths.for_os(environment.os)
    await _handler(task, step).upload_artifacts(
        environment, source, source_artifacts_dir=paths.artifacts_dir, target_artifacts_dir=paths.artifacts_dir
    )


def prune_excluded(folder: Path, patterns: list[str]) -> None:
    """Remove what ``tar --exclude PATTERN`` would have left out of ``folder`` (a name or a relative path glob).

    The backends download a folder whole within their transfer budget, then
    drop the excluded entries: Harbor's own way (a gzip made in the sandbox,
    unpacked on the host) has no bound on what the archive expands to.
    """
    if not patterns:
        return
    for current, dirnames, filenames in os.walk(folder, topdown=True):
        relative = Path(current).relative_to(folder)
        for name in [*dirnames, *filenames]:
            path = (relative / name).as_posix()
            if any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(path, p.lstrip("./")) for p in patterns):
                entry = Path(current, name)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                    dirnames.remove(name)
                else:
                    entry.unlink()
