"""Import paths of the flat layout (before the subpackages): they keep working for one release, with a warning.

A module that moved is found under its old name by a finder on ``sys.meta_path``
(:func:`install`): the old name is bound to the module itself, so both names
hold one module object and patching either patches both. Three old modules
share their name with the package that took their place (``engine``, ``tasks``,
``jobs``): those packages forward their old module's names
(:func:`moved_attribute`). Four classes were renamed too (:data:`RENAMED`);
their modules answer the old names (:func:`renamed_attribute`). Either way the first use warns with a
:class:`DeprecationWarning` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

#: Old module path -> new module path.
MOVED: dict[str, str] = {
    "harbor_async.agent": "harbor_async.agents.tool_loop",
    "harbor_async.artifacts": "harbor_async.verification.artifacts",
    "harbor_async.bounded_output": "harbor_async.core.bounded_output",
    "harbor_async.budget": "harbor_async.engine.budget",
    "harbor_async.checkpoints": "harbor_async.models.checkpoints",
    "harbor_async.collector": "harbor_async.core.collector",
    "harbor_async.disk_bounds": "harbor_async.verification.disk_bounds",
    "harbor_async.doctor": "harbor_async.cli.machine_checks",
    "harbor_async.episode": "harbor_async.episodes.episode",
    "harbor_async.errors": "harbor_async.core.errors",
    "harbor_async.files": "harbor_async.core.files",
    "harbor_async.harbor_agents": "harbor_async.agents.harbor",
    "harbor_async.harbor_episode_agent": "harbor_async.agents.harbor_episode",
    "harbor_async.harbor_jobs": "harbor_async.jobs.harbor_layout",
    "harbor_async.host_resources": "harbor_async.tasks.resources",
    "harbor_async.interrupts": "harbor_async.core.interrupts",
    "harbor_async.job_config": "harbor_async.jobs.harbor_config",
    "harbor_async.judging": "harbor_async.episodes.judging",
    "harbor_async.leftovers": "harbor_async.backends.leftovers",
    "harbor_async.logs": "harbor_async.core.logs",
    "harbor_async.loop": "harbor_async.engine.loop",
    "harbor_async.model_agent": "harbor_async.agents.harness_agent",
    "harbor_async.model_server": "harbor_async.models.model_server",
    "harbor_async.mounts": "harbor_async.tasks.mounts",
    "harbor_async.naming": "harbor_async.core.naming",
    "harbor_async.phase_scope": "harbor_async.engine.phase_scope",
    "harbor_async.plots": "harbor_async.jobs.plots",
    "harbor_async.policy": "harbor_async.core.policy",
    "harbor_async.printing": "harbor_async.core.printing",
    "harbor_async.reaper": "harbor_async.backends.reaper",
    "harbor_async.records": "harbor_async.core.records",
    "harbor_async.registry": "harbor_async.tasks.registry",
    "harbor_async.results": "harbor_async.core.results",
    "harbor_async.retries": "harbor_async.jobs.retries",
    "harbor_async.reward_files": "harbor_async.verification.reward_files",
    "harbor_async.runner": "harbor_async.episodes.runner",
    "harbor_async.sandbox": "harbor_async.engine.sandbox",
    "harbor_async.scoring": "harbor_async.jobs.scoring",
    "harbor_async.serve": "harbor_async.models.serve",
    "harbor_async.setting_fields": "harbor_async.jobs.setting_fields",
    "harbor_async.settings": "harbor_async.jobs.settings",
    "harbor_async.stats": "harbor_async.core.stats",
    "harbor_async.steps": "harbor_async.episodes.steps",
    "harbor_async.task_env": "harbor_async.tasks.host_variables",
    "harbor_async.task_files": "harbor_async.tasks.files",
    "harbor_async.task_overrides": "harbor_async.tasks.overrides",
    "harbor_async.task_support": "harbor_async.agents.task_checks",
    "harbor_async.tool_messages": "harbor_async.episodes.tool_messages",
    "harbor_async.trajectory": "harbor_async.jobs.trajectory",
    "harbor_async.transfer_budget": "harbor_async.verification.transfer_budget",
    "harbor_async.verifier_env": "harbor_async.verification.verifier_env",
    "harbor_async.verifier_isolation": "harbor_async.verification.isolation",
}

#: Packages that took an old module's name -> where that module's names live now.
FORWARDED: dict[str, str] = {
    "harbor_async.engine": "harbor_async.engine.engine",
    "harbor_async.jobs": "harbor_async.jobs.folder",
    "harbor_async.tasks": "harbor_async.tasks.suite",
}


#: Classes renamed with the move: module -> {old name: new name}.
RENAMED: dict[str, dict[str, str]] = {
    "harbor_async.agents.harbor_episode": {"HarborEpisodeAgent": "HarborAgentRunner"},
    "harbor_async.agents.harness_agent": {"ModelAgent": "HarnessAgent"},
    "harbor_async.agents.tool_loop": {"Agent": "ToolLoop"},
    "harbor_async.episodes.runner": {"HarborAgent": "BuiltinAgent"},
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=stacklevel)


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of :data:`MOVED` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, MOVED[spec.name], 3)  # the import system's own frames are skipped
        # The module itself, not a copy: its own __spec__ and __name__ stay (the import system sets only missing ones).
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path has run already."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


def moved_attribute(package: str, name: str) -> Any:
    """A package's ``__getattr__`` for the names of the old module it replaced (see :data:`FORWARDED`).

    Raises:
        AttributeError: ``name`` is a submodule (the import system then imports it) or no name of the old module.
    """
    home = FORWARDED[package]
    if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(name)
    module = importlib.import_module(home)
    if not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{home}.{name}", 4)  # the frame that asked the package
    return getattr(module, name)


def renamed_attribute(module: str, name: str) -> Any:
    """A module's ``__getattr__`` for its classes' old names (see :data:`RENAMED`).

    Raises:
        AttributeError: ``name`` is no old name of ``module``.
    """
    new = RENAMED.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{module}.{new}", 4)
    return getattr(sys.modules[module], new)
