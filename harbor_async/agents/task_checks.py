"""Whether every task of a run can be run as it is written, checked before any sandbox starts.

Harbor's task model has more than most backends and drivers can honour. A task
that asks for something the run cannot give (a separate verifier container, a
network policy the backend cannot enforce, a non-root user on ``local``, more
than one step through TRL's one-reset-one-reward interface, ...) is refused
here, for the whole suite at once, with one line per task naming the feature and
the backend; it is never run differently from what it says. The host variables
the tasks' ``${VAR}`` templates need are checked here too, into one table.

``run``, ``eval`` and the shim call :func:`check_tasks`; Harbor's own
environment classes judge what they can honour (GPUs, TPUs, Windows, network
policies) when built with the task's settings, nothing started. A Harbor agent
(``-a terminus-2``, ``claude-code``, ...) is checked too: an agent that cannot
run on the backend at all is one line (:class:`UnsupportedAgentError`), one that
cannot run in a task's network policy a refusal of that task
(:mod:`harbor_async.agents.harbor`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harbor.models.task.config import NetworkMode, TaskOS

from harbor_async.core.errors import HarborAsyncError
from harbor_async.tasks.host_variables import missing_variables
from harbor_async.verification.verifier_env import own_environment, separate_verifier

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.tasks.overrides import TaskOverrides

ROOT_USERS = (None, 0, "0", "root")


@dataclass(frozen=True)
class Refusal:
    """One task feature that this run cannot honour."""

    task: str
    feature: str
    reason: str

    def line(self) -> str:
        """``task X: FEATURE: REASON``."""
        return f"task {self.task}: {self.feature}: {self.reason}"


@dataclass(frozen=True)
class MissingVariable:
    """A ``${VAR}`` of a task that no allowed host variable and no default fills."""

    task: str
    where: str  # "[verifier.env] KEY"
    variable: str


class UnsupportedTaskError(HarborAsyncError, ValueError):
    """Tasks of the run ask for what the backend or the driver cannot honour (bad input: exit 2)."""

    def __init__(self, refusals: Sequence[Refusal], backend: str) -> None:
        self.refusals = list(refusals)
        self.backend = backend
        lines = "\n".join("  " + r.line() for r in self.refusals)
        super().__init__(
            f"{len(self.refusals)} task feature(s) cannot be honoured on backend {backend!r}; "
            f"no sandbox was started:\n{lines}"
        )


class UnsupportedAgentError(UnsupportedTaskError):
    """The run's agent cannot run on the backend at all (bad input: exit 2); one line, no sandbox started."""

    def __init__(self, reason: str, backend: str) -> None:
        self.refusals, self.backend = [], backend
        ValueError.__init__(self, f"{reason}; no sandbox was started")


class MissingVariablesError(HarborAsyncError, ValueError):
    """Tasks of the run need host variables the user did not allow (or that are not set)."""

    def __init__(self, missing: Sequence[MissingVariable], allow_flag: str = "--env-allow NAME") -> None:
        self.missing = list(missing)
        width_task = max(len("task"), *(len(m.task) for m in self.missing))
        width_where = max(len("setting"), *(len(m.where) for m in self.missing))
        rows = [f"  {'task':<{width_task}}  {'setting':<{width_where}}  variable"]
        rows += [f"  {m.task:<{width_task}}  {m.where:<{width_where}}  {m.variable}" for m in self.missing]
        names = sorted({m.variable for m in self.missing})
        super().__init__(
            f"{len(self.missing)} required variable(s) are not allowed host variables and have no default "
            f"(allow each with {allow_flag}; set: {', '.join(n for n in names if n in os.environ) or 'none'}):\n"
            + "\n".join(rows)
        )


@dataclass(frozen=True)
class Driver:
    """What drives the episodes: whether it can run several steps, and whether a model acts.

    ``multi_step``: the driver gives each step its own instruction and reward
    (``run`` and ``eval``; not TRL's ``environment_factory``: one reset, one
    reward). ``model_harness``: a model acts through a tool harness (``eval``,
    the shim), which cannot wire MCP servers or skills into the model.
    ``agent``: the Harbor agent class that acts (``-a``), checked against the
    backend and each task; ``None``: a harness, or one of the model-free agents.
    """

    name: str
    multi_step: bool = True
    model_harness: bool = False
    agent: type | None = None


RUN = Driver("run")
EVAL = Driver("eval", model_harness=True)
TRL = Driver("TRL's environment_factory", multi_step=False, model_harness=True)


def check_tasks(
    tasks: Sequence[Task],
    backend: BackendSpec,
    *,
    driver: Driver,
    env_allow: Collection[str] = (),
    backend_kwargs: Mapping[str, Any] | None = None,
    allow_flag: str = "--env-allow NAME",
    alone: bool = False,
    overrides: TaskOverrides | None = None,
) -> list[Refusal]:
    """Refuse the run if any task cannot be run as written; check every ``${VAR}`` it needs.

    ``alone``: a task with a feature that cannot be honoured is refused alone
    (Harbor runs the rest of a suite too): its refusals are returned, and the
    run goes on without it; only when every task is refused is the run.
    ``overrides``: the run's changes of every task (:mod:`harbor_async.tasks.overrides`), checked as the
    engine will start the tasks.

    Raises:
        UnsupportedAgentError: the driver's agent cannot run on ``backend`` at all (one line).
        MissingVariablesError: a table of every missing variable of every task.
        UnsupportedTaskError: one line per task feature that cannot be honoured (with ``alone``: of every task).
    """
    if driver.agent is not None:
        from harbor_async.agents.harbor import backend_refusal
        from harbor_async.backends.local import LocalEnvironment

        reason = backend_refusal(driver.agent, local=issubclass(backend.environment_class(), LocalEnvironment))
        if reason is not None:
            raise UnsupportedAgentError(reason, backend.name)
    if overrides:
        tasks = list(overrides.apply_all(tasks).values())
    missing = [
        MissingVariable(task.name, *_split(line))
        for task in _distinct(tasks)
        for line in missing_variables(task, env_allow)
    ]
    if missing:
        raise MissingVariablesError(missing, allow_flag)
    kwargs = dict(backend_kwargs or {})
    refusals = [r for task in _distinct(tasks) for r in task_refusals(task, backend, driver=driver, backend_kwargs=kwargs)]
    if refusals and (not alone or {r.task for r in refusals} >= {task.name for task in tasks}):
        raise UnsupportedTaskError(refusals, backend.name)
    return refusals


def refused_summary(refusals: Sequence[Refusal]) -> list[dict[str, str]]:
    """The refused tasks as a job's ``summary.json`` lists them (``refused``)."""
    return [{"task": r.task, "feature": r.feature, "reason": r.reason} for r in refusals]


def _distinct(tasks: Sequence[Task]) -> list[Task]:
    seen: dict[int, Task] = {}
    for task in tasks:
        seen.setdefault(id(task), task)
    return list(seen.values())


def _split(line: str) -> tuple[str, str]:
    """``"[verifier.env] KEY = ${NAME}"`` -> (``"[verifier.env] KEY"``, ``"NAME"``)."""
    where, _, template = line.partition(" = ")
    return where, template.removeprefix("${").removesuffix("}")


def task_refusals(
    task: Task, backend: BackendSpec, *, driver: Driver, backend_kwargs: Mapping[str, Any] | None = None
) -> list[Refusal]:
    """Every feature of ``task`` that ``backend`` driven by ``driver`` cannot honour (empty: it runs as written)."""
    found = driver_refusals(task, driver)

    def refuse(feature: str, reason: str) -> None:
        found.append(Refusal(task.name, feature, reason))

    config, steps = task.config, list(task.config.steps or [])
    from harbor_async.backends.local import LocalEnvironment

    local = issubclass(backend.environment_class(), LocalEnvironment)
    if local:
        users = [("[agent] user", config.agent.user), ("[verifier] user", config.verifier.user)]
        users += [(f"[steps.{s.name}.agent] user", s.agent.user) for s in steps]
        users += [(f"[steps.{s.name}.verifier] user", s.verifier.user) for s in steps]
        for feature, user in users:
            if user not in ROOT_USERS:
                refuse(f"{feature} = {user!r}", "local sandboxes run every command as their root")
        if _asks_public_network(task) and str((backend_kwargs or {}).get("allow_offline", "")).lower() not in ("true", "1"):
            refuse(
                "network_mode = 'public'",
                "local sandboxes have no network (run such tasks offline with --ek allow_offline=true)",
            )
        for where, step in [("[verifier]", None), *((f"[steps.{s.name}.verifier]", s) for s in steps)]:
            if separate_verifier(task, step) and own_environment(task, step):
                refuse(f"{where} environment", "a verifier image of its own needs a backend that builds images")
        from harbor_async.backends.local.dockerfile import unsupported_instructions

        for line in unsupported_instructions(task.paths.environment_dir / "Dockerfile"):
            refuse(f"environment/Dockerfile {line}", "the local backend cannot build it")
    problem = backend_refusal(task, backend, backend_kwargs or {})
    if problem is not None:
        refuse(*problem)
    return found


def driver_refusals(task: Task, driver: Driver) -> list[Refusal]:
    """The features of ``task`` that no backend driven by ``driver`` honours (cheap: reads the task only)."""
    found: list[Refusal] = []

    def refuse(feature: str, reason: str) -> None:
        found.append(Refusal(task.name, feature, reason))

    config, steps = task.config, list(task.config.steps or [])
    if steps and not driver.multi_step:
        refuse(f"[[steps]] ({len(steps)} steps)", f"{driver.name} gives one instruction and takes one reward per episode")
    for where, step in [("[verifier]", None), *((f"[steps.{s.name}.verifier]", s) for s in steps)]:
        verifier = step.verifier if step is not None else config.verifier
        if separate_verifier(task, step):
            if not driver.multi_step:  # TRL's driver: its live-sandbox limit counts the rollouts, not their judges
                refuse(f"{where} environment_mode = 'separate'", f"{driver.name} cannot start a second sandbox per rollout")
        if verifier.collect:
            refuse(f"{where} collect", "collect hooks need Compose services, which harbor-async does not run")
    if driver.model_harness and config.environment.mcp_servers:
        refuse("[environment] mcp_servers", f"the tool harness of {driver.name} cannot connect the model to MCP servers")
    if driver.model_harness and config.environment.skills_dir:
        refuse("[environment] skills_dir", f"the tool harness of {driver.name} has no skills folder")
    if driver.agent is not None:  # an agent that installs itself needs the network (harbor_async.agents.harbor)
        from harbor_async.agents.harbor import task_refusals as agent_refusals

        for feature, reason in agent_refusals(task, driver.agent):
            refuse(feature, reason)
    return found


def _asks_public_network(task: Task) -> bool:
    """Whether the task says, in so many words, that its environment or a phase needs the public network."""
    config = task.config
    environment = config.environment
    if "network_mode" in environment.model_fields_set and environment.network_mode.value == "public":
        return True
    phases = (config.agent, config.verifier, *(p for s in config.steps or [] for p in (s.agent, s.verifier)))
    return any(getattr(p.explicit_phase_policy(), "network_mode", None) == NetworkMode.PUBLIC for p in phases)


def backend_refusal(task: Task, backend: BackendSpec, backend_kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
    """Build the task's environment with its network policies (nothing started): Harbor's own refusal, if any.

    Harbor's environment classes check at construction what they can honour:
    GPUs, TPUs, Windows containers, network policies. A refusal comes back as
    (feature, reason). An error that a plain task (no GPU, TPU or policy,
    Linux) meets as well is not the task's features: a missing client package,
    a daemon that is down ... are left to the start, which reports them with
    their own types.
    """
    problem = backend.construction_error(task, backend_kwargs)
    if problem is None:
        return None
    plain = copy.copy(task)
    plain.config = task.config.model_copy(deep=True)
    plain.config.environment = plain.config.environment.model_copy(
        update={"gpus": None, "gpu_types": None, "tpu": None, "os": TaskOS.LINUX, "network_mode": NetworkMode.PUBLIC,
                "allowed_hosts": None}
    )  # fmt: skip
    for part in (plain.config.agent, plain.config.verifier, *(p for st in plain.config.steps or [] for p in (st.agent, st.verifier))):
        part.network_mode, part.allowed_hosts = None, None
    if backend.construction_error(plain, backend_kwargs) is not None:
        return None
    text = str(problem).strip().splitlines()[0] if str(problem).strip() else type(problem).__name__
    return _feature_of(text), text


def _feature_of(text: str) -> str:
    lowered = text.lower()
    for needle, feature in (
        ("network", "network_mode"),
        ("gpu", "[environment] gpus"),
        ("tpu", "[environment] tpu"),
        ("windows", "[environment] os = 'windows'"),
    ):
        if needle in lowered:
            return feature
    return "[environment]"
