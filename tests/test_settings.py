"""The one settings model: checked once, stored whole, read back whole (earlier forms too), resumed field by field."""

from __future__ import annotations

import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from harbor_async.core.errors import (
    ResumeConflictError,
    SettingError,
    UnknownSettingError,
)
from harbor_async.core.policy import Limits, RetryPolicy, Timeouts
from harbor_async.jobs.setting_fields import (
    ENGINE_PARTS,
    AgentLimits,
    EngineSettings,
    Sampling,
)
from harbor_async.jobs.settings import RESUME_MAY_CHANGE, SETTINGS_VERSION, JobSettings
from shim.options import EngineOptions


def _another(annotation: Any, current: Any) -> Any:
    """A valid value of ``annotation`` other than ``current``, read off the type alone (no list of fields)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _another(args[0], current)
    if origin in (typing.Union, types.UnionType):
        branch = next(a for a in args if a is not type(None))
        return _another(branch, current if isinstance(current, typing.get_origin(branch) or branch) else None)
    if origin is typing.Literal:
        return next(a for a in args if a != current)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        name, info = next(iter(annotation.model_fields.items()))
        dumped = (current or annotation()).model_dump()
        return {**dumped, name: _another(info.annotation, dumped[name])}
    if annotation is bool:
        return not current
    if annotation is int:
        return (current or 0) + 1
    if annotation is float:
        return (current or 1.0) * 2
    if annotation is str:
        return f"{current or ''}x"
    if origin in (list, tuple):
        return [*(current or ()), _another(args[0], None)]
    if origin is dict:
        return {**(current or {}), "x": _another(args[1], None) if args else 1}
    if annotation is typing.Any:
        return "x"
    raise AssertionError(f"no other value for {annotation}")


COMPARED = sorted(set(JobSettings.model_fields) - RESUME_MAY_CHANGE)


@pytest.mark.parametrize("name", COMPARED)
def test_a_resume_refuses_any_setting_that_differs_naming_both(name: str) -> None:
    stored = JobSettings(command="eval", models=["m"])
    value = _another(JobSettings.model_fields[name].annotation, getattr(stored, name))
    with pytest.raises(ResumeConflictError) as caught:
        stored.resumed({name: value})
    assert caught.value.name == name
    assert caught.value.stored == stored.to_dict()[name] != caught.value.given
    assert stored.resumed({name: getattr(stored, name)}) == stored  # the stored value given again: accepted


@pytest.mark.parametrize("name", sorted(RESUME_MAY_CHANGE))
def test_a_resume_takes_where_the_server_is_and_how_many_at_once_anew(name: str) -> None:
    stored = JobSettings(command="eval", models=["m"], serve_cmd="vllm serve {model}")
    value = _another(JobSettings.model_fields[name].annotation, getattr(stored, name))
    assert getattr(stored.resumed({name: value}), name) == value


def test_only_the_server_s_place_the_concurrency_and_the_job_bound_may_change_on_a_resume() -> None:
    assert RESUME_MAY_CHANGE == {"base_url", "serve_cmd", "api_key_name", "n_concurrent", "job_disk_limit_mb", "force_build", "delete", "env_file"}


@pytest.mark.parametrize(
    "build",
    [
        lambda: JobSettings(n_attempt=2),  # a typo
        lambda: JobSettings(sampling={"temprature": 0.5}),
        lambda: JobSettings.from_kwargs(no_such_setting=1),
        lambda: JobSettings().resumed({"no_such_setting": 1}),
        lambda: JobSettings.from_dict({**JobSettings().to_dict(), "no_such_setting": 1}),
        lambda: EngineOptions(max_live=3),
    ],
)
def test_an_unknown_name_is_refused_as_a_type_never_ignored(build) -> None:
    with pytest.raises(UnknownSettingError) as caught:
        build()
    assert isinstance(caught.value, TypeError)  # as Python answers an unexpected keyword argument


@pytest.mark.parametrize(
    "model, values, name",
    [
        (JobSettings, {"n_attempts": "2"}, "n_attempts"),
        (JobSettings, {"n_attempts": 0}, "n_attempts"),
        (JobSettings, {"n_concurrent": True}, "n_concurrent"),
        (JobSettings, {"environment_kwargs": ["a=1"]}, "environment_kwargs"),
        (JobSettings, {"command": "train"}, "command"),
        (JobSettings, {"sampling": {"temperature": "hot"}}, "sampling.temperature"),
        (JobSettings, {"limits": {"max_turns": 0}}, "limits.max_turns"),
        (JobSettings, {"slot_timeout": 0}, "slot_timeout"),
        (JobSettings, {"start_attempts": 1.5}, "start_attempts"),
        (JobSettings, {"start_retry_wait": -1}, "start_retry_wait"),
        (EngineOptions, {"start_attempts": True}, "start_attempts"),
        (EngineOptions, {"max_live_sandboxes": 0}, "max_live_sandboxes"),
        (EngineOptions, {"max_failure_share": 2}, "max_failure_share"),
        (EngineOptions, {"budget": "redis"}, "budget"),
    ],
)
def test_a_value_of_the_wrong_type_or_range_is_refused_naming_the_setting(model, values, name) -> None:
    with pytest.raises(SettingError) as caught:
        model(**values)
    assert caught.value.name == name


def test_each_knob_s_default_is_the_engine_s_own() -> None:
    for model in (JobSettings, EngineOptions):
        assert model().timeouts() == Timeouts() and model().retry() == RetryPolicy() and model().engine_limits() == Limits()
        for name, (part, attr) in model.engine_fields().items():
            engine_default = getattr(ENGINE_PARTS[part](), attr)
            assert model.model_fields[name].default == engine_default, name


@pytest.mark.parametrize("name", sorted(EngineSettings.model_fields))
def test_a_job_and_the_shim_build_the_same_engine_knobs_from_the_same_values(name: str) -> None:
    value = _another(EngineSettings.model_fields[name].annotation, EngineSettings.model_fields[name].default)
    job, shim_options = JobSettings(**{name: value}), EngineOptions(**{name: value})
    assert job.engine_knobs() == shim_options.engine_knobs()
    if name not in ("budget", "ray_address", "cluster_max_live", "cluster_creates_per_second"):  # the cluster budget's
        assert job.engine_knobs() != EngineSettings().engine_knobs()  # the value reached the engine's arguments
    engine = job.engine_kwargs()
    assert {k: engine[k] for k in job.engine_knobs()} == job.engine_knobs()  # the job's Engine gets them unchanged


def test_the_stored_form_is_every_field_and_reads_back_whole() -> None:
    settings = JobSettings(
        command="eval", models=["a", "b"], sampling=Sampling(seed=3), limits={"max_turns": 4}, env_allow="HF_TOKEN",
        slot_timeout=None, start_retry_max_total=30.0, include="csv-*", environment_kwargs={"x": [1]},
    )  # fmt: skip
    stored = settings.to_dict()
    assert set(stored) == set(JobSettings.model_fields) and stored["version"] == SETTINGS_VERSION
    assert JobSettings.from_dict(stored) == settings
    assert settings.env_allow == ("HF_TOKEN",) and settings.include == ["csv-*"] and settings.limits == AgentLimits(max_turns=4)


def test_an_earlier_name_warns_where_a_user_passes_it() -> None:
    with pytest.warns(DeprecationWarning, match="use n_attempts="):
        assert JobSettings.from_kwargs(attempts=3).n_attempts == 3
    with pytest.warns(DeprecationWarning, match="use environment_type="):
        assert JobSettings(environment_type="docker").resumed({"backend": "docker"}).environment_type == "docker"


def test_settings_stored_by_earlier_releases_still_load() -> None:
    # Version 1 (eval's EvalSettings, no version): the earlier names, the cluster caps under their old flags.
    first = JobSettings.from_dict({
        "models": ["m"], "backend": "simulated", "attempts": 2, "concurrency": 3, "num_tasks": 1,
        "backend_kwargs": {"a": 1}, "max_live": 4, "creates_per_second": 2.0, "sampling": {"seed": 1},
        "limits": {"max_turns": 5}, "episode_timeout": None, "command": "eval",
    })  # fmt: skip
    assert (first.environment_type, first.n_attempts, first.n_concurrent, first.n_tasks) == ("simulated", 2, 3, 1)
    assert (first.cluster_max_live, first.cluster_creates_per_second, first.environment_kwargs) == (4, 2.0, {"a": 1})
    assert first.sampling == Sampling(seed=1) and first.limits.max_turns == 5 and first.version == SETTINGS_VERSION
    # Version 2: the cluster's cap stored under the shim's name; run stored no -n; a key since removed.
    second = JobSettings.from_dict({"version": 2, "command": "run", "max_live_sandboxes": 6, "concurrency": 2, "gone": 1})
    assert second.cluster_max_live == 6 and second.n_concurrent == 8
    # Version 3: a start_timeout of None (and a multiplier of None) meant the engine's default.
    third = JobSettings.from_dict({"version": 3, "start_timeout": None, "timeout_multiplier": None, "slot_timeout": None})
    assert third.timeouts().start == Timeouts().start and third.timeout_multiplier == 1.0
    assert third.slot_timeout is None  # None was already "no limit" for the slot wait
    # run's config.json: the settings nested, the multipliers in a table.
    legacy = JobSettings.from_dict({
        "command": "run", "created_at": "2026-11-30T10:00:00+00:00", "episodes": [{"task": "t", "attempt": 0}],
        "settings": {"source": "/suite", "env": "simulated", "agent": "oracle", "n_attempts": 1, "ek": {},
                     "multipliers": {"all": None, "agent": 2.0, "verifier": None, "environment_build": None},
                     "episode_timeout": None, "start_timeout": None, "dataset": None},
    })  # fmt: skip
    assert (legacy.suite, legacy.environment_type, legacy.agent_timeout_multiplier) == ("/suite", "simulated", 2.0)
    assert legacy.timeout_multiplier == 1.0 and legacy.start_timeout == Timeouts().start and legacy.episodes[0]["task"] == "t"


def test_engine_options_are_frozen_hashable_and_equal_by_value() -> None:
    import pickle
    from pathlib import Path

    options = EngineOptions(env_allow=["A"], job_dir=Path("/tmp/j"))
    again = pickle.loads(pickle.dumps(options))
    assert {options: 1}[again] == 1 and again.job_dir == "/tmp/j" and again.env_allow == ("A",)
    with pytest.raises(ValidationError):  # frozen: the engine these options key never changes under an env
        options.exec_timeout = 1.0  # type: ignore[misc]
    assert options.as_dict()["env_allow"] == ("A",) and EngineOptions(**options.as_dict()) == options
