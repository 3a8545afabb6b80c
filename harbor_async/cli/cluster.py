"""Command-line pieces for running past one machine: the budget options, ``--ray``, and the ledger commands.

``run`` and ``eval`` take the options as parameters, turn them into settings
with :func:`cluster_settings` (checked), and build the budget with :func:`budget_from_options`; ``sandboxes list|reap --ray`` call
:func:`ledger_list` and :func:`ledger_reap`. Ray is imported only when asked for.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any

import typer
from rich.table import Table

from harbor_async.backends.reaper import reap
from harbor_async.cli.common import err, fail, out, warn_renamed_flags

#: Flags renamed to the shim's names of the same settings (cluster_max_live, cluster_creates_per_second).
RENAMED_FLAGS = {"--max-live": "--cluster-max-live", "--creates-per-second": "--cluster-creates-per-second"}

BudgetOpt = Annotated[
    str,
    typer.Option(
        "--budget",
        help="local: this process's limits; ray: also lease from one budget actor shared by every process "
        "and node of the Ray cluster (needs harbor-async[ray]).",
    ),
]
RayAddressOpt = Annotated[
    str | None,
    typer.Option("--ray-address", help="Ray cluster address (default: RAY_ADDRESS or the local cluster)."),
]
MaxLiveOpt = Annotated[
    int | None,
    typer.Option(
        "--cluster-max-live", "--max-live", min=1, help="Live sandboxes across the whole cluster (--budget ray)."
    ),
]
CreatesOpt = Annotated[
    float | None,
    typer.Option(
        "--cluster-creates-per-second", "--creates-per-second", min=0.001,
        help="Sandbox creations per second across the cluster (--budget ray).",
    ),
]
PerRankOpt = Annotated[
    bool,
    typer.Option("--per-rank-limits", help="Divide this process's limits by WORLD_SIZE (torchrun/accelerate ranks)."),
]
RayOpt = Annotated[
    bool,
    typer.Option("--ray", help="Shard the episodes over the Ray cluster: one engine per node, records streamed back."),
]


def _check_options(
    budget: str, ray_address: str | None, max_live: int | None, creates_per_second: float | None, on_ray: bool
) -> bool:
    """Whether the options ask for the Ray budget; ``typer.Exit(2)`` on a bad combination or Ray missing."""
    if on_ray:
        require_ray()
    if budget not in ("local", "ray"):
        raise fail(f"--budget must be 'local' or 'ray', got {budget!r}")
    if budget == "local":
        if max_live is not None or creates_per_second is not None or (ray_address is not None and not on_ray):
            raise fail(
                "--cluster-max-live, --cluster-creates-per-second and --ray-address are cluster caps: add --budget ray"
            )
        return False
    require_ray()
    return True


def budget_from_options(
    budget: str,
    ray_address: str | None = None,
    max_live: int | None = None,
    creates_per_second: float | None = None,
    on_ray: bool = False,
) -> Callable[[Any], Any] | None:
    """The ``Engine(budget=...)`` factory the options ask for (``None``: the process-local default).

    ``on_ray``: the episodes run on the Ray cluster (``--ray``), whose address ``ray_address`` is then too.
    Raises ``typer.Exit(2)`` on a bad combination, and when Ray is not installed.
    """
    if not _check_options(budget, ray_address, max_live, creates_per_second, on_ray):
        return None
    from harbor_async.cluster.ray_budget import factory

    # run/eval episodes need one sandbox each: per-sandbox leases cannot deadlock.
    return factory(address=ray_address, max_live=max_live, creates_per_second=creates_per_second)


def cluster_settings(
    budget: str, ray_address: str | None, max_live: int | None, creates_per_second: float | None, on_ray: bool
) -> dict[str, Any]:
    """The options as run's and eval's settings (``RunSettings`` and ``EvaluateSettings`` share these names),
    checked as a combination (``typer.Exit(2)``) before anything is loaded; :func:`budget_from_options` builds the
    budget from the settings later (a resumed job's are the stored ones)."""
    warn_renamed_flags(RENAMED_FLAGS)
    _check_options(budget, ray_address, max_live, creates_per_second, on_ray)
    return {
        "ray": on_ray, "ray_address": ray_address, "budget": budget,
        "cluster_max_live": max_live, "cluster_creates_per_second": creates_per_second,
    }  # fmt: skip


def require_ray() -> None:
    """``typer.Exit(2)`` with the install hint when the ``ray`` extra is missing."""
    from harbor_async.cluster.connect import import_ray
    from harbor_async.cluster.errors import RayNotInstalledError

    try:
        import_ray()
    except RayNotInstalledError as exc:
        raise fail(str(exc)) from None


def _actor(ray_address: str | None) -> Any:
    from harbor_async.cluster.budget_actor import get_or_create
    from harbor_async.cluster.errors import ClusterError

    require_ray()
    try:
        return get_or_create(None, address=ray_address)
    except ClusterError as exc:
        raise fail(str(exc), code=1) from None


def _rows_table(title: str, rows: list[dict[str, Any]], extra: str | None = None) -> Table:
    table = Table(title=title)
    for column in ("backend", "sandbox", "run label", "host", "pid", "holder"):
        table.add_column(column, no_wrap=column in ("sandbox", "run label"))
    if extra:
        table.add_column(extra)
    for row in rows:
        cells = [str(row.get(k) or "?") for k in ("backend", "sandbox", "run_label", "host", "pid", "holder")]
        if extra:
            cells.append(str(row.get(extra, "")))
        table.add_row(*cells)
    return table


def ledger_list(ray_address: str | None, as_json: bool) -> None:
    """``sandboxes list --ray``: the cluster ledger (live sandboxes, orphans of dead holders, holders)."""
    import ray

    ledger = ray.get(_actor(ray_address).ledger.remote())
    if as_json:
        for row in ledger["sandboxes"]:
            typer.echo(json.dumps({**row, "state": "live"}))
        for row in ledger["orphans"]:
            typer.echo(json.dumps({**row, "state": "orphaned"}))
        return
    caps = ledger["caps"]
    out.print(
        f"cluster caps: {caps['max_live'] or 'unlimited'} live, {caps['creates_per_second'] or 'unlimited'} "
        f"creates/s, {caps['concurrent_execs'] or 'unlimited'} execs; lease timeout {caps['lease_timeout']} s"
    )
    holders = Table(title="holders")
    for column in ("holder", "host", "pid", "batch", "slots", "silent s"):
        holders.add_column(column)
    for h in ledger["holders"]:
        holders.add_row(
            h["holder"], str(h.get("host")), str(h.get("pid")), str(h.get("batch")), str(h["slots"]), str(h["silent_s"])
        )
    out.print(holders)
    out.print(_rows_table("live sandboxes", ledger["sandboxes"]) if ledger["sandboxes"] else "no live sandboxes")
    if ledger["orphans"]:
        out.print(_rows_table("orphaned (their holder died; the quota is back)", ledger["orphans"]))
        out.print("`harbor-async sandboxes reap --ray` removes the orphans of this host")


def ledger_reap(ray_address: str | None, older_than: timedelta | float | None = None) -> int:
    """``sandboxes reap --ray``: expire holders silent for ``older_than`` (default: the lease timeout)
    now, then remove this host's orphans.

    Returns the exit code: 1 when a sandbox of this host could not be removed.
    Orphans of other hosts are listed: run the command there.
    """
    import ray

    actor = _actor(ray_address)
    if isinstance(older_than, timedelta):
        older_than = older_than.total_seconds()
    ray.get(actor.reap.remote(older_than))
    orphans = ray.get(actor.ledger.remote())["orphans"]
    host = socket.gethostname()
    here = [row for row in orphans if row.get("host") == host]
    elsewhere = [row for row in orphans if row.get("host") != host]
    removed: list[str] = []
    problems = 0
    for label in sorted({row.get("run_label") for row in here if row.get("run_label")}):
        report = reap(None, backend="all", run_label=label)
        removed += [info.id for info in report.reaped]
        problems += len(report.errors)
        for problem in report.errors:
            err.print(f"[bold red]problem:[/] {problem}")
    # An orphan with no sandbox left on this host (a simulated one, or already gone) is done too.
    ids = [row["sandbox"] for row in here]
    cleared = ray.get(actor.clear_orphans.remote(ids)) if problems == 0 else 0
    out.print(f"removed {len(removed)} sandboxes of dead holders on {host}; {cleared} orphans cleared from the ledger")
    if elsewhere:
        out.print(_rows_table("orphans on other hosts (run `harbor-async sandboxes reap --ray` there)", elsewhere))
    return 1 if problems else 0
