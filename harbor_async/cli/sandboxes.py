"""``harbor-async sandboxes list | reap | prune``: sandboxes that killed runs left behind, and the task images runs keep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from harbor_async.backends.docker.cleanup import prune_task_images
from harbor_async.backends.reaper import (
    BACKENDS,
    SandboxInfo,
    format_age,
    list_sandboxes,
    parse_duration,
    reap,
)
from harbor_async.cli.cluster import RayAddressOpt
from harbor_async.cli.common import fail, out, say, setup_logging
from harbor_async.core.errors import ReaperError

sandboxes_app = typer.Typer(
    name="sandboxes",
    help="List and remove sandboxes of harbor-async runs (docker and local), e.g. what a killed run left.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
EnvOpt = Annotated[str | None, typer.Option("--env", "-e", help=f"One of: {', '.join(BACKENDS)}.", show_default="all")]
OldBackendOpt = Annotated[str | None, typer.Option("--backend", "-b", hidden=True)]
RootOpt = Annotated[
    list[Path] | None,
    typer.Option("--local-root", help="Local-backend base folder besides $HARBOR_ASYNC_LOCAL_ROOT (repeatable)."),
]
LabelOpt = Annotated[str | None, typer.Option("--run-label", help="Only the sandboxes of this run label.")]
RayLedgerOpt = Annotated[bool, typer.Option("--ray", help="The Ray cluster budget's ledger instead of this machine.")]


def _check(env: str | None, backend: str | None) -> str:
    """The backend to scan (``-e``, or the older ``-b``); exit 2 when unknown. Also sets up logging."""
    chosen = env or backend or "all"
    if chosen not in BACKENDS:
        raise fail(f"-e/--env must be one of {', '.join(BACKENDS)}, got {chosen!r}")
    setup_logging()
    return chosen


def _alive(info: SandboxInfo) -> str:
    return {True: "yes", False: "no", None: "?"}[info.owner_alive]


def _table(title: str, sandboxes: list[SandboxInfo], reasons: dict[int, str] | None = None) -> Table:
    table = Table(title=title)
    table.add_column("backend")
    table.add_column("id", no_wrap=True)
    table.add_column("run label", no_wrap=True)
    table.add_column("owner pid", justify="right")
    table.add_column("alive?", justify="center")
    table.add_column("age", justify="right")
    table.add_column("holds")
    if reasons is not None:
        table.add_column("why kept")
    for info in sandboxes:
        kinds: dict[str, int] = {}
        for resource in info.resources:
            kinds[resource.kind] = kinds.get(resource.kind, 0) + 1
        holds = ", ".join(
            kind if n == 1 else f"{n} {kind}{'es' if kind.endswith('s') else 's'}" for kind, n in kinds.items()
        )
        row = [
            info.backend, info.id, info.run_label or "?", str(info.owner_pid or "?"),
            _alive(info), format_age(info.age), holds,
        ]  # fmt: skip
        if reasons is not None:
            row.append(reasons.get(id(info), ""))
        table.add_row(*(Text(str(cell)) for cell in row))  # ids and reasons are data, not markup
    return table


@sandboxes_app.command("list")
def list_command(
    env: EnvOpt = None,
    backend: OldBackendOpt = None,
    local_root: RootOpt = None,
    run_label: LabelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per sandbox instead of a table.")] = False,
    ray: RayLedgerOpt = False,
    ray_address: RayAddressOpt = None,
) -> None:
    """List the sandboxes of harbor-async runs on this machine, live or left behind."""
    backend = _check(env, backend)
    if ray:
        from harbor_async.cli.cluster import ledger_list

        return ledger_list(ray_address, as_json)
    problems: list[str] = []
    found = list_sandboxes(backend, roots=local_root or (), run_label=run_label, errors=problems)
    for problem in problems:
        say("not scanned:", problem)
    if as_json:
        for info in found:
            typer.echo(json.dumps(info.to_dict()))
        return
    if not found:
        out.print("no sandboxes")
        return
    out.print(_table("sandboxes", found))
    dead = sum(1 for s in found if not s.owner_alive)
    out.print(f"{len(found)} sandboxes, {dead} without a live owner (`harbor-async sandboxes reap` removes those)")


@sandboxes_app.command("reap")
def reap_command(
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than", help="Only sandboxes at least this old: 90s, 10m, 2h, 1d (also admits unknown owners)."
        ),
    ] = None,
    env: EnvOpt = None,
    backend: OldBackendOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Also remove sandboxes whose owning process is still alive.")
    ] = False,
    local_root: RootOpt = None,
    run_label: LabelOpt = None,
    ray: RayLedgerOpt = False,
    ray_address: RayAddressOpt = None,
) -> None:
    """Remove sandboxes whose owning process is dead.

    Docker: containers, networks, volumes, images and compose processes of the
    sandbox's compose project. Local: its folder and bwrap processes. Both:
    Harbor's trial folder.

    A sandbox whose owner is unknown (no pid recorded, or one of another pid
    namespace) is removed only with --older-than or --force.

    Exits 1 when something could not be removed (or, with -e docker,
    when Docker could not be scanned).
    """
    backend = _check(env, backend)
    try:
        age = parse_duration(older_than) if older_than is not None else None
    except ValueError as exc:
        raise fail(f"--older-than: {exc}") from None
    if ray:  # the cluster ledger: expire silent holders, remove this host's orphans
        from harbor_async.cli.cluster import ledger_reap

        raise typer.Exit(ledger_reap(ray_address, age))
    report = reap(age, include_live_owners=force, backend=backend, roots=local_root or (), run_label=run_label)
    if report.reaped:
        out.print(_table("reaped", report.reaped))
    if report.skipped:
        reasons = {id(info): why for info, why in report.skipped}
        out.print(_table("kept", [info for info, _ in report.skipped], reasons))
    for problem in report.unscanned:
        say("not scanned:", problem)
    for problem in report.errors:
        say("problem:", problem, "bold red")
    out.print(f"reaped {len(report.reaped)}, kept {len(report.skipped)}, problems {len(report.errors)}")
    # Asked for docker explicitly and it could not be looked at: that is a failure too.
    if not report.ok or (backend == "docker" and report.unscanned):
        raise typer.Exit(1)


@sandboxes_app.command("prune")
def prune_command() -> None:
    """Remove the docker task images runs kept (Harbor's ``hb__*`` names): the fast start builds each once and keeps it.

    An image a container still uses (a live sandbox's) is kept and named. Exits 1
    when Docker cannot be asked.
    """

    try:
        removed, kept = prune_task_images()
    except (ReaperError, OSError) as exc:
        raise fail(f"cannot list docker images: {exc}", code=1) from None
    for image in removed:
        out.print(Text(f"removed {image}"))
    for line in kept:
        say("kept:", line)
    out.print(f"removed {len(removed)} task images, kept {len(kept)}")
