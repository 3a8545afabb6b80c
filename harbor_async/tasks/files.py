"""Harbor's task file filter, remembering its answers for as long as the loaded task lives.

Harbor's verifier asks the task's :class:`TaskFileFilter` which test files to
upload at every verify: it validates the whole tests tree and matches each
file against the ``.harborignore`` scopes again, about 5 ms of the loop
thread's time per verify. A loaded task is a snapshot of its folder (Harbor
itself keeps each ``.harborignore`` once read), so the same answers serve
every episode of it. A failed check is not remembered: it fails every time.
"""

from __future__ import annotations

import os
from pathlib import Path

from harbor.models.task.file_filter import TaskFileFilter
from harbor.models.task.task import Task
from harbor.utils.file_selection import FileSelection


class RememberingFileFilter(TaskFileFilter):
    """:class:`TaskFileFilter` whose ``is_excluded`` and ``select`` answer each path once."""

    def __init__(self, task_dir: Path | str) -> None:
        super().__init__(task_dir)
        self._excluded: dict[Path, bool] = {}
        self._selections: dict[Path, FileSelection] = {}

    def is_excluded(self, path: Path) -> bool:
        key = Path(os.path.abspath(path))
        answer = self._excluded.get(key)
        if answer is None:
            answer = self._excluded[key] = super().is_excluded(key)
        return answer

    def select(self, source_dir: Path) -> FileSelection:
        key = Path(os.path.abspath(source_dir))
        selection = self._selections.get(key)
        if selection is None:
            selection = self._selections[key] = super().select(key)
        return selection


def remember_file_filter(task: Task) -> Task:
    """Give a freshly loaded ``task`` a :class:`RememberingFileFilter` (in place); return it."""
    if type(getattr(task, "file_filter", None)) is TaskFileFilter:
        task.file_filter = RememberingFileFilter(task.file_filter.task_dir)
    return task
