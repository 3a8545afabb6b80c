"""The episode record: one line of a job folder's ``episodes.jsonl``.

One format for ``run``, ``eval``, the shim's logs, the report and cluster runs.
A record is plain JSON; fields a producer does not know stay at their defaults
(``run`` has no model or transcript, say). See the README's "Job folders".
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from harbor_async.core.errors import FailureClass

#: Bumped when a field changes meaning; readers accept older versions they know.
RECORD_VERSION = 1


@dataclass
class PhaseSpan:
    """One phase of an episode: seconds from the episode's start to its start and end."""

    phase: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        """How long the phase took."""
        return self.end - self.start


@dataclass
class EpisodeRecord:
    """One episode's outcome.

    ``attempt`` is the index (0-based) of a repeated episode of the same task
    (``-k``); retries of a sandbox start are ``start_attempts``. ``task_path``
    is the task's folder relative to its suite's root (absolute for a task
    outside one). ``started_at``/``finished_at`` (UTC, milliseconds) and the
    ``phases`` (seconds from the start: ``start``, ``agent``, ``verify``,
    ``stop``) map onto Harbor's ``TrialResult`` and its ``TimingInfo``s
    (environment setup, agent execution, verifier). ``reward`` is
    ``None`` only when the model was not judged (``error_class`` is one that a
    resume reruns); a verifier or agent failure without a reward scores 0.
    """

    task: str
    task_path: str = ""
    attempt: int = 0
    agent: str = ""
    model: str | None = None
    checkpoint: str | None = None
    reward: float | None = None
    rewards: dict[str, float | int] = field(default_factory=dict)
    error_class: str | None = None
    error_phase: str | None = None
    error_type: str | None = None
    error: str | None = None
    sandbox: str | None = None
    start_attempts: int = 0
    start_window: int | None = None  # the adaptive start window when the last start attempt began (None: off)
    started_at: str | None = None
    finished_at: str | None = None
    phases: list[PhaseSpan] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    verifier_output: str | None = None
    transcript: list[dict[str, Any]] | None = None
    usage: dict[str, int | float] = field(default_factory=dict)  # token counts; a Harbor agent's cost_usd too
    finish_reason: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)  # a multi-step task's: name, reward, rewards, error
    trial: str | None = None  # the episode's Harbor trial folder in the job folder (harbor_async.jobs.harbor_layout)
    verification_disabled: bool = False  # harbor run's --disable-verification: the agent ran, nobody judged it
    #: ``--capture``: the agent's model calls through the capture proxy (``calls``, ``refused``, ``retokenize``, ``file``)
    capture: dict[str, Any] | None = None
    #: what the sandbox used and its billed seconds (harbor_async.core.usage); None: no sandbox was created
    resources: dict[str, Any] | None = None
    version: int = RECORD_VERSION

    @property
    def key(self) -> str:
        """What identifies the episode across a resume: model, task path, attempt."""
        return episode_key(self.task_path or self.task, self.attempt, self.model)

    @property
    def failure(self) -> FailureClass | None:
        """The failure class, if the episode failed."""
        return FailureClass(self.error_class) if self.error_class else None

    @property
    def rerun(self) -> bool:
        """Whether a resume runs this episode again."""
        failure = self.failure
        return failure is not None and failure.rerun

    @property
    def judged(self) -> bool:
        """Whether the episode scores (no failure, or the model's own); else it is left out of every score.

        An episode whose verification was disabled is not judged either (no reward, in no score), and not rerun.
        """
        failure = self.failure
        return not self.verification_disabled and (failure is None or failure.scored)

    @property
    def unjudged_as(self) -> str:
        """Why the episode is not judged, as summaries count it: its failure class, or ``verification_disabled``."""
        return self.error_class or ("verification_disabled" if self.verification_disabled else "unknown")

    @property
    def infrastructure_failure(self) -> bool:
        """Deprecated: ``not judged``. The name said "infrastructure", but an unjudged episode may also have
        been cancelled, met a failing model server or an invalid task (:attr:`unjudged_as` says which)."""
        warnings.warn(
            "EpisodeRecord.infrastructure_failure is `not record.judged` (it also covers cancelled, model-server "
            "and invalid episodes); read `judged` and `unjudged_as`. It goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return not self.judged

    @property
    def score(self) -> float:
        """The reward, with an unjudged or unrewarded episode as 0."""
        return float(self.reward) if self.reward is not None else 0.0

    def set_error(self, failure: FailureClass, exc: BaseException | str, phase: str | None = None) -> None:
        """Record a failure; the first one recorded is the one kept (right blame)."""
        if self.error_class is not None:
            return
        self.error_class = failure.value
        self.error_phase = phase if phase is not None else getattr(getattr(exc, "phase", None), "value", None)
        self.error_type = type(exc).__name__ if isinstance(exc, BaseException) else None
        self.error = str(exc)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeRecord:
        """Read a record written by :meth:`to_dict` (unknown keys are ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["phases"] = [PhaseSpan(**p) for p in values.get("phases") or []]
        return cls(**values)


def episode_key(task_path: str, attempt: int, model: str | None = None) -> str:
    """The identity of an episode in a job: ``model::task path::attempt``."""
    return f"{model or ''}::{task_path}::{attempt}"
