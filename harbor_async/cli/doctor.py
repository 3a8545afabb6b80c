"""``harbor-async doctor``: what this machine can run, what is missing, and how to get it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from harbor_async.cli.common import fail, out, parse_kwargs
from harbor_async.core.errors import HarborAsyncError


def doctor(
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", "-b", help="A backend you will use: local, simulated, docker, docker-fast, e2b, modal, daytona, runloop (repeatable; default: local). Each is proven: its environment is built as a run builds it, and docker also starts and stops a container."),
    ] = None,
    feature: Annotated[
        list[str] | None,
        typer.Option("--feature", "-f", help="A feature you will use: trl, eval, ray, limits (repeatable)."),
    ] = None,
    base_url: Annotated[
        str | None,
        typer.Option("--base-url", help="An OpenAI-compatible model server to reach (GET {url}/models; key from OPENAI_API_KEY)."),
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option("--model", "-m", help="With --base-url: a model that must answer a one-token chat request (repeatable)."),
    ] = None,
    ek: Annotated[
        list[str] | None,
        typer.Option("--ek", "--environment-kwarg", help="A backend option the run will pass, key=value (repeatable; checked, and used to build the backend's environment)."),
    ] = None,
    path: Annotated[
        Path | None,
        typer.Option("--path", "-p", help="The suite you will run (default: the bundled one): its first task builds each backend's environment, and docker starts a container from each image its tasks need."),
    ] = None,
    only: Annotated[bool, typer.Option("--only", help="Check only what was asked for (faster).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
) -> None:
    """Check Python, packages, system tools and services for each backend and feature.

    Exits 0 when everything you asked for (``--backend``, ``--feature``,
    ``--base-url``; by default the local backend) can run, 1 otherwise.
    Credentials are checked for presence only and never printed.
    """
    from harbor_async.cli.machine_checks import FEATURES, diagnose

    requested = [*(backend or ["local"]), *(feature or [])]
    unknown = [name for name in requested if name not in FEATURES]
    if unknown:
        raise fail(f"unknown backend or feature {', '.join(unknown)}; known: {', '.join(FEATURES)}")
    try:
        diagnosis = diagnose(
            requested, base_url=base_url, everything=not only, backend_kwargs=parse_kwargs(ek), suite=path,
            models=model or (),
        )  # fmt: skip
    except HarborAsyncError as exc:  # the suite cannot be loaded
        raise fail(exc) from None
    if as_json:
        print(diagnosis.to_json())
        raise typer.Exit(0 if diagnosis.ok else 1)

    for name, checks in diagnosis.results.items():
        asked = name in diagnosis.requested
        out.print(f"[bold]{name}[/]" + ("" if asked else " [dim](not asked for)[/]"))
        for check in checks:
            mark = "[green]ok     [/]" if check.ok else ("[red]MISSING[/]" if asked else "[yellow]missing[/]")
            out.print(f"  {mark} {escape(check.name)}: {escape(check.found)}")
            if check.fix:
                out.print(f"          [dim]fix:[/] {escape(check.fix)}")
    if diagnosis.ok:
        out.print(f"[green]ready:[/] {', '.join(diagnosis.requested)}")
        return
    for name, check in diagnosis.missing():
        out.print(f"[red]not ready:[/] {name} needs {escape(check.name)}: {escape(check.fix)}")
    raise typer.Exit(1)
