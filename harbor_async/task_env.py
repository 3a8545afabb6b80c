"""``${VAR}`` in a task's ``task.toml`` is filled only from host variables the user allows.

Harbor fills ``${VAR}`` and ``${VAR:-default}`` in ``[environment.env]``,
``[verifier.env]`` and ``[solution.env]`` from the host's whole environment, so
a task (or a suite someone else wrote) can pull ``${HF_TOKEN}`` into the
sandbox, where the agent reads it and the records keep it. Here a variable is
read from the host only if the user allowed it by name (``--env-allow NAME``,
``JobSettings.env_allow``, the shim's ``env_allow=``); otherwise the template's
default is used, and a template without one makes the task refused before any
sandbox starts, naming the variable. The values are filled in before Harbor
sees the task, so Harbor's own filling has nothing left to read.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Collection
from typing import TYPE_CHECKING

from harbor_async.errors import TaskLoadError

if TYPE_CHECKING:
    from harbor.models.task.task import Task

# Harbor's template grammar (harbor.utils.env): a whole value, with an optional default.
_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


class TaskEnvError(TaskLoadError):
    """A task's ``${VAR}`` names a host variable the user did not allow, with no default."""


def _sections(task: Task) -> list[tuple[str, dict[str, str]]]:
    config = task.config
    found = [
        ("environment.env", config.environment.env),
        ("verifier.env", config.verifier.env),
        ("solution.env", config.solution.env),
    ]
    for index, step in enumerate(config.steps or []):
        for part in ("verifier", "solution", "agent"):
            env = getattr(getattr(step, part, None), "env", None)
            if isinstance(env, dict):
                found.append((f"steps[{index}].{part}.env", env))
    return [(name, env) for name, env in found if isinstance(env, dict) and env]


def missing_variables(task: Task, allowed: Collection[str]) -> list[str]:
    """The templates of ``task`` that name a variable not allowed (or not set) and give no default."""
    missing = []
    for section, env in _sections(task):
        for key, value in env.items():
            match = _TEMPLATE.fullmatch(value) if isinstance(value, str) else None
            if match is None or match.group(2) is not None:
                continue
            name = match.group(1)
            if name not in allowed or name not in os.environ:
                missing.append(f"[{section}] {key} = ${{{name}}}")
    return missing


def with_allowed_env(task: Task, allowed: Collection[str]) -> Task:
    """A copy of ``task`` whose ``${VAR}`` templates are filled: allowed host variables, else defaults.

    Raises:
        TaskEnvError: a template names a variable not allowed (or not set on the host) and has no default.
    """
    sections = _sections(task)
    if not any(isinstance(v, str) and "${" in v for _, env in sections for v in env.values()):
        return task
    missing = missing_variables(task, allowed)
    if missing:
        raise TaskEnvError(
            task.paths.task_dir,
            f"{'; '.join(missing)}: not an allowed host variable (allow it with --env-allow NAME), and no default",
        )
    filled = copy.copy(task)
    filled.config = task.config.model_copy(deep=True)
    for _, env in _sections(filled):
        for key, value in list(env.items()):
            match = _TEMPLATE.fullmatch(value) if isinstance(value, str) else None
            if match is not None:
                name, default = match.group(1), match.group(2)
                env[key] = os.environ[name] if name in allowed and name in os.environ else (default or "")
    return filled
