"""A token bucket: ``rate`` tokens a second, at most ``burst`` held.

The one refill rule behind two create rates: the cluster's, which makes a
caller wait its turn (:meth:`TokenBucket.reserve`, in
:class:`harbor_async.cluster.budget_actor.BudgetActor`), and the simulated
provider's, which refuses a create past it as a provider's 429 does
(:meth:`TokenBucket.take`, in :class:`harbor_async.backends.simulated.Provider`).
The caller passes the time, so a simulation and a test can use their own clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBucket:
    """``tokens`` held now, refilled at ``rate`` a second up to ``burst``.

    Attributes:
        rate: tokens added a second.
        burst: the most held at once.
        tokens: held now (below 0: owed by callers :meth:`reserve` made wait).
        refilled: the time of the last refill (``None``: never; the first call takes ``tokens`` as they are).
    """

    rate: float
    burst: float
    tokens: float
    refilled: float | None = None

    def _refill(self, now: float) -> None:
        if self.refilled is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.refilled) * self.rate)
        self.refilled = now

    def take(self, now: float) -> bool:
        """Take one token at ``now`` if one is held; ``False`` (nothing taken) when none is."""
        self._refill(now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def reserve(self, now: float) -> float:
        """Take one token at ``now``, owing it if none is held: the seconds until it is there (0: at once)."""
        self._refill(now)
        self.tokens -= 1.0
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate
