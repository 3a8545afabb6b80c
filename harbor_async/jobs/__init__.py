"""Job folders: ours (``harbor-async.json``, ``episodes.jsonl``) and Harbor's layout beside them, trajectories, scoring and plots, retries, Harbor's job config files, the one settings model.

The names of the old ``harbor_async.jobs`` module still resolve here for one release (with a
:class:`DeprecationWarning`; :mod:`harbor_async.core.moved`).

Imports: core, models, tasks, verification.
"""

from typing import Any

from harbor_async.core.moved import moved_attribute


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, name)
