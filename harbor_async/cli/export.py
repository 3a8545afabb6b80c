"""``harbor-async export``: a job's captured episodes (``--capture``) as a Hugging Face ``datasets`` dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from harbor_async.cli.common import fail, out


def export(
    job: Annotated[Path, typer.Argument(help="A job folder of run or eval, run with --capture.")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="The dataset folder to write (default: dataset/ in the job folder); read it with datasets.load_from_disk.")] = None,
    include_unjudged: Annotated[bool, typer.Option("--all", help="Keep the episodes not judged too (infrastructure, model server, cancelled: reward null).")] = False,
) -> None:
    """Write the captured episodes of a job as a datasets dataset: per episode its task, reward and model calls with their token ids.

    Exits 2 when the folder is no job folder or holds no captured episode.
    """
    from harbor_async.jobs.export import ExportError, export_job

    target = output or job / "dataset"
    try:
        summary = export_job(job, target, include_unjudged=include_unjudged)
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise fail(f"export needs the 'trl' extra (datasets): pip install 'harbor-async[trl]' ({exc})") from None
    except ExportError as exc:
        raise fail(exc) from None
    left = [f"{n} {what}" for n, what in ((summary.not_judged, "not judged"), (summary.not_captured, "not captured")) if n]
    out.print(
        f"wrote {summary.rows} episodes ({summary.calls} model calls) to {target}"
        + (f"; left out: {', '.join(left)}" if left else "")
        + (f"; {summary.retokenize} without the server's token ids (retokenize)" if summary.retokenize else ""),
        markup=False, highlight=False,
    )
