"""What every command shares: the consoles and the bad-input exit."""

from __future__ import annotations

import typer
from rich.console import Console

out = Console()
err = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as an error and return the exit to raise (2: bad input)."""
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)
