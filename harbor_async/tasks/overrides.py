"""What a run sets on every task, as ``harbor run``'s flags do, applied by the engine at every start.

``--override-cpus/-memory-mb/-storage-mb/-gpus`` (every task's ``[environment]``
resources), ``--artifact`` (a path collected from every sandbox) and
``--ve/--verifier-env`` (variables of every verification, over the task's and
its steps' own ``[verifier.env]``, as Harbor's job-level verifier env wins)
change the tasks themselves: :class:`TaskOverrides` makes the changed copy.

The engine applies them to every task it starts (``Engine(task_overrides=)``),
so ``run``, ``eval``, the cluster's workers (which load each task anew from its
folder) and any other caller of the engine run the same tasks; the driver
applies them too, before any sandbox starts, to check the tasks as they will
run (a GPU override refused where there is none, a ``${VAR}`` in ``--ve`` that
``--env-allow`` does not name). A ``${VAR}`` in a ``--ve`` value is filled as a
task's own is (:mod:`harbor_async.tasks.host_variables`): only from allowed host variables.

``--ae/--agent-env`` is not a task's: the engine hands it to the agent phase
(:func:`agent_exec_env`), never to the verifier.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.task import Task

__all__ = ["TaskOverrides", "agent_exec_env", "parse_env_pairs"]

#: The attribute naming the overrides a task copy was made with.
_APPLIED = "_harbor_async_overrides"


@dataclass(frozen=True)
class TaskOverrides:
    """Every task's changes of one run (see the module doc).

    Attributes:
        resources: ``[environment]`` values (``cpus``, ``memory_mb``, ``storage_mb``, ``gpus``).
        artifacts: sandbox paths collected after the agent, besides the task's own.
        verifier_env: variables of every verification (values may hold ``${VAR}``).
    """

    resources: Mapping[str, Any] = field(default_factory=dict)
    artifacts: tuple[str, ...] = ()
    verifier_env: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.resources or self.artifacts or self.verifier_env)

    def apply(self, task: Task) -> Task:
        """A copy of ``task`` with the overrides set (``task`` itself when there are none)."""
        if not self or getattr(task, _APPLIED, None) == self:  # the episode's copy, launched: not copied again
            return task
        config = task.config.model_copy(deep=True)
        if self.resources:  # bounded later by the backend as a task's own values are
            config.environment = config.environment.model_copy(update=dict(self.resources))
        if self.artifacts:
            known = {a if isinstance(a, str) else a.source for a in config.artifacts}
            config.artifacts = [*config.artifacts, *(p for p in self.artifacts if p not in known)]
        if self.verifier_env:  # Harbor's precedence: the job's verifier env over the step's, over the task's
            config.verifier.env = {**config.verifier.env, **self.verifier_env}
            for step in config.steps or []:
                step.verifier.env = {**(step.verifier.env or {}), **self.verifier_env}
        copied = copy.copy(task)
        copied.config = config
        setattr(copied, _APPLIED, self)
        return copied

    def apply_all(self, tasks: Sequence[Task]) -> dict[int, Task]:
        """Each distinct task (by identity) -> its copy with the overrides: one copy per task, not per attempt."""
        return {id(t): self.apply(t) for t in tasks}


def parse_env_pairs(pairs: Sequence[str] | None, flag: str) -> dict[str, str]:
    """``KEY=VALUE`` pairs as Harbor's ``--ae``/``--ve`` take them (later ones win).

    Raises:
        ValueError: a pair without ``=`` or with no key.
    """
    found: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {pair!r}: write KEY=VALUE")
        found[key.strip()] = value
    return found


@contextlib.contextmanager
def agent_exec_env(environment: BaseEnvironment, env: Mapping[str, str]) -> Iterator[None]:
    """``env`` (the run's ``--ae``, filled) over every command of the agent phase run in this task on ``environment``.

    Harbor's own overlay (``scoped_exec_env``): it stacks over the agent's own
    ``extra_env`` and ends with the block, so the verifier never sees it.
    """
    if not env:
        yield
        return
    with environment.scoped_exec_env(dict(env)):
        yield
