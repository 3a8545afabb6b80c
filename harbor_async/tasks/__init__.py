"""Tasks as Harbor defines them: suites (local, Hugging Face, registry) and their selection, host variables in ``task.toml``, what a run overrides on every task, host mounts, resources this host can give.

The names of the old ``harbor_async.tasks`` module still resolve here for one release (with a
:class:`DeprecationWarning`; :mod:`harbor_async.core.moved`).

Imports: core.
"""

from typing import Any

from harbor_async.core.moved import moved_attribute


def __getattr__(name: str) -> Any:
    return moved_attribute(__name__, name)
