"""The ``harbor-async`` command line: one module per command, imported here.

Commands import heavy or optional code (the shim, the benchmarks, evaluation)
inside their bodies, so that ``harbor-async --help`` and the core stay light.
"""

from __future__ import annotations

import sys

import typer

from harbor_async.cli import eval as _eval
from harbor_async.cli import run as _run
from harbor_async.cli.sandboxes import sandboxes_app

app = typer.Typer(
    name="harbor-async",
    help="Async episode engine for Harbor sandboxes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(_run.run)
app.command("tasks")(_run.tasks)
app.add_typer(sandboxes_app, name="sandboxes")
app.command("eval")(_eval.eval_command)


def _add_bench() -> None:
    from benchmarks.cli import bench_app

    app.add_typer(bench_app, name="bench")


_add_bench()


def main() -> None:  # pragma: no cover - console entry
    """Entry point for ``python -m harbor_async``."""
    sys.exit(app())
