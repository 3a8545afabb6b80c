"""What keeps a training run from stalling on itself or training on zeros.

One :class:`RolloutGuard` per engine-option set (shared, like the engine) counts

- the rollouts alive and not yet scored: with GRPOTrainer's batch reward, every
  rollout of a generation batch keeps its sandbox until the batch is verified,
  so a live-sandbox limit below that count can only wait on itself. The reset
  that would exceed it raises :class:`~harbor_async.core.errors.SandboxLimitError`
  at once, naming the option and what to set;
- infrastructure failures: too many starts failing in a row, or too large a
  share of one batch's rollouts failing for infrastructure reasons, trips the
  guard; the next ``reset`` or reward raises
  :class:`~harbor_async.core.errors.InfrastructureBudgetError` naming the cause,
  which stops the trainer instead of feeding it zeros.

Its lock guards counters only and is never held across a wait.
"""

from __future__ import annotations

import threading
import weakref

from harbor_async.core.errors import InfrastructureBudgetError, SandboxLimitError


class RolloutGuard:
    """Rollouts awaiting their reward, and the infrastructure failure budget.

    Args:
        live_limit: the engine's live-sandbox limit (``None``: unlimited).
        max_failure_share: the largest share of a batch's rollouts that may
            fail for infrastructure reasons (``None``: no limit).
        max_start_failures_in_a_row: starts that may fail one after another
            for infrastructure reasons (``None``: no limit).
    """

    def __init__(
        self,
        live_limit: int | None,
        max_failure_share: float | None,
        max_start_failures_in_a_row: int | None,
    ) -> None:
        self.live_limit = live_limit
        self.max_failure_share = max_failure_share
        self.max_start_failures_in_a_row = max_start_failures_in_a_row
        self._lock = threading.Lock()
        # Weakly: a rollout whose env was collected without a close awaits nothing.
        self._awaiting: weakref.WeakSet[object] = weakref.WeakSet()
        self._failures_in_a_row = 0
        self._tripped: InfrastructureBudgetError | None = None
        self.infrastructure_failures = 0

    # ── rollouts awaiting a batch reward ─────────────────────────────────

    def open_rollout(self, rollout: object) -> None:
        """Count ``rollout``, which will hold its sandbox until its batch is verified (once: idempotent).

        Raises:
            SandboxLimitError: the live-sandbox limit is below the rollouts
                alive at once (nothing is counted then).
        """
        with self._lock:
            if rollout in self._awaiting:
                return
            needed = len(self._awaiting) + 1
            if self.live_limit is not None and needed > self.live_limit:
                raise SandboxLimitError(
                    f"max_live_sandboxes={self.live_limit} is below the {needed} rollouts alive at once: "
                    "GRPOTrainer verifies a batch only after every rollout's last tool call, so a rollout past "
                    "the limit would wait for a slot that only its own batch can free. Set "
                    f"max_live_sandboxes >= {needed} (the generation batch size: per_device_train_batch_size x "
                    "steps_per_generation) or None; under a provider's sandbox cap, make the generation batch fit "
                    "the cap instead (see the README: training under a provider cap)"
                )
            self._awaiting.add(rollout)

    def close_rollout(self, rollout: object) -> None:
        """``rollout`` was scored or abandoned (idempotent, any thread)."""
        with self._lock:
            self._awaiting.discard(rollout)

    @property
    def awaiting(self) -> int:
        """Rollouts alive and not yet scored."""
        return len(self._awaiting)

    # ── the failure budget ───────────────────────────────────────────────

    def record_start(self, error: BaseException | None) -> None:
        """Count a start's outcome (``error``: an infrastructure failure, else ``None``)."""
        with self._lock:
            if error is None:
                self._failures_in_a_row = 0
                return
            self.infrastructure_failures += 1
            self._failures_in_a_row += 1
            limit = self.max_start_failures_in_a_row
            if limit is not None and self._failures_in_a_row >= limit and self._tripped is None:
                self._tripped = InfrastructureBudgetError(
                    f"{self._failures_in_a_row} sandbox starts failed in a row (limit: "
                    f"max_start_failures_in_a_row={limit}); the last one: {type(error).__name__}: {error}",
                    cause=error,
                )

    def record_batch(self, failed: int, total: int, last_error: BaseException | None) -> None:
        """Judge one reward batch: trip when its infrastructure failures exceed the share."""
        share = self.max_failure_share
        if not total or share is None or failed / total <= share:
            return
        with self._lock:
            if self._tripped is None:
                detail = f"; the last one: {type(last_error).__name__}: {last_error}" if last_error else ""
                self._tripped = InfrastructureBudgetError(
                    f"{failed} of {total} rollouts of a batch failed for infrastructure reasons (more than "
                    f"max_failure_share={share:g}){detail}",
                    cause=last_error,
                )

    def check(self) -> None:
        """Raise the tripping error, if the budget was exceeded."""
        if self._tripped is not None:
            raise self._tripped
