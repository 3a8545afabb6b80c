"""TRL-style harnesses, unchanged, on the engine: a subclass of ``trl.experimental.harbor.HarborEnv`` rebased.

A harness written for TRL subclasses TRL's ``HarborEnv`` (or ``HarborBashEnv``)
and builds its tools on ``self._exec`` (and its ``_setup`` on ``self._env``).
:func:`adapt_trl_harness` makes a class that runs it on the shim without an
edit: the new class derives from the harness *and* from :class:`TRLCompat`,
which puts the shim's env between the harness and TRL's base::

    MyHarness(adapted) -> MyHarness -> TRLCompat -> shim HarborEnv -> TRL HarborEnv -> object

So the harness's own tools, ``PROMPT_SUFFIX``, ``_setup`` and ``__init__``
come first; what they inherit from TRL (``reset``, ``_exec``, ``reward``, the
``_env`` and ``_task`` of the current rollout, ``super().__init__``) is the
shim's; TRL's own loop thread, ``_start``/``_verify``/``_stop`` and ``__del__``
are never reached. The adapted class is still an instance of TRL's
``HarborEnv`` and of the harness (``isinstance`` checks in user code hold) and
keeps its name (TRL logs an env-owned reward under the class name).

``trl`` is imported only when a class actually derives from TRL's env.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from shim import engines
from shim.env import HarborEnv

T = TypeVar("T")


def trl_harbor_env() -> type | None:
    """TRL's ``HarborEnv`` class if trl is already imported (a class deriving from it means it is)."""
    module = sys.modules.get("trl.experimental.harbor._env")
    return None if module is None else module.HarborEnv


def is_trl_harness(cls: object) -> bool:
    """Whether ``cls`` is a class deriving from TRL's ``HarborEnv`` and not already a shim env."""
    base = trl_harbor_env()
    return base is not None and isinstance(cls, type) and issubclass(cls, base) and not issubclass(cls, HarborEnv)


@functools.cache
def _compat_base() -> type[HarborEnv]:
    """``TRLCompat``: the shim's env placed in front of TRL's base (built once, after trl is imported)."""
    base = trl_harbor_env()
    assert base is not None

    class TRLCompat(HarborEnv, base):  # type: ignore[misc,valid-type]
        """The shim's env answering for TRL's base class (see the module doc)."""

        def __init__(self, environment_type: str = "docker", **kwargs: Any) -> None:
            # The shim's constructor only: TRL's would start a loop thread per env.
            HarborEnv.__init__(self, environment_type, **kwargs)

        def _run(self, coro: Awaitable[T]) -> T:
            """TRL's helper (run a coroutine, block for its result): on the loop of the current episode.

            The shim's loop thread in training; the evaluation's loop when ``eval``
            drives the harness (its Harbor environment lives there).
            """
            episode = self._current()
            if episode is not None:
                return episode.call(_await, coro)
            return engines.call(_await, coro)

        def __del__(self) -> None:
            """TRL's finalizer stops the sandbox on its own loop; the shim's finalizer already does it."""

    TRLCompat.__module__ = __name__
    TRLCompat.__qualname__ = "TRLCompat"
    return TRLCompat


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


@functools.cache
def adapt_trl_harness(cls: type) -> type[HarborEnv]:
    """A subclass of ``cls`` (a TRL ``HarborEnv`` subclass) that runs on the shim's engine.

    One class per harness (cached), named as the harness.

    Raises:
        TypeError: ``cls`` does not derive from TRL's ``HarborEnv``.
    """
    if not is_trl_harness(cls):
        raise TypeError(f"{cls!r} does not derive from trl.experimental.harbor.HarborEnv")
    adapted = type(
        cls.__name__,
        (cls, _compat_base()),
        {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}[shim]", "__doc__": cls.__doc__},
    )
    return adapted  # type: ignore[return-value]
