"""What a sandbox's calls return: command output, the verifier's verdict, per-phase times."""

from __future__ import annotations

from dataclasses import dataclass, field

from harbor_async.core.errors import Phase

#: TRL's marker for cut output, kept so that prompts match TRL's env exactly.
TRUNCATION_MARKER = "\n... [truncated]"


@dataclass(frozen=True)
class ExecOutput:
    """The result of one command.

    ``output`` is stdout followed by stderr, cut to the engine's limit with a
    marker; ``stdout``/``stderr`` are the untruncated streams.
    """

    output: str
    stdout: str
    stderr: str
    exit_code: int
    truncated: bool
    seconds: float


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's verdict: the scalar reward, every key it wrote, and its output."""

    reward: float
    rewards: dict[str, float | int]
    seconds: float
    output: str | None = None


@dataclass
class PhaseTimes:
    """Seconds spent in each phase of one sandbox (summed over retries and calls)."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, phase: Phase, seconds: float) -> None:
        """Add ``seconds`` to ``phase``."""
        self.seconds[phase.value] = self.seconds.get(phase.value, 0.0) + seconds


def scalar_reward(rewards: dict[str, float | int]) -> float:
    """The scalar Harbor rewards reduce to: ``reward`` if present, else the first key."""
    if not rewards:
        return 0.0
    return float(rewards.get("reward", next(iter(rewards.values()))))


def truncate_output(text: str, limit: int | None, marker: str = TRUNCATION_MARKER) -> tuple[str, bool]:
    """Cut ``text`` to ``limit`` characters plus ``marker``; ``None`` keeps it whole."""
    if limit is None or len(text) <= limit:
        return text, False
    return text[:limit] + marker, True
