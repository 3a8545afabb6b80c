"""The ``harbor-async`` command line: one module per command, registered here.

Commands import heavy or optional code (the shim, the benchmarks, evaluation)
inside their bodies, so that ``harbor-async --help`` and the core stay light.
The flags follow ``harbor run``'s wherever the meaning is the same.

Imports: core, models, tasks, verification, backends, engine, jobs, report, episodes, agents, cluster, evaluation.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from harbor_async.cli import doctor as _doctor
from harbor_async.cli import eval as _eval
from harbor_async.cli import export as _export
from harbor_async.cli import report as _report
from harbor_async.cli import run as _run
from harbor_async.cli.bench import bench_app
from harbor_async.cli.common import say
from harbor_async.cli.sandboxes import sandboxes_app


def _usage_errors() -> tuple[type[Exception], ...]:
    """Typer's usage errors: its own class where Typer vendors Click, else Click's."""
    own = getattr(typer, "TyperException", None)
    if own is not None:
        return (own,)
    from click.exceptions import ClickException

    return (ClickException,)


class _App(typer.Typer):
    """Typer, with a bad option value reported on one line (``error: ...``, exit 2) instead of a box."""

    def __call__(self, *args, **kwargs):
        from typer.main import get_command

        from harbor_async.cli.harbor_flags import refusal

        given = list(kwargs.get("args") or (args[0] if args else None) or sys.argv[1:])
        refused = refusal(given[1:]) if given[:1] == ["run"] else None
        if refused is not None:  # a `harbor run` flag we cannot honour: say why, not Click's "no such option"
            say("error:", refused, "bold red")
            sys.exit(2)
        try:
            code = get_command(self).main(*args, standalone_mode=False, **kwargs)
        except typer.Abort:
            sys.exit(1)
        except _usage_errors() as exc:  # a bad flag or value
            where = getattr(getattr(exc, "ctx", None), "command_path", None)
            hint = f" (see `{where} --help`)" if where else ""
            say("error:", " ".join(exc.format_message().split()) + hint, "bold red")
            sys.exit(getattr(exc, "exit_code", 2))
        sys.exit(code if isinstance(code, int) else 0)


app = _App(
    name="harbor-async",
    help="Async episode engine for Harbor sandboxes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # harbor run's -h, on every command
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
app.command("report")(_report.report)
app.command("view")(_report.view)
app.add_typer(bench_app, name="bench")
app.command("eval")(_eval.eval_command)
app.command("doctor")(_doctor.doctor)
app.command("export")(_export.export)


def main() -> None:  # pragma: no cover - console entry
    """Entry point for ``python -m harbor_async``."""
    sys.exit(app())
