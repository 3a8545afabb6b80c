"""Harbor tasks loaded once per folder while their files are unchanged (``reset()`` must return at once)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from harbor_async.tasks.suite import load_task

if TYPE_CHECKING:
    from harbor.models.task.task import Task

_TASK_CACHE_SIZE = 4096
_task_cache: dict[str, tuple[tuple[int, ...], Task]] = {}
_task_cache_lock = threading.Lock()


def _task_signature(task_dir: Path) -> tuple[int, ...]:
    """Changes when task.toml or instruction.md changes (raises OSError when one is missing)."""
    toml, instruction = (task_dir / "task.toml").stat(), (task_dir / "instruction.md").stat()
    return (toml.st_mtime_ns, toml.st_size, instruction.st_mtime_ns, instruction.st_size)


def load_task_cached(task_dir: str | Path) -> Task:
    """:func:`~harbor_async.tasks.suite.load_task`, remembered per folder while its files are unchanged.

    Harbor's parsing and validation take about 2 ms a task; a GRPO batch resets
    the same few tasks over and over, and ``reset()`` should return at once.
    A Task is only read after loading, so one instance serves every sandbox.
    """
    key = str(Path(task_dir).expanduser().absolute())
    try:
        signature = _task_signature(Path(key))
    except OSError:
        return load_task(task_dir)  # missing files: its error says which
    with _task_cache_lock:
        cached = _task_cache.get(key)
    if cached is not None and cached[0] == signature:
        return cached[1]
    task = load_task(task_dir)
    with _task_cache_lock:
        if len(_task_cache) >= _TASK_CACHE_SIZE:
            _task_cache.pop(next(iter(_task_cache)))  # oldest entry
        _task_cache[key] = (signature, task)
    return task
