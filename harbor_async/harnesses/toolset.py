"""A harness's tools, exactly as TRL's ``GRPOTrainer`` lists them and renders their schemas.

TRL lists functions on the harness *class* (listing the instance would evaluate
properties), minus ``reset``, ``get_reward`` and ``_private`` names, binds them
to the instance, and renders each bound method with transformers'
``get_json_schema`` inside the chat template. Evaluation shows the model the
same tools.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harbor_async.core.errors import HarnessError

#: Names TRL never exposes as tools, though they are public functions.
NOT_TOOLS = frozenset({"reset", "get_reward"})


class ToolsetError(HarnessError, TypeError):
    """A harness exposes no tool, or a tool whose schema transformers cannot build."""


@dataclass
class Toolset:
    """A harness instance's tools: the schemas the model sees and the callables behind them."""

    schemas: list[dict[str, Any]]
    sync: dict[str, Callable[..., Any]]
    async_: dict[str, Callable[..., Any]]

    @property
    def names(self) -> list[str]:
        """Tool names in schema order."""
        return [s["function"]["name"] for s in self.schemas]


def build_toolset(env: object) -> Toolset:
    """The tools of a harness instance, exactly as TRL's GRPOTrainer builds them.

    TRL lists functions on the *class* (listing the instance would evaluate
    properties), binds them to the instance, and renders each bound method
    with transformers' ``get_json_schema`` inside the chat template.
    """
    try:
        from transformers.utils import get_json_schema
    except ImportError as exc:  # the `eval` extra
        raise ToolsetError(
            "evaluation needs transformers for the tool schemas: pip install 'harbor-async[eval]'"
        ) from exc

    schemas: list[dict[str, Any]] = []
    sync: dict[str, Callable[..., Any]] = {}
    async_: dict[str, Callable[..., Any]] = {}
    for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction):
        if name in NOT_TOOLS or name.startswith("_"):
            continue
        method = getattr(env, name)
        try:
            schemas.append(get_json_schema(method))
        except Exception as exc:  # transformers raises its own TypeError subclasses
            raise ToolsetError(f"tool {type(env).__name__}.{name}: {exc}") from exc
        (async_ if inspect.iscoroutinefunction(method) else sync)[name] = method
    if not schemas:
        raise ToolsetError(f"harness {type(env).__name__} exposes no tool")
    return Toolset(schemas, sync, async_)


