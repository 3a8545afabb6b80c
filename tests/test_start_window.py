"""The adaptive start window: AIMD on its own (an injected clock), in the engine against a simulated
provider's 429s (trio's mock clock: virtual time), and shared by the cluster budget's holders."""

from __future__ import annotations

import random

import anyio
import pytest
from trio.testing import MockClock

from harbor_async.backends.simulated import SimulatedEnvironment
from harbor_async.cluster.budget_actor import BudgetActor
from harbor_async.core.errors import (
    BackendQuotaError,
    BackendRateLimitError,
    Phase,
    StartError,
    is_throttle,
)
from harbor_async.core.policy import Limits, RetryPolicy
from harbor_async.engine.engine import Engine
from harbor_async.engine.start_window import StartOutcome, StartWindow

pytestmark = [pytest.mark.anyio, pytest.mark.uvloop_pass]


@pytest.fixture
def seeded_trio_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trio's scheduler in the order it takes under Hypothesis: a seeded shuffle of each batch of ready tasks.

    Unseeded, trio reverses half its batches at random, so tasks woken at the same virtual instant race in a
    new order each run and the run's virtual length varies with it (16.5 to 23.9 s here, the fixed window's
    22.2 s in between): the mock clock is exact only once the order is too.
    """
    import trio._core._run as trio_run

    monkeypatch.setattr(trio_run, "_r", random.Random(0))
    monkeypatch.setattr(trio_run, "_ALLOW_DETERMINISTIC_SCHEDULING", True)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _start(window: StartWindow, clock: Clock, seconds: float, outcome: StartOutcome = StartOutcome.OK) -> None:
    ticket = await window.acquire()
    clock.now += seconds
    window.release(ticket, outcome)


async def test_slow_start_doubles_the_window_per_round_up_to_the_ceiling():
    clock = Clock()
    window = StartWindow(10, initial=2, clock=clock)
    assert window.window == 2
    for _ in range(2):
        await _start(window, clock, 1.0)
    assert window.window == 4  # one more per success below the threshold
    for _ in range(20):
        await _start(window, clock, 1.0)
    assert window.window == 10  # the static limit is the ceiling


async def test_a_throttle_halves_the_window_once_per_burst_then_it_grows_by_one_per_window():
    clock = Clock()
    window = StartWindow(64, initial=8, clock=clock)
    tickets = [await window.acquire() for _ in range(8)]
    for ticket in tickets:  # a burst of 429s, all from starts sent before the first answer
        window.release(ticket, StartOutcome.THROTTLED)
    assert window.window == 4 and window.throttles == 8
    for _ in range(4):  # congestion avoidance: 1/window per success, about one per window's worth
        await _start(window, clock, 0.5)
    assert window.window == 4
    await _start(window, clock, 0.5)
    assert window.window == 5
    await _start(window, clock, 0.5, StartOutcome.THROTTLED)  # a new burst: halves again
    assert window.window == 2
    await _start(window, clock, 0.5, StartOutcome.FAILED)  # a 503 or a crash: no signal
    assert window.window == 2


async def test_a_quota_answer_halves_the_window_but_it_grows_back_by_one_per_success():
    """A quota counts live sandboxes, not creates a second: once stops free places, the window reopens at
    slow-start speed; after a rate limit it would grow by one per window's worth."""
    clock = Clock()
    window = StartWindow(64, initial=8, clock=clock)
    for _ in range(8):  # out of slow start's first round: 16
        await _start(window, clock, 0.5)
    assert window.window == 16
    await _start(window, clock, 0.5, StartOutcome.QUOTA)
    assert window.window == 8 and window.throttles == 1
    for _ in range(8):
        await _start(window, clock, 0.5)
    assert window.window == 16  # one per success: back where it was
    await _start(window, clock, 0.5, StartOutcome.THROTTLED)
    for _ in range(8):
        await _start(window, clock, 0.5)
    assert window.window == 8  # after a rate limit: one per window's worth (8 successes: +1, still 8.x)


async def test_a_block_of_slow_starts_is_a_latency_breach_but_one_slow_start_is_not():
    clock = Clock()
    window = StartWindow(None, initial=16, block=4, clock=clock)
    for _ in range(4):
        await _start(window, clock, 1.0)
    assert window.latency_target == 3.0
    before = window.window
    for seconds in (1.0, 1.0, 1.0, 30.0):  # the heavy tail every provider has
        await _start(window, clock, seconds)
    assert window.breaches == 0 and window.window == before + 4
    for _ in range(4):  # a queue building at the provider: the block's median past 3x the baseline
        await _start(window, clock, 4.0)
    assert window.breaches == 1 and window.window == (before + 7) // 2
    after = window.window
    for _ in range(8):  # a sandbox on this machine: slower as the machine is busier, no provider's queue
        window.release(await window.acquire(), StartOutcome.OK, 10.0, latency_signal=False)
    assert window.breaches == 1 and window.window > after


async def test_starts_past_the_window_wait_in_order_and_a_cancelled_wait_leaks_no_place():
    window = StartWindow(None, initial=1)
    first = await window.acquire()
    order: list[str] = []
    cancelled = anyio.CancelScope()

    async def wait(name: str) -> None:
        ticket = await window.acquire()
        order.append(name)
        window.release(ticket, StartOutcome.FAILED)

    async def given_up() -> None:
        with cancelled:
            await window.acquire()

    async with anyio.create_task_group() as tg:
        tg.start_soon(given_up)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(wait, "a")
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(wait, "b")
        await anyio.wait_all_tasks_blocked()
        cancelled.cancel()  # the first in line stops waiting
        await anyio.wait_all_tasks_blocked()
        assert order == [] and window.in_flight == 1
        window.release(first, StartOutcome.FAILED)
    assert order == ["a", "b"] and window.in_flight == 0


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
async def test_below_one_start_at_a_time_the_window_paces_starts_by_their_latency():
    """A provider slower than one create per start latency: the window halves below 1 and spaces the starts."""
    window = StartWindow(None, initial=1)
    ticket = await window.acquire()
    await anyio.sleep(1.0)
    window.release(ticket, StartOutcome.OK)  # the smoothed start latency: 1 s
    for _ in range(2):
        window.release(await window.acquire(), StartOutcome.THROTTLED)
    assert window.window == 1 and window.snapshot()["paced_rate"] == 0.5  # 0.5 of a window: a start per 2 s
    began = anyio.current_time()
    window.release(await window.acquire(), StartOutcome.FAILED)
    window.release(await window.acquire(), StartOutcome.FAILED)
    assert anyio.current_time() - began == pytest.approx(2.0)
    for _ in range(8):  # back to one at a time by 1/16 per success
        window.release(await window.acquire(), StartOutcome.OK, latency=1.0)
    assert window.snapshot()["paced_rate"] is None


def test_a_throttle_is_read_through_the_errors_it_was_raised_from():
    try:
        try:
            raise BackendRateLimitError("429", retry_after=2.0)
        except BackendRateLimitError as exc:
            raise StartError(Phase.START, "task", "sandbox", "start failed") from exc
    except StartError as outer:
        assert is_throttle(outer)
    assert is_throttle(BackendQuotaError("quota"))
    assert not is_throttle(RuntimeError("503"))


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
@pytest.mark.usefixtures("seeded_trio_schedule")
async def test_the_engine_halves_its_starts_on_a_providers_429s_and_says_so_in_its_figures(example_tasks, monkeypatch):
    """Virtual time: trio's MockClock jumps whenever every task waits, so the provider's rate and the
    sandboxes' latencies are exact and take no wall time."""
    import tenacity.wait
    provider = {"create_rate": 5.0, "start_latency": 0.5, "exec_latency": 2.0, "throttle_latency": 0.05}
    retry = RetryPolicy(attempts=3, initial_wait=0.5, max_wait=10.0)
    found = {}
    for adaptive in (False, True):
        SimulatedEnvironment.reset_observations()
        # The retries' jitter from a generator of its own: with trio's mock clock the whole run is then the same each
        # time (the process's shared one is drawn from by whatever else runs in it, a thread an earlier test left).
        monkeypatch.setattr(tenacity.wait, "random", random.Random(0))
        windows: list[int | None] = []
        judged = 0
        async with Engine(
            limits=Limits(live_sandboxes=32, adaptive_starts=adaptive), retry=retry, backend_kwargs=provider
        ) as engine:

            async def episode(index: int) -> None:
                nonlocal judged
                try:
                    async with engine.sandbox(example_tasks[index % len(example_tasks)], "simulated") as sandbox:
                        windows.append(sandbox.start_window)
                        await sandbox.exec("true")
                        result = await sandbox.verify()  # then count: `judged += await ...` reads judged first
                        judged += result.reward is not None
                except StartError:
                    pass

            began = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for index in range(64):
                    tg.start_soon(episode, index)
            seconds = anyio.current_time() - began
            stats = engine.stats()
        refused = SimulatedEnvironment.providers["simulated"].rate_limited
        assert stats.throttled == refused > 0  # every 429 the provider sent was counted as a throttle
        found[adaptive] = (judged, refused, stats, windows, seconds)
    judged, refused, stats, windows, seconds = found[False]
    assert stats.start_window is None and set(windows) == {None}  # --fixed-starts: no window
    adaptive_judged, adaptive_refused, adaptive_stats, adaptive_windows, adaptive_seconds = found[True]
    # The same episodes finish (a 429 is retried beside the start attempts), with far fewer 429s, sooner
    # (virtual seconds: the simulation's own, exact under the mock clock, the seeded jitter and the seeded schedule).
    assert adaptive_judged == judged == 64
    assert adaptive_seconds < seconds
    assert adaptive_refused * 2 < refused
    window = adaptive_stats.start_window
    assert window is not None and window["throttles"] == adaptive_refused and window["in_flight"] == 0
    assert min(w for w in adaptive_windows if w is not None) < 8  # the window closed below its first size


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_cluster_budget_keeps_one_window_for_every_holder_and_frees_a_dead_holders_places():
    actor = BudgetActor({"max_live": 2})
    assert (await actor.start_acquire("a", "a1"))["window"] == 2
    await actor.start_acquire("b", "b1")  # both places taken, by two processes
    replies: list[dict] = []

    async def wait() -> None:
        replies.append(await actor.start_acquire("b", "b2"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        assert replies == [] and actor.start_state()["in_flight"] == 2
        actor.unregister("a")  # a process that ends gives its place back: b's wait is answered
    assert replies and "window" in replies[0]
    assert actor.start_release("b1", StartOutcome.THROTTLED.value, 0.1)
    assert actor.start_state()["throttles"] == 1
    assert actor.start_cancel("b2") and actor.start_state()["in_flight"] == 0


def _refusal(status: int, body: str, headers: dict[str, str] | None = None) -> BaseException:
    """A real SDK's error for a real HTTP answer: OpenAI's Stainless client (the generator Runloop's SDK
    shares) over an httpx transport that answers ``status``."""
    import httpx
    import openai

    transport = httpx.MockTransport(lambda request: httpx.Response(status, text=body, headers=headers or {}))
    client = openai.OpenAI(
        api_key="k", base_url="http://provider.invalid/v1", max_retries=0, http_client=httpx.Client(transport=transport)
    )
    try:
        client.models.list()
    except openai.APIStatusError as exc:
        return exc
    raise AssertionError("the client accepted a refusal")


def test_a_cloud_sdks_429_and_quota_answers_are_typed_for_the_window():
    from harbor_async.backends import resolve_backend

    spec = resolve_backend("simulated")
    rate = spec.typed_error(_refusal(429, '{"error": "too many requests"}', {"retry-after": "2"}))
    assert isinstance(rate, BackendRateLimitError) and rate.retry_after == 2.0 and is_throttle(rate)
    quota = spec.typed_error(_refusal(429, '{"error": "concurrent sandbox limit reached"}'))
    assert isinstance(quota, BackendQuotaError) and quota.retry_after is None
    assert isinstance(spec.typed_error(_refusal(403, '{"error": "quota exceeded"}')), BackendQuotaError)
    denied = _refusal(403, '{"error": "bad key"}')
    assert spec.typed_error(denied) is denied  # a refusal for the caller, not the load: untouched
    import httpx

    request = httpx.Request("POST", "http://provider.invalid/sandboxes")
    raw = httpx.HTTPStatusError("429", request=request, response=httpx.Response(429, request=request))
    assert isinstance(spec.typed_error(raw), BackendRateLimitError)  # an SDK built on httpx's own raise_for_status


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
async def test_a_throttle_is_retried_beside_the_start_attempts_after_the_wait_it_asked_for():
    from harbor_async.backends.simulated import SimulatedTransientError

    calls: list[float] = []

    async def attempt() -> None:
        calls.append(anyio.current_time())
        if len(calls) <= 5:
            raise BackendRateLimitError("429", retry_after=3.0)
        raise SimulatedTransientError("503")  # a failed start: counted

    policy = RetryPolicy(attempts=2, initial_wait=0.01, max_wait=0.02, max_total=None)
    with pytest.raises(SimulatedTransientError):
        async for retry in policy.retrying():
            with retry:
                await attempt()
    assert len(calls) == 7  # five 429s, then the two attempts the policy allows
    assert all(later - earlier >= 3.0 for earlier, later in zip(calls[:5], calls[1:6]))  # Retry-After honoured


def test_the_simulated_providers_bursts_fail_every_start_for_their_length():
    from harbor_async.backends.simulated import Provider

    provider = Provider(None, None, None, burst_every=10.0, burst_seconds=2.0, rng=random.Random(3))
    answers = [provider.admit(step / 10) for step in range(3000)]  # 300 s, a start every 0.1 s
    runs, length = [], 0
    for answer in answers:
        if answer == "burst":
            length += 1
        elif length:
            runs.append(length)
            length = 0
    assert 10 <= len(runs) <= 50 and max(runs) <= 21  # bursts of at most 2 s, every 12 s or so on average
    assert provider.counts()["burst_failures"] == sum(runs) + length


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
async def test_a_providers_quota_answer_closes_the_window_and_the_start_waits_for_a_place(example_tasks):
    provider = {"quota": 2, "start_latency": 0.5, "exec_latency": 3.0, "throttle_latency": 0.05}
    random.seed(0)
    async with Engine(limits=Limits(live_sandboxes=4), retry=RetryPolicy(), backend_kwargs=provider) as engine:
        rewards: list[float | None] = []

        async def episode(index: int) -> None:
            async with engine.sandbox(example_tasks[index], "simulated") as sandbox:
                await sandbox.exec("true")
                result = await sandbox.verify()
                rewards.append(result.reward)

        async with anyio.create_task_group() as tg:
            for index in range(4):
                tg.start_soon(episode, index)
        stats = engine.stats()
    refused = SimulatedEnvironment.providers["simulated"].quota_refused
    assert rewards == [1.0] * 4  # the quota delayed two episodes, it lost none
    assert refused > 0 and stats.throttled == refused and stats.start_window["throttles"] == refused
    assert SimulatedEnvironment.peak_live <= 2
