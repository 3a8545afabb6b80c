"""The token bucket behind the cluster's create rate (waits) and the simulated provider's (refuses), on a given clock."""

from __future__ import annotations

import pytest

from harbor_async.core.token_bucket import TokenBucket


def test_take_refuses_past_the_burst_and_refills_at_the_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0, tokens=3.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]  # the burst, then a refusal
    assert bucket.tokens == 0.0  # a refusal takes nothing
    assert not bucket.take(0.4)  # 0.8 tokens back
    assert bucket.take(0.5)  # 1.0
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]  # never more than the burst


def test_reserve_goes_into_debt_and_says_how_long_each_caller_waits() -> None:
    bucket = TokenBucket(rate=4.0, burst=4.0, tokens=1.0, refilled=0.0)
    assert bucket.reserve(0.0) == 0.0
    assert [bucket.reserve(0.0) for _ in range(3)] == pytest.approx([0.25, 0.5, 0.75])  # in turn, a quarter apart
    assert bucket.reserve(1.0) == 0.0  # the debt (3) is paid by 1 s at 4 a second, and one is left
    assert bucket.tokens == 0.0


def test_the_simulated_provider_refuses_creates_past_its_rate_as_a_429() -> None:
    import random

    from harbor_async.backends.simulated import Provider

    provider = Provider(create_rate=1.0, create_burst=2.0, quota=None, burst_every=None, burst_seconds=0.0,
                        rng=random.Random(0))  # fmt: skip
    assert [provider.admit(0.0) for _ in range(3)] == [None, None, "rate"]
    assert provider.admit(1.0) is None and provider.counts()["rate_limited"] == 1
