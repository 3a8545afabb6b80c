"""``harbor-async report`` and ``harbor-async view``: the offline HTML report of a job or benchmark results."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from harbor_async.cli.common import err, fail, out
from harbor_async.core.logs import configure_logging

PathArg = Annotated[
    Path,
    typer.Argument(help="A job folder (run, eval, sweep), an episodes .jsonl file, or benchmark results (a .json file or a folder of them)."),
]
Threshold = Annotated[
    float | None,
    typer.Option("--success-threshold", help="Reward at or above which an episode is solved (pass@k); default 1.0."),
]


def _report_module():
    try:  # the extra's packages, checked before any work
        import jinja2  # noqa: F401
        import matplotlib  # noqa: F401

        from harbor_async import report
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise fail(f"the report needs the 'eval' extra (Jinja2, matplotlib): pip install 'harbor-async[eval]' ({exc})") from None
    return report


def report(
    path: PathArg,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="The HTML file to write (default: report.html in the job or results folder).")] = None,
    success_threshold: Threshold = None,
) -> None:
    """Write one self-contained HTML report (no network needed to open it) of a job or benchmark results.

    Works on a job that is still running: it shows the episodes finished so far.
    """
    module = _report_module()
    target = output or module.default_output(path)
    try:
        written = module.write_report(path, target, success_threshold=success_threshold)
    except module.ReportSourceError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write {target}: {exc.strerror or exc}") from None
    out.print(f"wrote {written} ({written.stat().st_size / 1e6:.1f} MB)")


def view(
    path: PathArg,
    port: Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="Port on 127.0.0.1 (0: any free one).")] = 8765,
    success_threshold: Threshold = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error (info logs each rebuild).")] = "warning",
) -> None:
    """Serve the report on 127.0.0.1 and refresh it while the job runs (Ctrl-C stops)."""

    configure_logging(log_level, force=True)
    module = _report_module()
    from harbor_async.report.server import ReportServer

    try:
        server = ReportServer(path, port=port, success_threshold=success_threshold)
    except module.ReportSourceError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}") from None
    # One line with the address (port 0 picks one): scripts and tests read it.
    err.print(f"serving the report of {path} at {server.url} (Ctrl-C stops)", highlight=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
