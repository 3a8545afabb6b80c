"""Strings from tasks, sandboxes and models are escaped before they reach a terminal.

A task folder's name, a Dockerfile line, a command's output or a model's text
can hold terminal control sequences (clear the screen, set the window title,
move the cursor and overwrite what was printed): printed raw, they let a task
or a model fake what the operator reads ("ALL EPISODES PASSED"). Every control
character is written as a visible escape instead (``\\x1b``), except the line
breaks and tabs of multi-line text where asked.
"""

from __future__ import annotations

import unicodedata
from typing import Any

_KEPT = frozenset("\n\t")


def _visible(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_controls(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control or format character (C0, DEL, C1, bidi overrides) made visible."""
    if text.isprintable():  # the common case: nothing to do
        return text
    kept = _KEPT if keep_newlines else frozenset()
    return "".join(
        char if char in kept or unicodedata.category(char) not in ("Cc", "Cf") else _visible(char) for char in text
    )


def escape_fields(event_dict: dict[str, Any]) -> dict[str, Any]:
    """The log event with every string value escaped (a structlog processor's body)."""
    return {key: escape_controls(value, keep_newlines=True) if isinstance(value, str) else value
            for key, value in event_dict.items()}  # fmt: skip
