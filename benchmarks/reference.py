"""TRL's own Harbor env, unchanged, on any backend: the baseline for tests and benchmarks.

TRL's ``HarborEnv._start`` builds its sandbox with
``TrialEnvironmentConfig(type=environment_type)``, which accepts only Harbor's
built-in types. To compare TRL's env with the shim on this project's backends
(``local``, ``simulated``) or any ``"package.module:Class"``, the subclasses
here change that one thing and nothing else: while *their own* ``_start`` runs,
Harbor's ``EnvironmentFactory.create_environment_from_config`` receives the
backend as an import path (plus ``backend_kwargs``). Everything else is TRL's
code: its loop per env, its sequential reset, its output formatting, its
verifier call, its ``__del__`` (skipped only at interpreter exit, where it
would wait for ever on a loop thread the interpreter has frozen).

How: a context variable set around ``super()._start()`` (asyncio gives each
task its own context, so concurrent envs never see each other's backend), and
a pass-through wrapper installed once on the factory method that reads it.
With the variable unset (any other Harbor user in the process) the wrapper
calls the original unchanged.

Usage::

    from benchmarks.reference import ReferenceHarborBashEnv, close_reference_env

    env = ReferenceHarborBashEnv(environment_type="local")
    prompt = env.reset(task_dir=...)      # TRL: blocks for start + setup
    out = env.bash("pwd")
    reward = env.reward
    close_reference_env(env)              # TRL has no close; see below

or in a spec: ``trl.experimental.harbor.HarborSpec(..., agent=ReferenceHarborBashEnv,
environment_type="local")``.

Importing this module imports ``trl`` (the ``trl`` extra).
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.harbor import HarborBashEnv, HarborEnv

from harbor_async.backends import resolve_backend
from harbor_async.cli.machine_checks import require_supported

# This module overrides TRL's private _start: only the TRL releases CI tested.
require_supported("trl", "benchmarks/reference.py (TRL's HarborEnv internals)", "trl-internals")

#: (import path, extra kwargs) for the Harbor environment the current ``_start`` creates.
_OVERRIDE: contextvars.ContextVar[tuple[str, dict[str, Any]] | None] = contextvars.ContextVar(
    "trl_reference_backend", default=None
)
_hook_lock = threading.Lock()
_hook_installed = False


def _install_factory_hook() -> None:
    """Wrap ``EnvironmentFactory.create_environment_from_config`` once (pass-through when unset)."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        from harbor.environments.factory import EnvironmentFactory

        original = EnvironmentFactory.create_environment_from_config  # bound classmethod

        def create_environment_from_config(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
            override = _OVERRIDE.get()
            if override is not None:
                import_path, extra = override
                config = config.model_copy(
                    update={"type": None, "import_path": import_path, "kwargs": {**config.kwargs, **extra}}
                )
            return original(config, *args, **kwargs)

        EnvironmentFactory.create_environment_from_config = classmethod(create_environment_from_config)
        _hook_installed = True


class _AnyBackend:
    """Mixin for a TRL ``HarborEnv`` class: ``environment_type`` may be any backend name this project resolves."""

    def __init__(
        self,
        environment_type: str = "docker",
        backend_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        backend = resolve_backend(environment_type)
        if backend.import_path is None and not backend_kwargs:
            # A Harbor type and no extra arguments: exactly TRL's env.
            override = None
        else:
            path = backend.import_path or _harbor_type_import_path(backend.type)
            override = (path, dict(backend_kwargs or {}))
            _install_factory_hook()
        # TRL validates the type in its own _start (TrialEnvironmentConfig(type=...)),
        # before the hook swaps in the import path: give it a valid placeholder.
        placeholder = environment_type if override is None else "docker"
        super().__init__(environment_type=placeholder, **kwargs)  # type: ignore[call-arg]
        self._backend_override = override
        self._backend_name = environment_type

    def __del__(self) -> None:
        # TRL's __del__ waits for its loop thread; at interpreter exit that daemon thread is
        # frozen and the wait never ends (a benchmark that failed mid-step hung there for
        # good). close_reference_env stops the sandbox before then.
        if sys.is_finalizing():
            return
        super().__del__()  # type: ignore[misc]

    async def _start(self, task_dir: str) -> str:
        token = _OVERRIDE.set(self._backend_override)
        try:
            return await super()._start(task_dir)  # type: ignore[misc]
        finally:
            _OVERRIDE.reset(token)


def _harbor_type_import_path(env_type: str | None) -> str:
    """The import path of a Harbor built-in type (to pass ``backend_kwargs`` along with it)."""
    from harbor.environments.factory import _load_environment_class
    from harbor.models.environment_type import EnvironmentType

    cls = _load_environment_class(EnvironmentType(env_type))
    return f"{cls.__module__}:{cls.__qualname__}"


class ReferenceHarborEnv(_AnyBackend, HarborEnv):
    """TRL's ``HarborEnv`` on any backend (``local``, ``simulated``, ``pkg.mod:Class``, Harbor types)."""


class ReferenceHarborBashEnv(_AnyBackend, HarborBashEnv):
    """TRL's ``HarborBashEnv`` on any backend."""


def close_reference_env(env: HarborEnv) -> None:
    """Stop a TRL env's sandbox the way its ``__del__`` would, without its hazards.

    TRL has no close hook. Its ``__del__`` stops the sandbox through the env's
    loop and then stops that loop; once the loop is stopped a second call
    would wait forever, so this leaves the loop running (``__del__`` stops it
    when the env is collected). TRL also never removes its trial folder
    (``/tmp/harbor_trl_*``); this does.
    """
    import shutil

    env._run(env._stop())
    paths = getattr(env, "_paths", None)
    if paths is not None:
        shutil.rmtree(paths.trial_dir, ignore_errors=True)
        env._paths = None
