"""Disk bounds of what an episode and a job copy to the host, by apparent size (sparse files count in full).

A backend's per-transfer budget (:mod:`harbor_async.verification.transfer_budget`) bounds
one download; an episode makes many (its agent's logs, its artifacts, each
verifier output, each step's folders, a separate verifier's), and a job many
episodes. Two shared budgets sit above it:

- :class:`EpisodeDiskBound`: every download of one episode, on the local and
  docker backends, reserves its bytes here before any is written; past
  ``episode_mb`` the download is refused (:class:`EpisodeDiskLimitError`, a
  :class:`~harbor_async.core.errors.TransferLimitError`), and so is every later one
  of the episode. What went past it is the sandbox's doing, so the episode is
  the model's **scored failure** (reward 0): the verifier's when it was
  ``/logs/verifier`` (:class:`VerifierDiskLimitError`), else the agent's
  (:class:`AgentDiskLimitError`), never infrastructure. The check is made when
  the episode settles (:func:`settle_bounds`), since Harbor's best-effort
  copies (artifacts, the oracle's log) swallow the refusal.
- :class:`JobDiskBound`: one per job folder and process, shared by all its
  episodes (thread-safe): the folder's apparent size when the job (re)started
  plus what its episodes copied since. The download that would pass
  ``job_mb`` is refused with :class:`JobDiskLimitError`: that episode is not
  judged (``cancelled``, rerun by ``--resume``), no later episode starts, and
  the run's :class:`~harbor_async.episodes.runner.FailureBudget` stops the job with the
  same typed error.

The budgets ride a context variable: :func:`run_episode` and
:meth:`Episode.verify` make their episode's bound current, and the backends'
downloads read it when they begin (on the loop thread; the copy itself runs in
a worker thread). Backends whose transfers are Harbor's own (the cloud ones)
are bounded by their provider, not here.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor_async.core.errors import (
    EpisodeInterruptedError,
    FailureClass,
    HarborAsyncError,
    Phase,
    SandboxError,
    SettingError,
    TransferLimitError,
    VerifierFailure,
)
from harbor_async.core.policy import failure_class

#: An :class:`harbor_async.episodes.episode.Episode` (not imported: the episode imports this module, and the backends do).
Episode = Any

#: Default bound of everything one episode copies to the host (MiB, apparent size): four full transfers.
DEFAULT_EPISODE_DISK_MB = 2048
#: Default bound of a job folder (MiB, apparent size).
DEFAULT_JOB_DISK_MB = 50 * 1024

#: Sandbox paths whose contents are the verifier's (its output), not what the agent left.
_VERIFIER_PREFIXES = ("/logs/verifier",)


@dataclass(frozen=True)
class DiskLimits:
    """The two bounds, in MiB (``None``: unbounded): read off the engine (``engine.disk_limits``).

    Raises:
        SettingError: a bound that is not a positive integer.
    """

    episode_mb: int | None = DEFAULT_EPISODE_DISK_MB
    job_mb: int | None = DEFAULT_JOB_DISK_MB

    def __post_init__(self) -> None:
        for name in ("episode_mb", "job_mb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SettingError(name, value, "a positive number of MiB or None")


class EpisodeDiskLimitError(TransferLimitError):
    """A download refused because its episode copied ``limit`` bytes to the host already (raised in the transfer)."""

    def __init__(self, path: str, limit: int, detail: str | None = None) -> None:
        OSError.__init__(
            self,
            f"transfer of {path!r} refused: {detail or 'past'} the episode's bound of {limit / 2**20:g} MiB copied to "
            "the host (apparent size: sparse files count in full; raise --episode-disk-limit-mb to allow more)",
        )
        self.path = path
        self.limit = limit


class AgentDiskLimitError(SandboxError):
    """What the agent left (its logs, its artifacts, its container's writable layer) went past a disk bound: ``agent``."""


class VerifierDiskLimitError(VerifierFailure):
    """The verifier's output went past the episode's disk bound: ``verifier``, scored 0."""


class StorageLimitError(HarborAsyncError, RuntimeError):
    """A sandbox's container wrote past its ``storage_mb`` where the backend bounds it itself (docker without quotas).

    Raised by the backend for every command after the bound was passed, and
    kept as the environment's ``storage_exceeded``: the agent's scored failure.

    Attributes:
        limit_mb: the task's ``storage_mb``.
        size: the writable layer's apparent size found, in bytes.
    """

    def __init__(self, container: str, limit_mb: int, size: int) -> None:
        super().__init__(
            f"the container {container[:12]} wrote {size / 2**20:.0f} MiB, past the task's storage_mb of {limit_mb} "
            "(its writable layer's apparent size): it was killed"
        )
        self.container, self.limit_mb, self.size = container, limit_mb, size

    def __reduce__(self):
        return (type(self), (self.container, self.limit_mb, self.size))


class JobDiskLimitError(EpisodeInterruptedError):
    """The job folder reached its bound: the job stops, its remaining episodes not judged (``cancelled``), resumable.

    Attributes:
        job_dir: the job folder.
        limit: the bound in bytes.
    """

    def __init__(self, job_dir: Path | str, limit: int, message: str | None = None) -> None:
        super().__init__(
            message
            or f"the job folder {job_dir} reached its bound of {limit / 2**20:g} MiB (apparent size): the job "
            f"stops, its remaining episodes not judged; free space or raise the bound, then resume it "
            f"(--resume {job_dir} --job-disk-limit-mb MiB)"
        )
        self.job_dir, self.limit = Path(job_dir), limit

    def __reduce__(self):
        return (type(self), (self.job_dir, self.limit, str(self)))


def job_disk_error(job_dir: Path | str, message: str | None) -> JobDiskLimitError:
    """The job's stop, rebuilt from the record of the episode that reached the bound (its message; from Ray, JSON)."""
    return JobDiskLimitError(job_dir, 0, message)


def apparent_size(folder: Path) -> int:
    """The sum of the apparent sizes of the regular files below ``folder`` (links not followed; 0 if none)."""
    total = 0
    for root, _dirs, files in os.walk(folder, followlinks=False):
        for name in files:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue  # removed meanwhile
            if not os.path.islink(os.path.join(root, name)):
                total += info.st_size
    return total


class JobDiskBound:
    """The bytes a job folder holds and may still take; one per folder and process (:func:`job_bound`), thread-safe.

    The folder is measured on the first charge (in the worker thread of a
    download, not on the loop): a resumed job counts what it already holds.
    """

    def __init__(self, folder: Path, limit: int | None) -> None:
        self.folder, self.limit = Path(folder), limit
        self.used: int | None = None
        self.reached: JobDiskLimitError | None = None
        self._lock = threading.Lock()

    def charge(self, size: int) -> None:
        """Reserve ``size`` bytes.

        Raises:
            JobDiskLimitError: the folder would pass its bound (and every later charge, once it has).
        """
        with self._lock:
            if self.reached is not None:
                raise JobDiskLimitError(self.folder, self.reached.limit)
            if self.used is None:
                self.used = apparent_size(self.folder)
            if self.limit is not None and self.used + size > self.limit:
                self.reached = JobDiskLimitError(self.folder, self.limit)
                raise JobDiskLimitError(self.folder, self.limit)
            self.used += size


_JOBS: dict[tuple[Path, int | None], JobDiskBound] = {}
_JOBS_LOCK = threading.Lock()


def job_bound(folder: Path, limit_mb: int | None) -> JobDiskBound:
    """The one bound of job folder ``folder`` in this process (every engine and episode of the job shares it)."""
    limit = None if limit_mb is None else limit_mb * 2**20
    key = (Path(folder).resolve(), limit)
    with _JOBS_LOCK:
        found = _JOBS.get(key)
        if found is None:
            found = _JOBS[key] = JobDiskBound(Path(folder), limit)
        return found


class EpisodeDiskBound:
    """Bytes one episode copied to the host, and its job's bound; thread-safe (downloads run in worker threads).

    Attributes:
        exceeded: the first download refused past the episode's bound (with the sandbox path).
        job_error: the job's bound, reached by one of this episode's downloads.
    """

    def __init__(self, limit_mb: int | None, job: JobDiskBound | None = None) -> None:
        self.limit = None if limit_mb is None else limit_mb * 2**20
        self.job = job
        self.used = 0
        self.exceeded: EpisodeDiskLimitError | None = None
        self.job_error: JobDiskLimitError | None = None
        self._lock = threading.Lock()

    def charge(self, size: int, shown: str) -> None:
        """Reserve ``size`` bytes of a download of sandbox path ``shown`` (before any is written).

        Raises:
            EpisodeDiskLimitError: past the episode's bound, or any download after one that was.
            JobDiskLimitError: past the job's bound.
        """
        with self._lock:
            if self.exceeded is not None:
                raise EpisodeDiskLimitError(shown, self.limit or 0, "after an earlier download went")
            if self.limit is not None and self.used + size > self.limit:
                self.exceeded = EpisodeDiskLimitError(shown, self.limit)
                raise EpisodeDiskLimitError(shown, self.limit)
            if self.job is not None:
                try:
                    self.job.charge(size)
                except JobDiskLimitError as exc:
                    self.job_error = self.job_error or exc
                    raise
            self.used += size

    def job_full(self) -> JobDiskLimitError | None:
        """The job's bound, if an episode of the job (this one or another) reached it."""
        return None if self.job is None else self.job.reached

    @contextlib.contextmanager
    def current(self) -> Iterator[EpisodeDiskBound]:
        """Make this the bound the downloads begun inside charge (a context variable: per task)."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


_CURRENT: ContextVar[EpisodeDiskBound | None] = ContextVar("episode_disk_bound", default=None)


def current() -> EpisodeDiskBound | None:
    """The bound of the episode whose download is beginning, if any (read on the loop, when a download begins)."""
    return _CURRENT.get()


def for_engine(engine: Any) -> EpisodeDiskBound:
    """A new episode's bound: the engine's ``disk_limits`` (else the defaults), and its job folder's bound."""
    limits = getattr(engine, "disk_limits", None) or DiskLimits()
    folder = getattr(engine, "trials_dir", None)
    job = job_bound(folder, limits.job_mb) if folder is not None else None
    return EpisodeDiskBound(limits.episode_mb, job)


def _storage_error(episode: Episode) -> tuple[StorageLimitError, bool] | None:
    """A container of the episode's that went past its ``storage_mb`` (a backend's own watch), and whether it was a judge's.

    The episode's own sandbox is asked (its environment's ``storage_exceeded``);
    a separate verifier's, stopped by now, is found in the errors it raised.
    """
    sandbox = episode.sandbox
    environment = None if sandbox is None else getattr(sandbox, "_env", None)
    found = getattr(environment, "storage_exceeded", None)
    if isinstance(found, StorageLimitError):
        return found, False
    for error in (episode.error, episode.verify_error):
        while error is not None:
            if isinstance(error, StorageLimitError):
                return error, True
            error = error.__cause__ or error.__context__
    return None


def bound_failure(episode: Episode) -> BaseException | None:
    """The typed failure of ``episode`` for a bound it went past, or ``None``: see the module's docstring."""
    bound: EpisodeDiskBound | None = getattr(episode, "disk", None)
    task, sandbox = episode.task.name, episode.record.sandbox or "-"
    if bound is not None and bound.job_error is not None:
        return bound.job_error
    if bound is not None and bound.exceeded is not None:
        exceeded = bound.exceeded
        if any(exceeded.path == p or exceeded.path.startswith(p + "/") for p in _VERIFIER_PREFIXES):
            return VerifierDiskLimitError(Phase.VERIFY, task, sandbox, str(exceeded))
        return AgentDiskLimitError(Phase.AGENT, task, sandbox, str(exceeded))
    storage = _storage_error(episode)
    if storage is not None:
        error, judge = storage
        if judge:  # what the verifier's container wrote
            return VerifierDiskLimitError(Phase.VERIFY, task, sandbox, str(error))
        return AgentDiskLimitError(Phase.AGENT, task, sandbox, str(error))
    return None


def settle_bounds(episode: Episode) -> None:
    """Record a bound ``episode`` went past as its failure, over any failure recorded before (idempotent).

    The agent's or verifier's scored failure with reward 0; for the job's
    bound, not judged (no reward). An episode interrupted or failed by its
    model server stays so (it was not judged either way).
    """
    error = bound_failure(episode)
    record = episode.record
    if error is None or record.error_type == type(error).__name__:
        return
    unjudged = record.failure is FailureClass.CANCELLED or record.failure is FailureClass.MODEL_SERVER
    if unjudged and not isinstance(error, JobDiskLimitError):
        return

    record.error_class = record.error_phase = record.error_type = record.error = None
    record.set_error(failure_class(error), error)
    record.rewards = {}
    record.reward = 0.0 if record.failure is not None and record.failure.scored else None


__all__ = [
    "DEFAULT_EPISODE_DISK_MB",
    "DEFAULT_JOB_DISK_MB",
    "AgentDiskLimitError",
    "DiskLimits",
    "EpisodeDiskBound",
    "EpisodeDiskLimitError",
    "JobDiskBound",
    "JobDiskLimitError",
    "StorageLimitError",
    "VerifierDiskLimitError",
    "apparent_size",
    "bound_failure",
    "current",
    "for_engine",
    "job_bound",
    "job_disk_error",
    "settle_bounds",
]
