"""A Compose overlay for Harbor's ``docker`` backend: run labels and a real init.

Harbor builds each sandbox from its own compose files; an extra overlay file
(Harbor's ``extra_docker_compose``) lets the engine add to the ``main``
service, before the create call:

- labels naming the run, the sandbox and the owning process (and its PID
  namespace), which :mod:`harbor_async.backends.reaper` reads (on every service of a
  multi-container task, with the init);
- ``init: true``: Docker's init as PID 1 forwards SIGTERM and reaps zombies.
  Harbor's container otherwise runs ``sleep infinity`` as PID 1, which ignores
  SIGTERM, so every ``compose down`` waited out Docker's 10 s grace period;
- the local backend's confinement where Harbor gives none: a pids limit
  (:data:`PIDS_LIMIT`, a fork bomb stays inside; in the task's own
  ``deploy.resources.limits.pids`` where it sets one) and ``no-new-privileges`` (a
  setuid binary the sandbox planted gains nothing). The task's ``cpus`` and
  ``memory_mb`` Harbor applies itself.

A task's ``[environment].env`` goes to the container through Harbor's own
environment override once Compose is used (as it is with the overlay), so
tasks that set it keep the overlay: the fast stop, the labels and the limits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harbor_async.core.naming import (
    LABEL_OWNER_PID,
    LABEL_PID_NS,
    LABEL_RUN,
    LABEL_SANDBOX,
)

#: Processes a docker sandbox may have at once (the local backend's default too).
PIDS_LIMIT = 1024


def task_services(environment_dir: Path | None) -> dict[str, Any]:
    """The ``services`` of a task's ``environment/docker-compose.yaml`` ({} without one, or where it cannot be read)."""
    import yaml

    path = None if environment_dir is None else Path(environment_dir) / "docker-compose.yaml"
    if path is None or not path.is_file():
        return {}
    try:
        services = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("services") or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return {}  # Compose reports a broken file at the start, in its own words
    return services if isinstance(services, dict) else {}


def compose_services(environment_dir: Path | None) -> list[str]:
    """The services a task's ``environment/docker-compose.yaml`` declares besides ``main`` (none without one)."""
    return [name for name in task_services(environment_dir) if isinstance(name, str) and name != "main"]


def deploy_pids(environment_dir: Path | None) -> int | None:
    """``main``'s ``deploy.resources.limits.pids`` in the task's compose file, when it sets one.

    Compose refuses a service with both that and ``pids_limit`` ("can't set
    distinct values"), so the overlay then bounds the same key instead. A value
    that is not a number counts as unbounded: the overlay's own limit applies.
    """
    main = task_services(environment_dir).get("main")
    try:
        pids = main["deploy"]["resources"]["limits"]["pids"]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    try:
        return int(pids)
    except (TypeError, ValueError):
        return PIDS_LIMIT


def write_overlay(
    folder: Path, run_label: str, sandbox_id: str, sidecars: list[str] | None = None, task_pids: int | None = None
) -> Path:
    """Write the overlay into ``folder`` (the sandbox's trial folder) and return its path.

    The task's other services (``sidecars``) get the labels and the init too, so that
    they stop at once and a reaper finds them; the confinement is the agent's ``main``'s.
    ``task_pids``: the task's own ``deploy.resources.limits.pids`` (:func:`deploy_pids`),
    which the overlay then lowers to :data:`PIDS_LIMIT` at most, in the same key.
    """
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:  # no procfs: the reaper then trusts the pid alone
        pid_ns = ""
    labels = {
        LABEL_RUN: run_label,
        LABEL_SANDBOX: sandbox_id,
        LABEL_OWNER_PID: str(os.getpid()),
        LABEL_PID_NS: pid_ns,
    }
    path = folder / "harbor-async-compose.json"
    main: dict[str, Any] = {"init": True, "labels": labels, "security_opt": ["no-new-privileges:true"]}
    if task_pids is None:
        main["pids_limit"] = PIDS_LIMIT
    else:  # Compose merges the overlay's deploy into the task's: its cpus and memory stay
        main["deploy"] = {"resources": {"limits": {"pids": min(task_pids, PIDS_LIMIT) if task_pids > 0 else PIDS_LIMIT}}}
    services = {name: {"init": True, "labels": labels} for name in sidecars or []}
    path.write_text(json.dumps({"services": {**services, "main": main}}, indent=2))
    return path


def wants_overlay(backend_type: str | None, backend_kwargs: dict) -> bool:
    """Whether a sandbox gets the overlay: docker, and no overlay of the caller's own."""
    return backend_type == "docker" and not backend_kwargs.get("extra_docker_compose")


def overlay_extras(
    trial_dir: Path,
    run_label: str,
    sandbox_id: str,
    backend_kwargs: Mapping[str, Any],
    environment_dir: Path | None = None,
) -> dict[str, Any]:
    """The trial-config fields that give one sandbox the overlay (none when it must not have one)."""
    if not wants_overlay("docker", dict(backend_kwargs)):
        return {}
    overlay = write_overlay(
        trial_dir, run_label, sandbox_id, compose_services(environment_dir), deploy_pids(environment_dir)
    )
    return {"extra_docker_compose": [overlay]}
