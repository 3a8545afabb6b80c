"""The ``harbor-async`` command line: one module per command, imported here.

Commands import heavy or optional code (the shim, the benchmarks, evaluation)
inside their bodies, so that ``harbor-async --help`` and the core stay light.
"""

from __future__ import annotations

import sys

import typer

from harbor_async.cli import doctor as _doctor
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
app.command("doctor")(_doctor.doctor)


def _add_bench() -> None:
    """Register ``bench``: the benchmarks live in a source checkout, not in the wheel."""
    try:
        from benchmarks.cli import bench_app
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks" and not (exc.name or "").startswith("benchmarks."):
            raise
        app.command(
            "bench",
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            help="Benchmarks (needs a source checkout of harbor-async).",
        )(_bench_needs_checkout)
        return
    app.add_typer(bench_app, name="bench")


def _bench_needs_checkout() -> None:
    from harbor_async.cli.common import fail

    raise fail(
        "`harbor-async bench` needs a source checkout: the benchmarks are a folder of the repository, "
        "not part of the installed package. Clone the repository, `uv sync --all-extras` (or "
        "`pip install -e '.[bench]'`) and run it from there."
    )


_add_bench()


def main() -> None:  # pragma: no cover - console entry
    """Entry point for ``python -m harbor_async``."""
    sys.exit(app())
