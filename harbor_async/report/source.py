"""What a report is made from: a job folder (``run``, ``eval``, a sweep) or benchmark results.

A job is read from its records, not its ``summary.json``, so that a report of a
job that is still running (or was killed) shows every episode finished so far.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.records import EpisodeRecord
from harbor_async.jobs.folder import (
    CONFIG_NAME,
    EPISODES_NAME,
    SETTINGS_NAME,
    SUMMARY_NAME,
    JobFolder,
    latest_records,
    read_records,
)


class ReportSourceError(HarborAsyncError, ValueError):
    """The path given to the report is neither a job folder, a records file nor benchmark results."""


@dataclass
class JobSource:
    """A job's records (the last one of each episode) and its settings."""

    name: str
    path: Path
    records: list[EpisodeRecord]
    config: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    episodes_path: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json, when written

    @property
    def incomplete(self) -> bool:
        """Ended without running every planned episode (interrupted, or stopped by a failing model server)."""
        return self.finished and self.summary.get("complete") is False

    @property
    def planned(self) -> int | None:
        """Episodes the job planned, when its summary says."""
        planned = self.summary.get("planned_episodes")
        return planned if isinstance(planned, int) else None

    @property
    def watched(self) -> list[Path]:
        """The files whose change means the report is out of date (``view`` polls them)."""
        return [
            self.episodes_path or self.path / EPISODES_NAME, self.path / SUMMARY_NAME, self.path / SETTINGS_NAME,
            self.path / CONFIG_NAME,
        ]


@dataclass
class BenchmarkResult:
    """One benchmark's JSON (``benchmarks/results/*.json``) and its saved plot, if any."""

    name: str
    data: dict[str, Any]
    plot: Path | None = None


@dataclass
class BenchmarkSource:
    """Benchmark results: one JSON file or a folder of them."""

    name: str
    path: Path
    results: list[BenchmarkResult]

    @property
    def watched(self) -> list[Path]:
        """The files whose change means the report is out of date."""
        if self.path.is_dir():
            return sorted(self.path.glob("*.json"))
        return [self.path]


Source = JobSource | BenchmarkSource


def load_source(path: str | Path) -> Source:
    """Read what ``path`` holds.

    - a job folder (``harbor-async.json``, an earlier release's ``config.json``, and/or ``episodes.jsonl``);
    - an ``episodes.jsonl`` file of records (``run --json`` writes one);
    - a benchmark result JSON (with a ``"benchmark"`` key) or a folder of them.

    Raises :class:`ReportSourceError` for anything else.
    """
    path = Path(path)
    if path.is_dir():
        if any((path / name).is_file() for name in (EPISODES_NAME, SETTINGS_NAME, CONFIG_NAME)):
            return _job(path.name, path, path / EPISODES_NAME)
        results = [r for r in (_benchmark(p) for p in sorted(path.glob("*.json"))) if r is not None]
        if results:
            return BenchmarkSource(path.name, path, results)
        raise ReportSourceError(f"{path} holds no job ({EPISODES_NAME}, {SETTINGS_NAME}) and no benchmark results (*.json)")
    if not path.is_file():
        raise ReportSourceError(f"{path} does not exist")
    if path.suffix == ".json":
        result = _benchmark(path)
        if result is None:
            raise ReportSourceError(f"{path} is not a benchmark result (no \"benchmark\" key)")
        return BenchmarkSource(path.stem, path, [result])
    if path.suffix == ".jsonl":
        return _job(path.parent.name if path.name == EPISODES_NAME else path.stem, path.parent, path)
    raise ReportSourceError(f"{path}: expected a job folder, an episodes .jsonl file or benchmark results (.json)")


def _job(name: str, folder: Path, episodes: Path) -> JobSource:
    config: dict[str, Any] = {}
    config_path = JobFolder(folder).settings_path  # ours, or an earlier release's config.json (not Harbor's)
    if config_path is not None:
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ReportSourceError(f"cannot read {config_path}: {exc}") from exc
    # run's records of earlier releases named tasks by absolute path; today's by their path in the suite
    root = config.get("suite") or (config.get("settings") or {}).get("source") if config.get("command") == "run" else None
    records = list(latest_records(read_records(episodes), root).values())
    summary: dict[str, Any] = {}
    if (folder / SUMMARY_NAME).is_file():
        try:
            loaded = json.loads((folder / SUMMARY_NAME).read_text(encoding="utf-8"))
            summary = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            summary = {}  # being written: the records are what the report stands on
    return JobSource(
        name, folder, records, config if isinstance(config, dict) else {}, (folder / SUMMARY_NAME).is_file(), episodes,
        summary,
    )  # fmt: skip


def _benchmark(path: Path) -> BenchmarkResult | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "benchmark" not in data:
        return None
    plot = path.with_suffix(".png")
    return BenchmarkResult(path.stem, data, plot if plot.is_file() else None)
