"""Options of `run` and `eval` built on the settings model: defaults shown from it, and the engine's start knobs declared once."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from harbor_async.jobs.settings import JobSettings


def setting_default(name: str) -> str:
    """A setting's default (``limits.max_turns``: a field of a nested model), as ``--help`` shows it.

    Declared once, on :class:`~harbor_async.jobs.settings.JobSettings`.
    """

    model: Any = JobSettings
    *path, last = name.split(".")
    for part in path:
        model = model.model_fields[part].annotation
    return str(model.model_fields[last].get_default(call_default_factory=True))


StartTimeoutOpt = Annotated[
    float | None, typer.Option(help="Seconds for one start attempt.", show_default=setting_default("start_timeout"))
]
SlotTimeoutOpt = Annotated[
    float | None,
    typer.Option(help="Seconds a start may wait for a live-sandbox slot.", show_default=setting_default("slot_timeout")),
]
StartAttemptsOpt = Annotated[
    int | None,
    typer.Option(
        help="Start attempts for transient failures (jittered exponential backoff).",
        show_default=setting_default("start_attempts"),
    ),
]
StartRetryWaitOpt = Annotated[
    float | None,
    typer.Option(help="Seconds of the first wait between start attempts.", show_default=setting_default("start_retry_wait")),
]
StartRetryMaxWaitOpt = Annotated[
    float | None,
    typer.Option(
        help="Seconds of the longest wait between start attempts.", show_default=setting_default("start_retry_max_wait")
    ),
]
StartRetryMaxTotalOpt = Annotated[
    float | None,
    typer.Option(help="Seconds all attempts of one start may take.", show_default=setting_default("start_retry_max_total")),
]
AdaptiveStartsOpt = Annotated[
    bool | None,
    typer.Option(
        "--adaptive-starts/--fixed-starts",
        help="Bound the sandbox starts in flight by a window that opens while starts succeed in time and halves "
        "on a provider's rate-limit or quota answer or a start-latency breach (default); --fixed-starts: start "
        "as many as the concurrency allows at once.",
        show_default=False,
    ),
]
ResourceTelemetryOpt = Annotated[
    bool | None,
    typer.Option(
        "--resource-telemetry/--no-resource-telemetry",
        help="Read what each sandbox used (CPU seconds, peak memory, disk written, processes) just before its stop, "
        "into its record's resources (default); sandbox-seconds are counted either way.",
        show_default=False,
    ),
]
DeleteOpt = Annotated[
    bool,
    typer.Option(
        "--delete/--no-delete",
        help="At the run's end, delete the task images its docker sandboxes built or reused (Harbor's --delete; "
        "default here: kept for the next run). Containers and volumes are removed at every stop either way.",
    ),
]
