"""The engine: the one loop thread, the engine and its budgets (live slots, create turns, exec slots), one sandbox's lifecycle phase by phase.

The names of the old ``harbor_async.engine`` module still resolve here for one release (with a
:class:`DeprecationWarning`; :mod:`harbor_async.core.moved`).

Imports: core, models, tasks, verification, backends.
"""

from typing import Any

from harbor_async.core.moved import moved_attribute


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, name)
