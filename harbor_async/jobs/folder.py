"""Job folders, as Harbor keeps them: ``JOBS_DIR/JOB_NAME`` with the records of a run.

A job folder holds:

- ``harbor-async.json``: the job's :class:`~harbor_async.jobs.settings.JobSettings`,
  written before any sandbox starts (``config.json`` in earlier releases, still read;
  ``config.json`` is the name Harbor's own job layout uses);
- ``episodes.jsonl``: one :class:`~harbor_async.core.records.EpisodeRecord` a line,
  appended and flushed as each episode finishes (a resume appends again; the
  last record of an episode wins);
- ``summary.json``: written at the end (and again after a resume);
- ``harbor-async.log``: LiteLLM's and Harbor's own log lines (a Harbor agent and its model client),
  when a command (which configures logging) runs the job and LiteLLM logs;
- Harbor's own layout beside these (``config.json``, ``result.json`` and one
  trial folder per episode, :mod:`harbor_async.jobs.harbor_layout`), so Harbor's tools
  (``harbor view``, ``harbor job regrade``) read the job.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from harbor_async.core.errors import JobFolderError
from harbor_async.core.logs import get_logger, log_to_job
from harbor_async.core.records import EpisodeRecord
from harbor_async.jobs.harbor_layout import HarborJob

log = get_logger()

SETTINGS_NAME = "harbor-async.json"
#: The settings file of job folders written by earlier releases.
CONFIG_NAME = "config.json"
EPISODES_NAME = "episodes.jsonl"
SUMMARY_NAME = "summary.json"


def default_job_name() -> str:
    """A timestamp, as Harbor names its jobs (``2026-12-01__14-03-22``)."""
    return datetime.now().strftime("%Y-%m-%d__%H-%M-%S")


class JobFolder:
    """One job's folder: create it, append records, read them back, resume.

    Use :meth:`create` for a new job and :meth:`open` to resume one.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._episodes: IO[str] | None = None
        self._harbor: HarborJob | None = None

    @classmethod
    def create(cls, jobs_dir: str | os.PathLike[str], job_name: str | None, config: dict[str, Any]) -> JobFolder:
        """Make ``jobs_dir/job_name`` and write its settings (``harbor-async.json``).

        Raises :class:`JobFolderError` when the folder exists with records in it
        (resume it instead) or cannot be written: checked before any sandbox starts.
        """
        job = cls(Path(jobs_dir) / (job_name or default_job_name()))
        if (job.path / EPISODES_NAME).exists():
            raise JobFolderError(f"job folder {job.path} already has records; resume it with --resume {job.path}")
        try:
            job.path.mkdir(parents=True, exist_ok=True)
            job.write_json(SETTINGS_NAME, config)
            (job.path / EPISODES_NAME).touch()
        except OSError as exc:
            raise JobFolderError(f"cannot write the job folder {job.path}: {exc.strerror or exc}") from exc
        log_to_job(job.path)  # LiteLLM's own output: in harbor-async.log, not over the progress bar (the commands')
        return job

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> JobFolder:
        """An existing job folder (for ``--resume``); it must hold its settings."""
        job = cls(Path(path))
        if job.settings_path is None:
            raise JobFolderError(f"{job.path} is not a job folder (no {SETTINGS_NAME})")
        try:
            (job.path / EPISODES_NAME).touch()
        except OSError as exc:
            raise JobFolderError(f"cannot write the job folder {job.path}: {exc.strerror or exc}") from exc
        log_to_job(job.path)
        return job

    @property
    def settings_path(self) -> Path | None:
        """The settings file: ``harbor-async.json``, or an earlier release's ``config.json``; ``None`` if neither."""
        if (self.path / SETTINGS_NAME).is_file():
            return self.path / SETTINGS_NAME
        legacy = self.path / CONFIG_NAME
        try:  # Harbor's JobConfig is named config.json too: an earlier release's settings say their command
            ours = legacy.is_file() and "command" in json.loads(legacy.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            ours = False
        return legacy if ours else None

    @property
    def config(self) -> dict[str, Any]:
        """The job's settings, as stored (see :meth:`harbor_async.jobs.settings.JobSettings.from_dict`)."""
        path = self.settings_path
        return self.read_json(path.name if path is not None else SETTINGS_NAME)

    def keep_harbor_layout(self, settings: Any, environment: Any, n_total: int, root: str | Path | None = None) -> None:
        """Write Harbor's job layout beside the records from now on (see :mod:`harbor_async.jobs.harbor_layout`).

        ``settings`` are the job's :class:`~harbor_async.jobs.settings.JobSettings`,
        ``environment`` its backend (``BackendSpec``), ``n_total`` the episodes
        of the whole job (a resume's included) and ``root`` the suite's root.
        """
        base = Path(root) if root else None
        self._harbor = HarborJob(self.path, settings, base, environment)
        try:
            self._harbor.start(n_total, self.latest(root))
        except OSError as exc:
            raise JobFolderError(f"cannot write the job folder {self.path}: {exc.strerror or exc}") from exc

    def append(self, record: EpisodeRecord) -> None:
        """Append one record and flush it to the file, so that no finished episode is lost; then its Harbor trial folder."""
        if self._episodes is None:
            self._episodes = open(self.path / EPISODES_NAME, "a", encoding="utf-8")  # noqa: SIM115
        self._episodes.write(json.dumps(record.to_dict(), ensure_ascii=False) + "\n")
        self._episodes.flush()
        os.fsync(self._episodes.fileno())
        if self._harbor is not None:
            try:
                self._harbor.add(record)
            except (OSError, ValueError) as exc:  # the record is safe above; Harbor's copy of it is not worth the batch
                log.warning("harbor trial folder not written", trial=record.trial, error=repr(exc))

    def close(self) -> None:
        """Close the records file (appending reopens it)."""
        if self._episodes is not None:
            self._episodes.close()
            self._episodes = None

    def records(self) -> list[EpisodeRecord]:
        """Every record in the file, in order; a torn last line (a killed writer) is skipped."""
        return list(read_records(self.path / EPISODES_NAME))

    def latest(self, root: str | Path | None = None) -> dict[str, EpisodeRecord]:
        """The last record of each episode, by :attr:`EpisodeRecord.key`.

        With the suite's ``root``, records of earlier releases that named a task
        by its absolute path are read as the relative path records use now.
        """
        return latest_records(self.records(), root)

    def pending(self, keys: Iterable[str]) -> list[str]:
        """The episodes of ``keys`` a resume runs: missing ones and those whose failure a resume reruns."""
        done = self.latest()
        return [k for k in keys if k not in done or done[k].rerun]

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json`` (and finish Harbor's ``result.json``: metrics, pass@k, end time).

        Sets ``summary["sandbox_seconds"]`` first (the caller prints it): what a provider bills for the job,
        every record's sandboxes (reruns and the attempts they replaced included; :mod:`harbor_async.core.usage`).
        """
        billed = sum((record.resources or {}).get("sandbox_seconds", 0.0) for record in self.records())
        summary["sandbox_seconds"] = round(billed, 3)
        self.write_json(SUMMARY_NAME, summary)
        if self._harbor is not None:
            try:
                self._harbor.finish()
            except (OSError, ValueError) as exc:
                log.warning("harbor job result not written", job=str(self.path), error=repr(exc))

    def write_json(self, name: str, data: Any) -> None:
        """Write ``name`` atomically (a reader never sees half a file)."""
        target = self.path / name
        tmp = target.with_name(f".{name}.tmp")
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        if name == SETTINGS_NAME:  # the run's --ae/--ve values as given (a literal secret among them): the owner's
            tmp.chmod(0o600)
        tmp.replace(target)

    def read_json(self, name: str) -> Any:
        """Read one of the folder's JSON files."""
        try:
            return json.loads((self.path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise JobFolderError(f"cannot read {self.path / name}: {exc}") from exc


def read_records(path: Path) -> Iterator[EpisodeRecord]:
    """The records of an ``episodes.jsonl`` file; a torn line is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        if not line.strip():
            continue
        try:
            yield EpisodeRecord.from_dict(json.loads(line))
        except (ValueError, TypeError):
            continue


def latest_records(records: Iterable[EpisodeRecord], root: str | Path | None = None) -> dict[str, EpisodeRecord]:
    """The last record of each episode, by key, in first-seen order.

    With the suite's ``root``, a record of an earlier release that named its
    task by absolute path is read as today's records name it (relative to the
    root), so it and its rerun are one episode.
    """
    base = Path(root).resolve() if root else None
    latest: dict[str, EpisodeRecord] = {}
    for record in records:
        path = Path(record.task_path)
        if base is not None and path.is_absolute() and path.resolve().is_relative_to(base):
            record.task_path = path.resolve().relative_to(base).as_posix()
        latest[record.key] = record
    return latest
