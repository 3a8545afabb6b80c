"""A Harbor environment backed by bubblewrap: real namespaces, no Docker daemon.

Use it by import path, from Harbor's CLI or from code::

    harbor run -p tasks/ -e harbor_async.backends.local:LocalEnvironment -a oracle

Every sandbox is a folder on the host,
``<base>/harbor-async-<run label>-<session id>/``, holding a marker file
(``.harbor-async.json``, for a reaper) and ``fs/``, the sandbox's own root (as
root: a link to a tmpfs of ``storage_mb`` under ``/run/harbor-async-local/``).

A sandbox lives like a container. ``start()`` launches one long-lived ``bwrap``,
the *keeper*, never as host root: as root, each sandbox gets a host uid of its
own (``limits.UidLease``) and cgroups (``limits.Cgroups``), and bwrap runs as
that uid, making a user namespace in which it is root. The keeper binds ``fs/``
as ``/`` (writable) and the host's ``/usr`` (and ``/bin``, ``/lib``... when they
are real folders) read-only on top; ``/etc`` is the sandbox's own, minimal
(``rootfs``); ``/proc`` and ``/sys`` have Docker's read-only and masked paths;
new user, PID, mount, IPC, UTS, cgroup and network namespaces (so: no network
at all, only ``lo``), Docker's default capability set inside the user
namespace, and a tiny init as the namespace's PID 1 (a shell loop that waits
forever and reaps every orphan). Each ``exec`` *joins* the keeper's
namespaces, as ``docker exec`` joins a container (``sandboxing.join_spec``):
``helpers/enter.py``, loaded from the host, joins the cgroups, takes the
sandbox's uid, enters the namespaces, sets no-new-privs and the keeper's
capabilities, and only then runs ``bash -c`` with a clean environment in the
working folder: nothing the sandbox wrote runs before it is confined. It runs
as a child of a warm ``helpers/enter_server.py`` (one per host process, forked
by the keeper thread, with ``enter.py`` loaded once; ``enter_server``), which
is handed each exec's stdio and namespace files over a unix socket. File
transfers run nothing in the sandbox: the host reads and writes the sandbox's
root through ``openat2`` confined beneath it with no symlink followed
(``transfers``, ``hostfs``), bounded in size. So processes started
in the background (``cmd &``, ``nohup``, ``setsid``) outlive their exec and are
visible to later ones (``ps``, ``kill``, ``/proc``); the sandbox still has its
own PID namespace. An exec that times out or is cancelled loses its whole
process tree (its session, its process group and all descendants), not the
background processes of earlier execs; ``stop()`` kills the keeper, which ends
the PID namespace and every process in it, then removes the folder.

What a background process writes to its exec's stdout/stderr after the exec
returned is read and discarded (it neither blocks nor dies of SIGPIPE), for the
pipes of a sandbox's last 32 such streams: older ones are closed, so the host's
descriptors stay bounded (a writer on those gets SIGPIPE). Redirect to a file
to keep the output, or to be safe from that.

Each exec stream keeps its first and last halves of ``output_limit`` bytes
(``output``); what falls between is counted, never held.

A start takes a sandbox made ahead, up to its running keeper, while an engine
is open (``pool``: each used once, never given back; the engine's close removes
those not taken), and writes the task's WORKDIR and COPY part, read once per
task (``template``); it makes its own otherwise.

Modules: ``adapter`` (the Harbor environment), ``layout`` (paths, capabilities,
defaults), ``rootfs`` (the root filesystem, ``/etc``, COPY), ``template`` (the
base and task trees, read once), ``pool`` (sandboxes made ahead), ``limits`` (uids,
cgroups), ``sandboxing`` (command lines), ``keeper`` (the keeper process),
``proctree`` (killing an exec's tree), ``output``, ``transfers``,
``dockerfile`` (the Dockerfile subset), ``images`` (the honest-image warning),
``cleanup`` (what a reaper finds and removes), ``errors``; ``helpers/`` holds the
shell helpers they run.

Needs ``bwrap`` (``apt-get install bubblewrap``) and ``setpriv``,
``prlimit`` from util-linux (essential on Debian and Ubuntu, so present; elsewhere
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
from harbor_async.backends.local.errors import (
    ExecTimeoutError,
    SandboxPathError,
    TaskPathEscapeError,
)
from harbor_async.backends.local.images import task_image_mismatch

__all__ = [
    "CopyStep",
    "DockerfileSpec",
    "ExecTimeoutError",
    "LocalEnvironment",
    "SandboxPathError",
    "TaskPathEscapeError",
    "parse_dockerfile",
    "task_image_mismatch",
]
