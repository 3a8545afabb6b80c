"""Tool harnesses: the protocol, the bundled harnesses, and how ``-a``/``agent=`` names one.

Built in: ``bash`` (TRL's single tool), ``terminal`` (a terminal with background
jobs and notes) and ``python`` (a persistent Python kernel and a shell). A
harness can also be named by import path (``pkg.module:Class``) or file path
(``path/to/file.py:Class``). A class that is not a :class:`Harness` (a TRL
``HarborEnv`` subclass, say) is built by an adapter registered under the
``harbor_async.harness_adapters`` entry point group (the shim registers one),
so the core never imports the code that adapts it.

Imports: core, backends, episodes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import types
from collections.abc import Callable
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from harbor_async.core.errors import HarnessError
from harbor_async.harnesses.base import Harness
from harbor_async.harnesses.bash import BashHarness
from harbor_async.harnesses.python_kernel import PythonHarness
from harbor_async.harnesses.terminal import TerminalHarness

#: The bundled harnesses by name.
HARNESSES: dict[str, type[Harness]] = {"bash": BashHarness, "python": PythonHarness, "terminal": TerminalHarness}

#: Builds a harness instance for a backend from a class that is not a Harness; ``None``: not this adapter's kind.
HarnessAdapter = Callable[[type, str], Callable[[], Harness] | None]

ADAPTER_GROUP = "harbor_async.harness_adapters"


def load_harness_class(reference: str | type, names: dict[str, type] | None = None) -> type:
    """The class ``reference`` names: a class, a name in ``names`` (default :data:`HARNESSES`), or a path.

    Raises:
        HarnessError: an unknown name, or a path whose module or class cannot be loaded.
    """
    if isinstance(reference, type):
        return reference
    names = HARNESSES if names is None else names
    if reference in names:
        return names[reference]
    if ":" not in reference:
        raise HarnessError(
            f"unknown harness {reference!r}; use a built-in name ({', '.join(sorted(names))}), an import path "
            "'pkg.module:Class' or a file path 'path/to/file.py:Class'"
        )
    try:
        return import_reference(reference)
    except (ImportError, AttributeError, OSError, SyntaxError) as exc:
        raise HarnessError(f"harness {reference!r}: {type(exc).__name__}: {exc}") from exc


def import_reference(reference: str) -> Any:
    """What ``pkg.module:Name`` or ``path/to/file.py:Name`` names; raises what importing it raises.

    A file is loaded once per process (:func:`load_harness_file`). The shim
    calls this directly, so that its errors are the ones TRL's own loader raises.
    """
    target, _, name = reference.rpartition(":")  # rpartition: keep a Windows drive ("D:\...") whole
    if target.endswith(".py") or os.path.sep in target:
        module = load_harness_file(str(Path(target).absolute()))
    else:
        module = importlib.import_module(target)
    return getattr(module, name)


@cache
def load_harness_file(path: str) -> types.ModuleType:
    """The module of a harness file, loaded once per process (one class per file)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def harness_factory(reference: str | type, backend: str) -> Callable[[], Harness]:
    """A no-argument factory of fresh harness instances for ``reference`` on ``backend``.

    Raises:
        HarnessError: the reference cannot be loaded, or names a class no adapter can build.
    """
    cls = load_harness_class(reference)
    for adapter in _adapters():
        factory = adapter(cls, backend)
        if factory is not None:
            return factory
    if isinstance(cls, type) and issubclass(cls, Harness):
        return cls
    raise HarnessError(f"harness {reference!r} must be a Harness or a HarborEnv subclass, got {cls!r}")


@cache
def _adapters() -> tuple[HarnessAdapter, ...]:
    return tuple(point.load() for point in entry_points(group=ADAPTER_GROUP))


__all__ = [
    "HARNESSES",
    "BashHarness",
    "Harness",
    "PythonHarness",
    "TerminalHarness",
    "harness_factory",
    "load_harness_class",
]
