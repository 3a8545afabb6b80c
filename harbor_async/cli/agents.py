"""``-a``, ``-m`` and ``--ak``: Harbor's agent flags, shared by ``run`` and ``eval``, checked before any sandbox starts.

``-a`` names an agent Harbor knows (``terminus-2``, ``claude-code``, ...) or a
``module:Class`` Harbor ``BaseAgent``; ``-m`` its model; ``--ak key=value``
its options, read by Harbor's own parser. Each problem is one line and exit 2:
an unknown name (with the choices), a class that does not load, options the
agent refuses (it is built once, nothing started).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from harbor_async.cli.common import fail
from harbor_async.core.errors import AgentConfigError

if TYPE_CHECKING:
    from harbor_async.agents.harbor import HarborAgentSpec

AgentKwargOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--ak", "--agent-kwarg",
        help="A Harbor agent's key=value option (repeatable), read as `harbor run` reads it (e.g. api_base=URL).",
    ),
]  # fmt: skip


def parsed_agent_kwargs(pairs: list[str] | None) -> dict[str, Any]:
    """``--ak`` pairs as ``harbor run`` parses them; exit 2 on a malformed one."""
    from harbor_async.agents.harbor import parse_agent_kwargs

    try:
        return parse_agent_kwargs(pairs)
    except AgentConfigError as exc:
        raise fail(exc) from None


def harbor_agent_class(name: str) -> type:
    """The Harbor agent class of ``-a NAME``; exit 2 with one line (the choices, for an unknown name)."""
    from harbor_async.agents.harbor import agent_class

    try:
        return agent_class(name)
    except AgentConfigError as exc:
        raise fail(exc) from None


def checked_spec(spec: HarborAgentSpec) -> HarborAgentSpec:
    """``spec``, once the agent has been built with its options (nothing started); else exit 2 in one line."""
    try:
        spec.check()
    except AgentConfigError as exc:
        raise fail(exc) from None
    return spec


def checked_capture(spec: HarborAgentSpec) -> None:
    """Exit 2 in one line unless ``--capture`` can record ``spec``'s model calls (see :meth:`HarborAgentSpec.check_capture`)."""
    try:
        spec.check_capture()
    except AgentConfigError as exc:
        raise fail(exc) from None
