"""The shim's harness adapter for the core (entry point ``harbor_async.harness_adapters``).

``eval`` names a harness class; when that class is the shim's ``HarborEnv``
subclass or a TRL ``HarborEnv`` subclass, the core asks this adapter how to
build one. The instance is a :class:`~harbor_async.harnesses.Harness` that the
core binds to its own episodes, so the class's tools and ``_setup`` run as in
training, on the evaluation's engine.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from harbor_async.harnesses import Harness
from shim.env import HarborEnv
from shim.trl_harness import adapt_trl_harness, is_trl_harness


def harness_factory(cls: type, backend: str) -> Callable[[], Harness] | None:
    """A factory of instances of ``cls`` for ``backend``, or ``None`` when ``cls`` is not a TRL-style env."""
    if is_trl_harness(cls):
        cls = adapt_trl_harness(cls)
    if isinstance(cls, type) and issubclass(cls, HarborEnv):
        return partial(cls, environment_type=backend)
    return None
