"""Joining a Ray cluster and finding the budget actor: the only place Ray is imported for the budget."""

from __future__ import annotations

import os
import threading
from typing import Any

from harbor_async.cluster.errors import ClusterUnavailableError, RayNotInstalledError

#: The Ray namespace and actor name every process uses unless told otherwise.
DEFAULT_NAMESPACE = "harbor-async"
DEFAULT_ACTOR_NAME = "harbor-async-budget"

_init_lock = threading.Lock()
#: Ray's switch for its native failure-signal handler (a SIGTERM would print a stack and may abort the process).
FAILURE_SIGNAL_HANDLER_VARIABLE = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


def import_ray() -> Any:
    """``import ray``, or :class:`RayNotInstalledError`."""
    # Ray turns a driver started by `uv run` into a runtime env that re-runs
    # `uv run` in a copy of the working folder on every worker; our workers
    # already run in the cluster's environment, so keep the interpreter as is
    # (a user who wants Ray's behaviour sets the variable to 1).
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # Ray's native failure-signal handler takes SIGTERM from our interrupt policy (which records the episodes in
    # flight and exits 143): it prints a stack and the process may then abort (-6). Ray reads the variable when
    # it is imported, so it is set here, before; the user's own setting wins.
    os.environ.setdefault(FAILURE_SIGNAL_HANDLER_VARIABLE, "1")
    try:
        import ray
    except ImportError as exc:
        raise RayNotInstalledError() from exc
    return ray


def ensure_connected(address: str | None = None, namespace: str = DEFAULT_NAMESPACE) -> Any:
    """Connect this process to the Ray cluster once (``address=None``: ``RAY_ADDRESS`` or the local one).

    Returns the ``ray`` module. A process already connected (a Ray worker, or
    a driver that called ``ray.init``) keeps its connection. Never starts a
    cluster: a missing one raises :class:`ClusterUnavailableError`.
    """
    ray = import_ray()
    with _init_lock:
        if ray.is_initialized():
            return ray
        _keep_sigterm_ours()
        try:
            ray.init(
                address=address or "auto",
                namespace=namespace,
                log_to_driver=False,
                logging_level="WARNING",
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ClusterUnavailableError(address, str(exc)) from exc
    return ray


def _keep_sigterm_ours() -> None:
    """Make the coming ``ray.init`` leave SIGTERM to us, also where Ray was imported before :func:`import_ray`.

    Ray reads ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER`` once, into a constant, when it is imported, and its core
    worker reads the constant when ``ray.init`` makes it: a program that imported Ray before us (its own code,
    a trainer) kept Ray's handler although the variable (set by :func:`import_ray`, which runs first) says
    otherwise. The variable is the setting.
    """
    import sys

    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and hasattr(constants, FAILURE_SIGNAL_HANDLER_VARIABLE):
        value = os.environ[FAILURE_SIGNAL_HANDLER_VARIABLE].lower()  # as Ray's own env_bool reads it
        setattr(constants, FAILURE_SIGNAL_HANDLER_VARIABLE, value in ("1", "true"))


def node_name() -> str:
    """This process's node as the ledger shows it: the Ray node id when connected, else the host name."""
    import socket

    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - a label only
        pass
    return socket.gethostname()
