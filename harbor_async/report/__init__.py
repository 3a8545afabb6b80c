"""The offline HTML report of a job (``run``, ``eval``, a sweep) or of benchmark results.

``harbor-async report PATH`` writes one self-contained file (no network: it
opens from disk on an air-gapped cluster); ``harbor-async view PATH`` serves it
on 127.0.0.1 and reloads it while the job runs. Needs the ``report`` extra
(Jinja2, matplotlib).

- :mod:`.source`: what a path holds (job folder, records file, benchmark results);
- :mod:`.analysis`: summaries, outcomes, phase percentiles, per-task rows, paired differences;
- :mod:`.charts`: matplotlib charts as SVG data URIs; :mod:`.bench`: benchmark sections;
- :mod:`.pack`: inert JSON and the gzip-compressed episodes; :mod:`.render`: the templates;
- :mod:`.server`: the ``view`` server.

Imports: core, jobs.
"""

from harbor_async.report.render import default_output, render, write_report
from harbor_async.report.source import ReportSourceError, load_source

__all__ = ["ReportSourceError", "default_output", "load_source", "render", "write_report"]
