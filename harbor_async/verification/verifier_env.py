"""The sandbox a separate verifier runs in: the task's environment, or the verifier's own (Harbor's definition).

Harbor resolves a separate verifier's environment from ``[verifier.environment]``
(a step's first), a ``Dockerfile`` in the tests folder (the tests are then in
the image), else a fresh copy of the task's ``[environment]``. The engine starts
sandboxes of tasks, so the verifier's is started from a view of the task whose
environment folder and settings are the verifier's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task


class _Paths:
    """A task's paths with another environment folder (every other path is the task's)."""

    def __init__(self, paths: Any, environment_dir: Path) -> None:
        self._paths = paths
        self.environment_dir = environment_dir

    def __getattr__(self, name: str) -> Any:
        return getattr(self._paths, name)


def separate_verifier(task: Task, step: StepConfig | None = None) -> bool:
    """Whether the verifier (of ``step``) runs in a sandbox of its own (Harbor's ``environment_mode``, resolved)."""
    from harbor.models.task.verifier_mode import (
        VerifierEnvironmentMode,
        resolve_step_verifier_mode,
        resolve_task_verifier_mode,
    )

    mode = resolve_task_verifier_mode(task.config) if step is None else resolve_step_verifier_mode(task.config, step)
    return mode is VerifierEnvironmentMode.SEPARATE


def verifier_task(task: Task, step: StepConfig | None = None) -> tuple[Task, bool]:
    """The task as its separate verifier's sandbox is built from, and whether the tests are in that image."""
    from harbor.models.task.verifier_mode import resolve_verifier_environment_definition

    definition = resolve_verifier_environment_definition(task.config, task.paths, step)
    if definition is None or (definition.directory == task.paths.environment_dir and not own_environment(task, step)):
        return task, False
    view = copy.copy(task)
    view.config = task.config.model_copy(update={"environment": definition.config})
    view.paths = _Paths(task.paths, definition.directory)
    return view, definition.bundled_tests


def own_environment(task: Task, step: StepConfig | None = None) -> bool:
    """Whether a separate verifier's environment is its own, not a fresh copy of the task's."""
    from harbor.models.task.verifier_mode import resolve_verifier_environment_definition

    if task.config.verifier.environment is not None or (step is not None and step.verifier.environment is not None):
        return True
    try:
        definition = resolve_verifier_environment_definition(task.config, task.paths, step)
    except (ValueError, OSError):  # an input tree Harbor refuses: the task's start reports it
        return False
    return definition is not None and (definition.bundled_tests or definition.directory != task.paths.environment_dir)
