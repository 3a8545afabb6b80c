"""``${VAR}`` in a task's ``task.toml`` is filled only from host variables the user allows.

Harbor fills ``${VAR}`` and ``${VAR:-default}`` in ``[environment.env]``,
``[verifier.env]`` and ``[solution.env]`` from the host's whole environment, so
a task (or a suite someone else wrote) can pull ``${HF_TOKEN}`` into the
sandbox, where the agent reads it and the records keep it. Here a variable is
read from the host only if the user allowed it by name (``--env-allow NAME``,
``JobSettings.env_allow``, the shim's ``env_allow=``); otherwise the template's
default is used, and a template without one makes the task refused before any
sandbox starts, naming the variable.

The values are filled in completely before Harbor sees the task: ``${NAME}``,
``${NAME:-default}`` and ``${NAME-default}`` with defaults that hold templates
themselves, ``$NAME`` without braces, and templates inside other text (``$$``
is a literal ``$``, as in Compose). What is left is escaped so that nothing
fills it again from the host: Harbor fills a value that is a whole ``${...}``
(a value that would still be one is refused), and on docker Compose fills
``$NAME`` anywhere in ``[environment.env]`` (there every ``$`` is written
``$$``). A ``${...}`` form Compose has and Harbor does not (``${NAME:?err}``,
``${NAME:+alt}``) is refused.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from harbor_async.core.errors import HarborAsyncError, TaskLoadError

if TYPE_CHECKING:
    from harbor.models.task.task import Task

# Harbor's template grammar (harbor.utils.env): a value it fills from the host whole.
_HARBOR_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}", re.S)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)(.*))?\Z", re.S)
#: The section whose values Compose reads (and interpolates) on docker; the others go to execs as they are.
COMPOSE_SECTION = "environment.env"


class TaskEnvError(TaskLoadError):
    """A task's ``${VAR}`` names a host variable the user did not allow, with no default (or cannot be filled safely)."""


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


def _closing(text: str, start: int) -> int | None:
    """The index of the ``}`` closing the ``{`` at ``start`` (nested braces counted), or ``None``."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return index
    return None


def expand(text: str, allowed: Collection[str], missing: list[str]) -> str:
    """``text`` with every host-variable reference filled: allowed and set variables, else defaults.

    Names with neither are appended to ``missing`` (and read as empty).

    Raises:
        ValueError: a ``${`` without its ``}``, or a form Harbor does not fill (``${NAME:?err}``).
    """

    def lookup(name: str) -> str | None:
        return os.environ[name] if name in allowed and name in os.environ else None

    out: list[str] = []
    index = 0
    while index < len(text):
        char, following = text[index], text[index + 1 : index + 2]
        if char != "$":
            out.append(char)
            index += 1
        elif following == "$":  # Compose's escape of a literal $
            out.append("$")
            index += 2
        elif following == "{":
            end = _closing(text, index + 1)
            if end is None:
                raise ValueError(f"{text!r}: a ${{ without its }}")
            match = _BRACED.match(text, index + 2, end)
            if match is None:
                raise ValueError(f"{text[index : end + 1]!r} is not ${{NAME}}, ${{NAME:-default}} or ${{NAME-default}}")
            name, operator, default = match.groups()
            value = lookup(name)
            if operator is not None and (value is None or (operator == ":-" and value == "")):
                value = expand(default, allowed, missing)
            elif value is None:
                missing.append(name)
                value = ""
            out.append(value)
            index = end + 1
        elif (match := _NAME.match(text, index + 1)) is not None:  # $NAME, as Compose reads it
            value = lookup(match.group())
            if value is None:
                missing.append(match.group())
            out.append(value or "")
            index = match.end()
        else:  # $1, $(, a trailing $: nothing fills these
            out.append(char)
            index += 1
    return "".join(out)


def _filled(task: Task, allowed: Collection[str], compose: bool) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Every templated value's (section, key, value as handed to Harbor), and what stops the task."""
    filled, problems = [], []
    for section, env in _sections(task):
        for key, value in env.items():
            if not isinstance(value, str) or "$" not in value:
                continue
            missing: list[str] = []
            try:
                result = expand(value, allowed, missing)
            except ValueError as exc:
                problems.append(f"[{section}] {key} = {exc}")
                continue
            problems.extend(f"[{section}] {key} = ${{{name}}}" for name in dict.fromkeys(missing))
            if compose and section == COMPOSE_SECTION:
                result = result.replace("$", "$$")  # Compose reads $$ as one literal $, and fills nothing
            elif _HARBOR_TEMPLATE.fullmatch(result):
                problems.append(f"[{section}] {key} = {result!r} (would be filled from the host again)")
            filled.append((section, key, result))
    return filled, problems


class RunEnvError(HarborAsyncError, ValueError):
    """A run's own variables (``--ae``) name a host variable the user did not allow (or not set) with no default."""


def fill_values(values: Mapping[str, str], allowed: Collection[str], flag: str) -> dict[str, str]:
    """A run flag's ``KEY=VALUE`` variables (``--ae``) with their ``${VAR}`` filled as a task's are: allowed host
    variables, else defaults; the result is literal (nothing fills it again).

    Raises:
        RunEnvError: a reference to a variable not allowed (or not set) with no default, or one not fillable.
    """
    filled: dict[str, str] = {}
    problems: list[str] = []
    for key, value in values.items():
        missing: list[str] = []
        try:
            filled[key] = expand(value, allowed, missing)
        except ValueError as exc:
            problems.append(f"{flag} {key}={exc}")
            continue
        problems.extend(f"{flag} {key}=${{{name}}}" for name in dict.fromkeys(missing))
    if problems:
        raise RunEnvError(
            f"{'; '.join(problems)}: not an allowed host variable (allow it with --env-allow NAME), and no default"
        )
    return filled


def missing_variables(task: Task, allowed: Collection[str]) -> list[str]:
    """What stops ``task``: each ``"[section] KEY = ${NAME}"`` naming a variable not allowed (or not set) without a default.

    Also a value that cannot be filled safely (a form Harbor does not fill, an unclosed ``${``).
    """
    return _filled(task, allowed, compose=False)[1]


def compose_fills(environment_class: type) -> bool:
    """Whether the backend hands ``[environment.env]`` to Compose, which fills ``$NAME`` from the host."""
    from harbor.environments.docker.docker import DockerEnvironment

    return issubclass(environment_class, DockerEnvironment)


def with_allowed_env(task: Task, allowed: Collection[str], *, compose: bool = False) -> Task:
    """A copy of ``task`` whose host-variable references are filled (allowed variables, else defaults) and escaped.

    ``compose``: the backend gives ``[environment.env]`` to Compose (:func:`compose_fills`).

    Raises:
        TaskEnvError: a reference names a variable not allowed (or not set on the host) with no default, or a
            value cannot be filled safely.
    """
    filled, problems = _filled(task, allowed, compose)
    if problems:
        raise TaskEnvError(
            task.paths.task_dir,
            f"{'; '.join(problems)}: not an allowed host variable (allow it with --env-allow NAME), and no default",
        )
    if not filled:
        return task
    copied = copy.copy(task)
    copied.config = task.config.model_copy(deep=True)
    sections = dict(_sections(copied))
    for section, key, value in filled:
        sections[section][key] = value
    return copied
