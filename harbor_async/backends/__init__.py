"""Backend names: Harbor's environment types, this project's short names, import paths.

Imports: core, tasks, verification.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_async.core.errors import AsyncLibraryError, BackendError

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.config import NetworkPolicy
    from harbor.models.task.task import Task
    from harbor.models.trial.paths import TrialPaths

    from harbor_async.backends.options import BackendOptions

#: This project's Harbor environments, selectable by short name.
SHORT_NAMES: dict[str, str] = {
    "local": "harbor_async.backends.local:LocalEnvironment",
    "simulated": "harbor_async.backends.simulated:SimulatedEnvironment",
    "docker-fast": "harbor_async.backends.docker.fast_start:FastStartDockerEnvironment",
}
#: Harbor types run with this project's subclass of Harbor's class (the type stays the same). ``docker``
#: takes the fast start (each task image built once per run); ``--ek fast_start=false`` gives Harbor's.
CONFINED_TYPES: dict[str, str] = {
    "docker": "harbor_async.backends.docker.fast_start:FastStartDockerEnvironment",
}


@dataclass(frozen=True)
class BackendSpec:
    """A resolved backend: a Harbor environment type, an import path, or both (a type run with our subclass)."""

    name: str
    type: str | None = None
    import_path: str | None = None

    def environment_class(self) -> builtins.type:  # builtins: `type` is the field above
        """The Harbor environment class (imports it; vendor SDKs load only here)."""
        return _environment_class(self)

    @cached_property
    def on_this_machine(self) -> bool:
        """Whether its sandboxes run on this machine (local, docker): their start latency is the machine's load."""
        from harbor.environments.docker.docker import DockerEnvironment

        from harbor_async.backends.local import LocalEnvironment

        return issubclass(self.environment_class(), (LocalEnvironment, DockerEnvironment))

    @cached_property
    def uses_docker(self) -> bool:
        """Whether its sandboxes are this machine's Docker daemon's containers (what the reaper scans there)."""
        from harbor.environments.docker.docker import DockerEnvironment

        return issubclass(self.environment_class(), DockerEnvironment)

    def options(self) -> BackendOptions:
        """What this backend accepts as options, read off the installed Harbor (loads the class)."""
        from harbor_async.backends.options import options_of

        return options_of(self.name, self.environment_class())

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Refuse options this backend does not take (see :mod:`harbor_async.backends.options`).

        Raises:
            BackendOptionsError: unknown names (with the valid ones and a "did
                you mean"), or values the installed Harbor's schema refuses.
        """
        self.options().check(options)

    def create_environment(
        self,
        task: Task,
        trial_paths: TrialPaths,
        *,
        session_id: str,
        run_label: str,
        backend_kwargs: Mapping[str, Any],
        options: Mapping[str, Any],
    ) -> BaseEnvironment:
        """Build the Harbor environment of one start, as every start and ``doctor`` build it.

        ``backend_kwargs`` are the user's options; the run label is added where
        the backend takes it, and :meth:`start_extras` where it wants them.
        ``options["mounts"]``: the run's host mounts (``--mounts``, :mod:`harbor_async.tasks.mounts`),
        passed as Harbor's own ``mounts`` (never a user's option: the backend's checks stand).
        Nothing is started.
        """
        from harbor.environments.factory import EnvironmentFactory
        from harbor.models.trial.config import (
            EnvironmentConfig as TrialEnvironmentConfig,
        )

        kwargs = self.options().engine_options(run_label, backend_kwargs)
        if getattr(self.environment_class(), "TAKES_COMPOSE_ENV_ALLOW", False):  # docker: Compose's host variables
            kwargs["compose_env_allow"] = list(options.get("env_allow") or ())
        extras = self.start_extras(
            trial_dir=trial_paths.trial_dir,
            run_label=run_label,
            sandbox_id=session_id,
            environment_dir=task.paths.environment_dir,
            backend_kwargs=kwargs,
            options=options,
        )
        baseline, phases = network_policies(task)  # Harbor's class enforces them, or refuses the task
        return EnvironmentFactory.create_environment_from_config(
            config=TrialEnvironmentConfig(type=self.type, import_path=self.import_path, kwargs=kwargs, **extras),
            environment_dir=task.paths.environment_dir,
            environment_name=task.short_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task.config.environment,
            network_policy=baseline,
            phase_network_policies=phases,
            **({"mounts": [dict(m) for m in options["mounts"]]} if options.get("mounts") else {}),
        )

    def construction_error(self, task: Task, backend_kwargs: Mapping[str, Any]) -> Exception | None:
        """Build the task's environment as a start would, nothing started; what the construction raised, if anything.

        Harbor's classes check at construction what a task needs (GPUs, network
        policies, ...) and whether their client package is installed.
        """
        import tempfile

        from harbor.models.trial.paths import TrialPaths

        with tempfile.TemporaryDirectory(prefix="harbor-async-check-") as folder:
            paths = TrialPaths(trial_dir=Path(folder))
            paths.mkdir()
            try:
                self.create_environment(
                    task, paths, session_id="check", run_label="check", backend_kwargs=backend_kwargs, options={}
                )
            except Exception as exc:  # noqa: BLE001 - the caller judges it
                return exc
        return None

    def check_installed(self, task: Task, backend_kwargs: Mapping[str, Any]) -> None:
        """Build one environment (nothing started) to find a missing client package before any sandbox.

        Harbor's cloud environments say they lack their SDK only when constructed;
        a run would otherwise fail every episode with the same install hint.
        Any other construction error is the start's to report, with its own type.

        Raises:
            BackendNotInstalledError: the backend's package is missing (with the install command).
        """
        from harbor_async.core.errors import BackendNotInstalledError

        exc = self.construction_error(task, backend_kwargs)
        if isinstance(exc, ImportError):  # Harbor's MissingExtraError is one
            package = getattr(exc, "package", None) or getattr(exc, "name", None) or "its client"
            extra = getattr(exc, "extra", None)
            install = f"pip install 'harbor[{extra}]'" if extra else f"pip install {package}"
            raise BackendNotInstalledError(self.name, str(package), install) from exc

    def start_extras(
        self,
        *,
        trial_dir: Path,
        run_label: str,
        sandbox_id: str,
        environment_dir: Path | None,
        backend_kwargs: Mapping[str, Any],
        options: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Extra fields of Harbor's trial ``EnvironmentConfig`` this backend wants at a start.

        Harbor's docker backend gets a Compose overlay with the run's labels and
        an init (see :mod:`harbor_async.backends.docker.overlay`) unless
        ``options["docker_overlay"]`` is false; other backends want nothing.
        """
        if (self.type == "docker" or self.name == "docker-fast") and options.get("docker_overlay", True):
            from harbor_async.backends.docker.overlay import overlay_extras

            return overlay_extras(trial_dir, run_label, sandbox_id, backend_kwargs, environment_dir)
        return {}

    def typed_error(self, exc: BaseException) -> BaseException:
        """``exc`` from this backend's start, typed for the error policy where the library left it untyped.

        Harbor's docker backend (and subclasses of it) raise a bare
        ``RuntimeError``; see :mod:`harbor_async.backends.docker.errors`. A
        cloud SDK's HTTP 429 or quota answer becomes a rate-limit or quota
        error (:mod:`harbor_async.backends.throttles`), which the start window reads.
        """
        from harbor.environments.docker.docker import DockerEnvironment

        if isinstance(exc, RuntimeError) and issubclass(self.environment_class(), DockerEnvironment):
            from harbor_async.backends.docker.errors import typed_start_error

            return typed_start_error(exc)
        from harbor_async.backends.throttles import typed_throttle

        return typed_throttle(exc) or exc

    def check_async_library(self) -> None:
        """Load the class; fail clearly when an asyncio-only backend is driven under trio.

        Harbor's own environments call asyncio directly; this project's backends
        are written with anyio and declare ``ANYIO_NATIVE = True``.
        """
        import sniffio

        cls = self.environment_class()
        library = sniffio.current_async_library()
        if library != "asyncio" and not getattr(cls, "ANYIO_NATIVE", False):
            raise AsyncLibraryError(
                f"Harbor backend {self.name!r} runs only on asyncio, not on {library}; "
                "run the engine on its loop thread (asyncio) or use the 'local' or "
                "'simulated' backend"
            )


def network_policies(task: Task) -> tuple[NetworkPolicy, list[NetworkPolicy]]:
    """The task's environment network policy and those of its agent and verifier phases (every step's)."""
    steps = [None, *(task.config.steps or [])]
    phases = [phase_policy(task, role, step) for step in steps for role in ("agent", "verifier")]
    return task.config.environment.resolve_baseline(), phases


def phase_policy(task: Task, role: str, step: Any = None) -> NetworkPolicy:
    """The network policy of the ``agent`` or ``verifier`` phase (of ``step``): Harbor's precedence.

    The step's explicit ``network_mode``, else the task's ``[agent]``/``[verifier]`` one, else the environment's.
    """
    explicit = getattr(step, role).explicit_phase_policy() if step is not None else None
    return explicit or getattr(task.config, role).explicit_phase_policy() or task.config.environment.resolve_baseline()


async def enter_network_phase(environment: BaseEnvironment, task: Task, role: str, step: Any = None) -> None:
    """Switch a backend that can change its network policy while running to the phase's (Harbor's phase switch).

    A backend that cannot was built with the broadest policy of every phase, or
    refused the task up front (see :func:`network_policies`).
    """
    if not environment.capabilities.dynamic_network_policy:
        return
    policy = phase_policy(task, role, step)
    if environment.network_policy != policy:
        await environment.set_network_policy(policy)

@cache
def _environment_class(spec: BackendSpec) -> type:
    from harbor.environments.base import BaseEnvironment
    from harbor.environments.factory import _load_environment_class
    from harbor.models.environment_type import EnvironmentType
    from harbor.utils.import_path import import_class

    try:
        if spec.import_path is not None:
            cls = import_class(spec.import_path, label="environment")
        else:
            cls = _load_environment_class(EnvironmentType(spec.type))
    except Exception as exc:  # ImportError, AttributeError, missing vendor SDK ...
        raise BackendError(f"backend {spec.name!r} cannot be loaded: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, BaseEnvironment)):
        raise BackendError(f"backend {spec.name!r} is not a Harbor BaseEnvironment subclass: {cls!r}")
    return cls


def resolve_backend(name: str) -> BackendSpec:
    """Resolve ``name`` (``docker``, ``local``, ``pkg.mod:Class`` ...) to a :class:`BackendSpec`.

    Raises:
        BackendError: the name is neither a Harbor type, a short name of this
            project, nor an import path.
    """
    from harbor.models.environment_type import EnvironmentType

    if not isinstance(name, str) or not name.strip():
        raise BackendError(f"backend must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in SHORT_NAMES:
        return BackendSpec(name=name, import_path=SHORT_NAMES[name])
    if ":" in name:
        module, _, cls = name.partition(":")
        if not module or not cls:
            raise BackendError(f"backend import path {name!r} must look like 'package.module:Class'")
        return BackendSpec(name=name, import_path=name)
    try:
        kind = EnvironmentType(name).value
    except ValueError:
        known = sorted([*SHORT_NAMES, *(t.value for t in EnvironmentType)])
        raise BackendError(
            f"unknown backend {name!r}; use one of {', '.join(known)} "
            "or an import path 'package.module:Class'"
        ) from None
    # Harbor's docker with its host side bounded (see harbor_async.backends.docker.confined).
    return BackendSpec(name=name, type=kind, import_path=CONFINED_TYPES.get(kind))
