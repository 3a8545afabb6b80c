"""The naming contract: how the engine names what it creates, and how a reaper finds it.

One module, no Harbor import, read by the engine, the sandbox, every backend
and the reaper. A sandbox created by a run is called ``<run label>-<10 hex>``
(the session id Harbor receives); the default run label is ``ha<pid>x<6 hex>``,
so the name alone says which process owns the sandbox.
"""

from __future__ import annotations

import heapq
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path

#: The prefix of every folder, file and label the project creates.
PREFIX = "harbor-async"

#: Environment variable naming the local backend's base folder.
LOCAL_ROOT_ENV = "HARBOR_ASYNC_LOCAL_ROOT"
#: The local backend's base folder when the variable is unset.
DEFAULT_LOCAL_ROOT = "/tmp/harbor-async-local"
#: The marker file in each local sandbox's folder (run label, owner pid, creation time, pids).
MARKER_NAME = ".harbor-async.json"

#: Docker labels a compose overlay puts on a sandbox's container.
LABEL_OWNER_PID = "io.harbor-async.owner-pid"
LABEL_PID_NS = "io.harbor-async.pid-ns"
LABEL_RUN = "io.harbor-async.run-label"
LABEL_SANDBOX = "io.harbor-async.sandbox"
#: The label compose itself puts on a project's containers, networks and volumes.
COMPOSE_PROJECT_LABEL = "com.docker.compose.project"

#: A session id of the engine with its default run label: ``ha<pid>x<6 hex>-<10 hex>``.
SESSION_RE = re.compile(r"(?P<label>ha(?P<pid>\d+)x[0-9a-f]{6})-[0-9a-f]{10}")
#: Harbor's trial folder of a sandbox: ``harbor-async-<run label>-<10 hex slot>-trialdir``
#: (older runs: ``harbor-async-<session id>-<mkdtemp suffix>``); either way its
#: middle part reads as a session id of the run.
TRIAL_DIR_RE = re.compile(rf"^{PREFIX}-(?P<session>{SESSION_RE.pattern})-[A-Za-z0-9_]{{8}}$")
#: The file in a trial folder naming the sandbox it belongs to.
TRIAL_MARKER_NAME = ".harbor-async-sandbox"


def new_run_label() -> str:
    """A short label unique to this run, carried by every sandbox it creates."""
    return f"ha{os.getpid()}x{uuid.uuid4().hex[:6]}"


def new_sandbox_id(run_label: str) -> str:
    """A fresh sandbox id of ``run_label``: the session id Harbor receives."""
    return f"{run_label}-{uuid.uuid4().hex[:10]}"


class TrialDirNames:
    """Names for the sandboxes' Harbor trial folders that are reused once a folder is removed.

    Python 3.12 interns every path component pathlib parses and never frees
    an interned string; a unique folder name per sandbox (as ``mkdtemp``
    makes) would grow a long training run's memory by about 100 bytes per
    sandbox. A run's names are ``harbor-async-<run label>-<slot>-trialdir``,
    with slots reused, so they stay as many as the sandboxes alive at once.
    The folder's :data:`TRIAL_MARKER_NAME` file names its sandbox.
    """

    def __init__(self, run_label: str) -> None:
        self.run_label = run_label
        self._free: list[int] = []
        self._next = 0

    def acquire(self) -> str:
        """A name no live sandbox of this run uses."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot, self._next = self._next, self._next + 1
        return f"{PREFIX}-{self.run_label}-{slot:010x}-trialdir"

    def release(self, name: str) -> None:
        """``name``'s folder is gone: its slot may be reused."""
        heapq.heappush(self._free, int(name.rsplit("-", 2)[1], 16))


def owner_from_session(session: str) -> tuple[str | None, int | None]:
    """The run label and owner pid a session id carries, or ``(None, None)``."""
    match = SESSION_RE.fullmatch(session)
    if match is None:
        return None, None
    return match["label"], int(match["pid"])


def local_roots(extra: Iterable[str | Path] = ()) -> list[Path]:
    """The local backend's base folders: ``$HARBOR_ASYNC_LOCAL_ROOT`` (or its default) and ``extra``."""
    roots = [Path(os.environ.get(LOCAL_ROOT_ENV) or DEFAULT_LOCAL_ROOT), *map(Path, extra)]
    return list(dict.fromkeys(r.absolute() for r in roots))


def local_folder_name(run_label: str, session_id: str) -> str:
    """The folder of one local sandbox under its base folder."""
    return f"{PREFIX}-{slug(run_label)}-{slug(session_id)}"


def slug(text: str) -> str:
    """``text`` reduced to characters safe in a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "x"
