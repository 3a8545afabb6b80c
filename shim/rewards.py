"""Rewards: the batched outcome reward for ``reward_funcs``, and the env-owned ``get_reward`` path.

Two ways for the verifier's reward to reach a TRL trainer, never both at once
(TRL sums every reward source, so both would count each reward twice):

- ``spec.reward_funcs`` (the default): :func:`_outcome_reward_func`. With
  ``GRPOTrainer`` it receives the batch's envs as ``environments=`` and verifies
  them all concurrently in one call to the loop thread.
- ``HarborSpec(..., env_reward=True)``: the factory builds envs with an async
  ``get_reward()`` (:func:`with_env_reward`) and ``spec.reward_funcs`` is empty.
  TRL calls ``get_reward`` once per finished rollout. Meant for
  ``AsyncGRPOTrainer``: in TRL 1.16 its rollout worker passes neither
  ``environments=`` nor ``environment_reward=`` to reward functions, so only
  this path can score Harbor rollouts there. (With ``GRPOTrainer`` it works
  too, but TRL awaits the envs' ``get_reward`` one after another, so the batch
  verifies serially; keep the default there.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shim import engines
from shim.env import HarborEnv
from shim.episode import verify_episodes

if TYPE_CHECKING:
    from harbor_async.episodes.episode import Episode


def _outcome_reward_func(
    environments: Sequence[Any] | None = None,
    environment_reward: Sequence[float | None] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    **_: Any,
) -> list[float | None]:
    """Default reward: the Harbor verifier's scalar per rollout (TRL's name, so metric keys match).

    ``GRPOTrainer`` passes the live envs as ``environments=``: every env not yet
    verified is verified concurrently, in one call to the loop thread, and each
    verified sandbox is stopped in the background. ``environment_reward=``
    (already captured rewards) is returned as floats, as TRL does. A rollout
    whose sandbox failed for infrastructure reasons reads ``None`` (TRL turns it
    into NaN and leaves it out of its group's mean and standard deviation); a
    verifier that gave no reward scores 0.0. With ``log_metric`` (GRPOTrainer
    passes it), the share of rollouts without a verdict is logged as
    ``harbor/failure_frequency``. When that share passes the engine options'
    ``max_failure_share`` this raises
    :class:`~harbor_async.core.errors.InfrastructureBudgetError`, which stops the trainer.
    """
    if environment_reward is not None:
        return [None if r is None else float(r) for r in environment_reward]
    if environments is None:
        raise ValueError(
            "the Harbor outcome reward needs the rollouts' environments (`environments=`, as GRPOTrainer "
            "passes them) or their rewards (`environment_reward=`); with AsyncGRPOTrainer, which passes "
            "neither, use HarborSpec(..., env_reward=True) so that each env reports its own reward"
        )
    rewards = verify_environments(environments)
    ours = [env for env in environments if isinstance(env, HarborEnv) and env._episode is not None]
    failed = [episode for env in ours if (episode := env._episode) is not None and episode.reward is None]
    if log_metric is not None and environments:
        log_metric("harbor/failure_frequency", len(failed) / len(environments))
    if ours:
        guard = engines.guard_for(ours[0]._options)
        guard.record_batch(len(failed), len(environments), failed[-1].reward_error if failed else None)
        guard.check()
    return rewards


def verify_environments(environments: Sequence[Any]) -> list[float | None]:
    """Every env's reward, in order; the shim's envs are verified together in one loop call.

    Envs of other kinds (a plain TRL env) are read through their ``reward``.
    """
    rewards: list[float | None] = [None] * len(environments)
    pending: list[tuple[int, Episode]] = []
    for index, env in enumerate(environments):
        if isinstance(env, HarborEnv):
            episode = env._episode
            if episode is None:
                rewards[index] = 0.0
            elif episode.verified:
                rewards[index] = episode.reward
            else:
                pending.append((index, episode))
        else:
            rewards[index] = None if env.reward is None else float(env.reward)
    if pending:
        values = engines.call(verify_episodes, [episode for _, episode in pending])
        for (index, _), value in zip(pending, values, strict=True):
            rewards[index] = value
    return rewards


class EnvOwnedReward:
    """Mixin giving a ``HarborEnv`` TRL's env-owned reward method, ``get_reward``."""

    async def get_reward(self: Any) -> float | None:
        """The verifier's reward for the finished rollout (verified once; the sandbox is then stopped).

        Async, so TRL awaits it on its own event loop without blocking that loop
        while the verifier runs on the shim's loop thread.
        """
        return await self._areward()


@functools.cache
def with_env_reward(cls: type[HarborEnv]) -> type[HarborEnv]:
    """``cls`` plus an async ``get_reward`` (one class per harness, so TRL's exact-type checks hold).

    The class keeps the harness's ``__name__``: TRL logs the env-owned reward as
    ``rewards/<class name>/mean``.
    """
    if callable(getattr(cls, "get_reward", None)):
        return cls
    return type(
        cls.__name__,
        (EnvOwnedReward, cls),
        {
            "__module__": cls.__module__,
            "__qualname__": f"{cls.__qualname__}[env_reward]",
            "__doc__": cls.__doc__,
        },
    )
