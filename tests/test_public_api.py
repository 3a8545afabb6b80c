"""The package's public names: each one resolves, the lazy ones are listed, the records' types are exported."""

from __future__ import annotations

import harbor_async


def test_every_public_name_resolves_and_dir_lists_the_lazy_ones() -> None:
    assert all(getattr(harbor_async, name) is not None for name in harbor_async.__all__)
    assert {"evaluate", "evaluate_sync"} <= set(dir(harbor_async))  # served by __getattr__, not in globals()


def test_what_a_caller_reads_or_catches_is_exported() -> None:
    from harbor_async.core.errors import FailureClass, SandboxCancelledError
    from harbor_async.core.records import EpisodeRecord

    # wait_started() raises SandboxCancelledError; records carry FailureClass values
    assert harbor_async.SandboxCancelledError is SandboxCancelledError
    assert harbor_async.FailureClass is FailureClass and harbor_async.EpisodeRecord is EpisodeRecord


def test_the_shims_lazy_trainer_is_listed_and_resolves() -> None:
    import shim

    assert "HarborGRPOTrainer" in dir(shim)  # served by __getattr__ (it imports trl and torch), not in globals()
    assert all(getattr(shim, name) is not None for name in shim.__all__)


def test_evaluates_keywords_are_the_job_settings_fields_typed() -> None:
    import inspect
    import typing

    from harbor_async.evaluation import evaluate, evaluate_sync
    from harbor_async.jobs.settings import EvaluateSettings, JobSettings

    # every field but those evaluate() takes as its own arguments (models, suite) or writes itself
    own = {"command", "models", "suite", "episodes", "created_at", "version"}
    assert set(EvaluateSettings.__annotations__) == set(JobSettings.model_fields) - own
    assert typing.get_type_hints(evaluate, include_extras=True)["settings"] == typing.Unpack[EvaluateSettings]
    assert inspect.signature(evaluate_sync) == inspect.signature(evaluate) and evaluate_sync.__name__ == "evaluate_sync"
