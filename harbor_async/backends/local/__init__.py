"""A Harbor environment backed by bubblewrap: real namespaces, no Docker daemon.

Use it by import path, from Harbor's CLI or from code::

    harbor run -p tasks/ -e harbor_async.backends.local:LocalEnvironment -a oracle

Every sandbox is a folder on the host,
``<base>/harbor-async-<run label>-<session id>/``, holding a marker file
(``.harbor-async.json``, for a reaper) and ``fs/``, the sandbox's own root.

A sandbox lives like a container. ``start()`` launches one long-lived ``bwrap``,
the *keeper*: it binds ``fs/`` as ``/`` (writable) and the host's ``/usr``,
``/etc`` (and ``/bin``, ``/lib``... when they are real folders) read-only on
top, in new user, PID, mount, IPC, UTS, cgroup and network namespaces (so: no
network at all, only ``lo``), with a reduced capability set, and runs a tiny
init as the namespace's PID 1 (a shell loop that waits forever and reaps every
orphan). Each ``exec`` *joins* the keeper's namespaces, as ``docker exec`` joins
a container: ``nsenter`` enters them, ``setpriv`` drops the capabilities to the
keeper's set and sets no-new-privs, ``env`` clears the environment and changes
to the working folder, then ``bash -c`` runs the command. So processes started
in the background (``cmd &``, ``nohup``, ``setsid``) outlive their exec and are
visible to later ones (``ps``, ``kill``, ``/proc``); the sandbox still has its
own PID namespace. An exec that times out or is cancelled loses its whole
process tree (its session, its process group and all descendants), not the
background processes of earlier execs; ``stop()`` kills the keeper, which ends
the PID namespace and every process in it, then removes the folder.

What a background process writes to its exec's stdout/stderr after the exec
returned is read and discarded (it neither blocks nor dies of SIGPIPE);
redirect it to a file to keep it.

Needs ``bwrap`` (``apt-get install bubblewrap``) and ``nsenter``, ``setpriv``
from util-linux (essential on Debian and Ubuntu, so present; elsewhere
``apt-get install util-linux`` or your distribution's equivalent). ``start()``
fails with a clear error without them.

From the task's ``environment/Dockerfile`` the ``WORKDIR``, ``ENV`` and ``COPY``
lines (and ``ADD`` of local files) are honoured at ``start()``; ``FROM``, ``ARG``
and ``LABEL`` are accepted silently; every other line (``RUN``, ``USER`` ...) is
named in one warning, as are the paths this backend cannot make writable.
"""
from __future__ import annotations

from harbor_async.backends.local.adapter import LocalEnvironment
from harbor_async.backends.local.dockerfile import (
    CopyStep,
    DockerfileSpec,
    parse_dockerfile,
)
from harbor_async.backends.local.errors import ExecTimeoutError, SandboxPathError

__all__ = [
    "CopyStep",
    "DockerfileSpec",
    "ExecTimeoutError",
    "LocalEnvironment",
    "SandboxPathError",
    "parse_dockerfile",
]
