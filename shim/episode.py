"""One rollout of one env: the core :class:`~harbor_async.episodes.episode.Episode`, driven one call at a time from TRL.

The shim adds no episode of its own. ``reset()`` builds a core episode on the
trainer thread and hands :func:`begin_rollout` to the loop thread without
waiting: the sandbox starts (or is claimed from the prefetcher) and the
harness prepares it in the background while the trainer generates. Tool
calls (:meth:`Episode.exec_text`) and the reward (:meth:`Episode.verify`)
wait on the loop for that start, never on the trainer thread's own clock.
Failures are values (an error message for a tool call; a reward of ``None``
when the infrastructure failed, so that the trainer leaves the rollout out
instead of scoring the model 0), so one bad sandbox never crashes a batch.

What is the trainer's alone lives here: the :class:`~shim.guard.RolloutGuard`
counts each rollout that holds its sandbox until its batch is scored, and the
starts that failed for infrastructure reasons; a scored rollout's sandbox is
stopped in the background at once.

Every function below except :func:`new_episode` and :func:`uncount` runs on the loop thread.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from harbor_async.core.errors import SandboxError
from harbor_async.core.logs import get_logger
from harbor_async.core.policy import is_infrastructure
from harbor_async.episodes.episode import Episode
from shim import prefetch

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.core.records import EpisodeRecord
    from harbor_async.engine.engine import Engine
    from shim.guard import RolloutGuard

log = get_logger("harbor_async.shim")

#: Each rollout's guard (its env's engine options' own), kept for as long as the rollout is.
_GUARDS: weakref.WeakKeyDictionary[Episode, RolloutGuard] = weakref.WeakKeyDictionary()

__all__ = ["begin_rollout", "new_episode", "retire", "settle", "stop_episodes", "uncount", "verify_episodes"]


def new_episode(
    task: Task,
    engine: Engine,
    backend: BackendSpec,
    backend_kwargs: dict[str, Any],
    guard: RolloutGuard,
    *,
    agent: str,
    on_done: Callable[[EpisodeRecord], None] | None,
) -> Episode:
    """The core episode of one ``reset()``, counted by ``guard`` (its starts, and while it awaits its reward)."""
    episode = Episode(
        engine, task, backend, backend_kwargs=backend_kwargs, agent=agent, on_done=on_done,
        on_started=functools.partial(_count_start, guard),
    )  # fmt: skip
    _GUARDS[episode] = guard
    return episode


def _count_start(guard: RolloutGuard, error: SandboxError | None) -> None:
    # A start the sandbox's own task made fail (a bad image, say) is not the infrastructure's.
    if error is None or is_infrastructure(error):
        guard.record_start(error)


async def begin_rollout(
    episode: Episode,
    previous: Episode | None,
    prepare: Callable[[Episode], Awaitable[None]],
) -> None:
    """Retire the previous rollout, then begin ``episode`` on a sandbox started ahead if one is parked.

    Submitted by ``reset()``; never raises. An unusable sandbox gives its slot
    back now, not at the reward.
    """
    if previous is not None:
        retire(previous)
    # The claim runs before begin()'s first await: prefetch.release() relies on every reset handed to the loop
    # before it having claimed by then.
    claim = functools.partial(prefetch.claim, episode.engine, episode.task, episode.backend, episode.backend_kwargs)
    if not await episode.begin(lambda: prepare(episode), claim=claim):
        episode.stop_soon()


def uncount(episode: Episode) -> None:
    """The rollout awaits no batch reward any more (scored or abandoned): its guard stops counting it."""
    guard = _GUARDS.get(episode)
    if guard is not None:
        guard.close_rollout(episode)


def retire(episode: Episode) -> None:
    """End a rollout left before its verdict (a new ``reset()``, a close, a collected env): it awaits no reward."""
    uncount(episode)
    episode.retire()


async def settle(episode: Episode) -> float | None:
    """The rollout's reward (:meth:`Episode.verify`: once, then cached); the sandbox is stopped in the background.

    Never raises. A verifier that gave no valid reward, or an agent that ran
    out of time, scores 0.0 (the model's episode); a start, setup or
    infrastructure failure gives ``None`` (no verdict: TRL leaves the rollout
    out of its group statistics).
    """
    if episode.verified:
        return episode.reward
    reward = await episode.verify()
    uncount(episode)
    if episode.reward_error is not None:
        record = episode.record
        log.warning(
            "no verdict for a rollout", task=record.task, failure=record.error_class, reward=reward, error=record.error
        )
    episode.stop_soon()
    return reward


async def verify_episodes(episodes: Sequence[Episode]) -> list[float | None]:
    """Settle every rollout concurrently (one loop call for a whole batch); rewards in order."""
    rewards: list[float | None] = [None] * len(episodes)

    async def one(index: int, episode: Episode) -> None:
        rewards[index] = await settle(episode)

    async with anyio.create_task_group() as tg:
        for index, episode in enumerate(episodes):
            tg.start_soon(one, index, episode)
    return rewards


async def stop_episodes(episodes: Sequence[Episode]) -> None:
    """Retire every rollout and wait until each sandbox is stopped (shielded, bounded by the stop budget)."""

    async def one(episode: Episode) -> None:
        retire(episode)
        await episode.stop()

    async with anyio.create_task_group() as tg:
        for episode in episodes:
            tg.start_soon(one, episode)


def retire_episodes(episodes: Sequence[Episode]) -> None:
    """Retire every rollout without waiting (for finalizers)."""
    for episode in episodes:
        retire(episode)
