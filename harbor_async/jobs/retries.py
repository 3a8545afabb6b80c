"""``harbor run``'s trial retries (``-r/--max-retries``, ``--retry-include``, ``--retry-exclude``), on our failure table.

Harbor reruns a failed trial up to ``max_retries`` times when its exception
is included (every one, by default) and not excluded (by default its
timeouts of the agent and the verifier, a missing or unreadable reward, and
the model provider's refusals). Here the failure table decides first: only
an episode that was **not judged** (infrastructure, the model server, an
interruption's leftovers) is ever rerun; a judged one, the model's 0 or a
failed verification, is its outcome and is never rerun, so naming one in
``--retry-include`` is refused in one line. Names are matched against
Harbor's name of the outcome (:func:`harbor_async.jobs.harbor_layout.harbor_exception_type`),
our exception type and our failure class (``infrastructure``), so both
dialects work.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from harbor_async.core.errors import SettingError
from harbor_async.core.records import EpisodeRecord

#: Harbor's default ``exclude_exceptions`` (its ``RetryConfig``).
HARBOR_EXCLUDED = frozenset({
    "AgentTimeoutError", "VerifierTimeoutError", "RewardFileNotFoundError", "RewardFileEmptyError",
    "VerifierOutputParseError", "ApiUsageLimitError", "AgentSafetyRefusalError", "AgentAuthenticationError",
    "ModelNotFoundError", "UnsupportedModelParametersError",
})  # fmt: skip
#: Outcomes that are judged (scored), never rerun: Harbor's names of them and our classes.
JUDGED = frozenset({
    "AgentTimeoutError", "VerifierTimeoutError", "RewardFileNotFoundError", "RewardFileEmptyError",
    "VerifierOutputParseError", "AddTestsDirError", "VerifierFailure", "VerifierDiskLimitError",
    "AgentDiskLimitError", "FinalStepRewardError", "agent", "verifier",
})  # fmt: skip


@dataclass(frozen=True)
class EpisodeRetries:
    """Which failed episodes a run reruns at once, and how many times.

    Raises:
        SettingError: a negative count, or an included name that is a judged outcome.
    """

    max_retries: int = 0
    include: frozenset[str] | None = None
    exclude: frozenset[str] = field(default=HARBOR_EXCLUDED)

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise SettingError("max_retries", self.max_retries, "0 or more")
        judged = sorted((self.include or frozenset()) & JUDGED)
        if judged:
            raise SettingError(
                "retry_include", judged[0], "an outcome that is not judged: a failed verification or the agent's "
                "own failure is scored and never rerun (only infrastructure and model-server failures are)",
            )  # fmt: skip

    @classmethod
    def of(cls, max_retries: int, include: Collection[str] | None, exclude: Collection[str] | None) -> EpisodeRetries:
        """From the settings' values (``None`` exclude: Harbor's default)."""
        return cls(
            max_retries, frozenset(include) if include else None,
            frozenset(exclude) if exclude is not None else HARBOR_EXCLUDED,
        )  # fmt: skip

    def wants(self, record: EpisodeRecord) -> bool:
        """Whether ``record``'s episode is rerun: not judged, not excluded, included (every one by default)."""
        if not record.rerun:
            return False
        from harbor_async.jobs.harbor_layout import harbor_exception_type

        names = {harbor_exception_type(record), record.error_type, record.error_class} - {None}
        if names & self.exclude:
            return False
        return self.include is None or bool(names & self.include)
