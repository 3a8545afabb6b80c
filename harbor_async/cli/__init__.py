"""The ``harbor-async`` command line: one module per command, registered here.

Commands import heavy or optional code (the shim, the benchmarks, evaluation)
inside their bodies, so that ``harbor-async --help`` and the core stay light.
The flags follow ``harbor run``'s wherever the meaning is the same.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from harbor_async.cli import run as _run
from harbor_async.cli.bench import bench_app
from harbor_async.cli.sandboxes import sandboxes_app

app = typer.Typer(
    name="harbor-async",
    help="Async episode engine for Harbor sandboxes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"harbor-async {version('harbor-async')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", "-v", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Async episode engine for Harbor sandboxes."""


app.command("run")(_run.run)
app.command("tasks")(_run.tasks)
app.add_typer(sandboxes_app, name="sandboxes")
app.add_typer(bench_app, name="bench")


def main() -> None:  # pragma: no cover - console entry
    """Entry point for ``python -m harbor_async``."""
    sys.exit(app())
