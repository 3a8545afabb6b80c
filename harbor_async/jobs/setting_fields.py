"""The one settings model's parts: a checked pydantic base, the engine's knobs, the model loop's options.

A job's :class:`~harbor_async.jobs.settings.JobSettings` (``run``, ``eval``,
``evaluate(...)``) and the shim's :class:`~shim.options.EngineOptions` are both
an :class:`EngineSettings`: each engine knob is declared once, here, with the
engine's own default (read off :class:`~harbor_async.core.policy.Timeouts`,
:class:`~harbor_async.core.policy.RetryPolicy`, :class:`~harbor_async.core.policy.Limits`,
never copied), and both build the engine's classes with the same
:meth:`EngineSettings.engine_knobs`, so the two cannot disagree.

Values are checked once, when a model is built: types (strictly: ``"3"`` or
``True`` is no count) and ranges by pydantic, the engine's own limits by the
engine's classes. A bad value raises :class:`~harbor_async.core.errors.SettingError`
naming the setting; a name that is no setting,
:class:`~harbor_async.core.errors.UnknownSettingError`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from harbor_async.core.errors import SettingError, UnknownSettingError
from harbor_async.core.policy import Limits, RetryPolicy, Timeouts

#: The engine's classes a knob sets, by the name its marker gives them.
ENGINE_PARTS: dict[str, type[Limits | Timeouts | RetryPolicy]] = {
    "limits": Limits,
    "timeouts": Timeouts,
    "retry": RetryPolicy,
}
#: The key of a field's ``json_schema_extra`` naming the engine setting it sets (``"timeouts.slot"``).
ENGINE_MARK = "engine"
#: The key of a field's ``json_schema_extra`` saying a resume may give it anew (the results do not depend on it).
RESUME_MARK = "resume_may_change"


def knob(part: Literal["limits", "timeouts", "retry"], name: str, **field: Any) -> Any:
    """A field that sets the engine's ``part.name``, with that class's default (declared there, once)."""
    default = {f.name: f.default for f in dataclasses.fields(ENGINE_PARTS[part])}[name]
    return Field(default, json_schema_extra={ENGINE_MARK: f"{part}.{name}"}, **field)


def may_change_on_resume(default: Any = None, **field: Any) -> Any:
    """A field a resume may set anew (where the model server is now, how many episodes run at once)."""
    return Field(default, json_schema_extra={RESUME_MARK: True}, **field)


def marked_fields(model: type[BaseModel], key: str) -> dict[str, Any]:
    """The fields of ``model`` whose ``json_schema_extra`` has ``key``, with its value."""
    found = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if key in extra:
            found[name] = extra[key]
    return found


def setting_error(exc: ValidationError, model: type[BaseModel]) -> SettingError | UnknownSettingError:
    """pydantic's first complaint as this project's typed error, named as the setting (``sampling.seed``)."""
    error = exc.errors(include_url=False)[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, SettingError):  # raised by a validator of ours, or a nested model's: named within it
        name = ".".join([*map(str, error["loc"]), cause.name])
        return SettingError(name, cause.value, cause.requirement)
    if error["type"] == "extra_forbidden":
        loc = error["loc"]
        return UnknownSettingError(".".join(map(str, loc)), sorted(model.model_fields) if len(loc) == 1 else ())
    names: list[str] = []
    owner: type[BaseModel] | None = model
    for part in error["loc"]:  # field names, down into nested models; a union's branch tag ("list[str]") ends it
        if owner is None or part not in owner.model_fields:
            break
        names.append(str(part))
        annotation = owner.model_fields[part].annotation
        owner = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    name = ".".join(names) or "settings"
    requirement = error["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
    return SettingError(name, error.get("input"), requirement)


class SettingsModel(BaseModel):
    """A settings model: every name known (a typo is refused), every value of its type, checked once when built.

    Errors are this project's types (:func:`setting_error`), not pydantic's.
    """

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise setting_error(exc, type(self)) from None


class Sampling(SettingsModel):
    """Sampling options of every chat completion (``None``: the server's default)."""

    model_config = ConfigDict(frozen=True)

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: PositiveInt | None = None
    seed: int | None = None

    def request_kwargs(self) -> dict[str, Any]:
        """The options set, as ``chat.completions.create`` keywords."""
        return self.model_dump(exclude_none=True)


class AgentLimits(SettingsModel):
    """When an evaluation episode's loop ends besides a reply without tool calls.

    ``max_total_tokens`` bounds the conversation's length as the server
    counts it (prompt + completion tokens of the latest reply), the budget
    TRL's ``max_completion_length`` and the model's context bound in training.
    ``timeout`` is the agent's wall-clock budget (the task's ``[agent]
    timeout_sec`` when not set). ``retries`` (of a failed model request) and
    ``retry_max_wait`` (the longest wait between them) are the loop's own.
    """

    model_config = ConfigDict(frozen=True)

    max_turns: PositiveInt = 50
    max_total_tokens: PositiveInt | None = None
    timeout: PositiveFloat | None = None
    retries: NonNegativeInt = 5
    retry_max_wait: PositiveFloat = 30.0


class EngineSettings(SettingsModel):
    """The engine knobs a job and the shim's options share (see the module's docstring).

    A field marked with :func:`knob` sets one attribute of one of the engine's
    classes; a subclass adds its own marked fields and :meth:`engine_part`
    builds each class from every marked field, whichever model declares it.
    """

    start_timeout: float | None = knob("timeouts", "start")
    slot_timeout: float | None = knob("timeouts", "slot")
    episode_timeout: float | None = knob("timeouts", "episode")
    start_attempts: int = knob("retry", "attempts")
    start_retry_wait: float = knob("retry", "initial_wait")
    start_retry_max_wait: float = knob("retry", "max_wait")
    start_retry_max_total: float | None = knob("retry", "max_total")
    timeout_multiplier: float = knob("timeouts", "timeout_multiplier")
    agent_timeout_multiplier: float | None = knob("timeouts", "agent_timeout_multiplier")
    verifier_timeout_multiplier: float | None = knob("timeouts", "verifier_timeout_multiplier")
    environment_build_timeout_multiplier: float | None = knob("timeouts", "environment_build_timeout_multiplier")
    adaptive_starts: bool = knob("limits", "adaptive_starts")
    budget: Literal["local", "ray"] = "local"
    ray_address: str | None = None
    cluster_max_live: int | None = Field(None, gt=0)
    cluster_creates_per_second: float | None = Field(None, gt=0)
    # A tuple: the shim's option sets are hashable (they key the shared engines).
    env_allow: tuple[str, ...] = Field((), strict=False)
    strict_verify: bool = True
    resource_telemetry: bool = True

    @field_validator("env_allow", mode="before")
    @classmethod
    def one_name_is_a_list_of_one(cls, value: Any) -> Any:
        """``env_allow="HF_TOKEN"`` is that one name, not its letters."""
        return (value,) if isinstance(value, str) else value

    @classmethod
    def engine_fields(cls) -> dict[str, tuple[str, str]]:
        """Each knob's field name -> (the engine's class, by :data:`ENGINE_PARTS` key; its attribute)."""
        return {name: tuple(mark.split(".", 1)) for name, mark in marked_fields(cls, ENGINE_MARK).items()}  # type: ignore[misc]

    def engine_part(self, part: str) -> Any:
        """The engine's ``part`` class (:data:`ENGINE_PARTS`) built from this model's knobs (the class checks them)."""
        values = {attr: getattr(self, name) for name, (owner, attr) in self.engine_fields().items() if owner == part}
        return ENGINE_PARTS[part](**values)

    @model_validator(mode="after")
    def engine_classes_accept_the_knobs(self) -> Self:
        """The engine's own classes check their values (declared there once), named as this model's field."""
        for part in ENGINE_PARTS:
            try:
                self.engine_part(part)
            except SettingError as exc:
                field = next((n for n, mark in self.engine_fields().items() if mark == (part, exc.name)), exc.name)
                raise SettingError(field, exc.value, exc.requirement) from None
        return self

    def engine_limits(self) -> Limits:
        """The engine's :class:`~harbor_async.core.policy.Limits` (not ``limits``: a job's are its model loop's)."""
        return self.engine_part("limits")

    def timeouts(self) -> Timeouts:
        """The engine's :class:`~harbor_async.core.policy.Timeouts` (each task's own are applied per sandbox)."""
        return self.engine_part("timeouts")

    def retry(self) -> RetryPolicy:
        """The engine's :class:`~harbor_async.core.policy.RetryPolicy` of sandbox starts."""
        return self.engine_part("retry")

    def engine_knobs(self) -> dict[str, Any]:
        """The :class:`~harbor_async.engine.engine.Engine` arguments these settings decide: the one builder of them.

        ``JobSettings.engine_kwargs`` and ``EngineOptions.engine_kwargs`` add only
        what is theirs (the job folder and backend options; the cluster batch).
        """
        return {
            "limits": self.engine_limits(),
            "timeouts": self.timeouts(),
            "retry": self.retry(),
            "env_allow": self.env_allow,
            "strict_verify": self.strict_verify,
            "resource_telemetry": self.resource_telemetry,
        }


def fspath(value: Any) -> Any:
    """A path given as a ``PathLike`` as its text (how it is stored and compared)."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value
