"""``HarborSpec``: one object that wires a Harbor task suite into a TRL trainer.

Drop-in for ``trl.experimental.harbor.HarborSpec``::

    from shim import HarborSpec   # was: from trl.experimental.harbor import HarborSpec

    spec = HarborSpec("org/suite", agent="bash", environment_type="docker", num_tasks=64)
    trainer = GRPOTrainer(
        model=...,
        args=GRPOConfig(...),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )
    trainer.train()
    spec.close()

``train_dataset`` has the same columns and values as TRL's for the same suite;
``environment_factory`` is a picklable ``functools.partial``; ``reward_funcs``
verifies a whole batch concurrently. Beyond TRL: engine options (limits,
timeouts, retries) as keyword arguments, this project's backends by short name
(``local``, ``simulated``) or any import path, the env-owned reward path for
AsyncGRPOTrainer (``env_reward=True``), and ``close()``.
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, Unpack

from harbor_async.agents.harbor import HarborAgentSpec, is_harbor_agent
from harbor_async.agents.task_checks import TRL, Driver, check_tasks
from harbor_async.backends import resolve_backend
from harbor_async.cli.machine_checks import require_supported
from harbor_async.harnesses import import_reference
from harbor_async.tasks.suite import load_suite
from shim import engines
from shim.agent_rollouts import TASK_FIELD, AgentRollouts, agent_reward
from shim.env import AGENTS, HarborEnv, _close_budget
from shim.episode import stop_episodes
from shim.options import EngineOptions, EngineOptionsKwargs, renamed_kwargs
from shim.preflight import preflight as run_preflight
from shim.rewards import _outcome_reward_func, with_env_reward
from shim.trl_harness import adapt_trl_harness, is_trl_harness

if TYPE_CHECKING:
    from datasets import Dataset

#: Envs made by each spec's factory, by the spec's token (weakly: the trainer owns them).
_SPEC_ENVS: dict[str, weakref.WeakSet[HarborEnv]] = {}

#: task.toml [metadata] keys folded into the dataset rows, by column name (TRL's choice).
_META_COLUMNS: dict[str, str] = {
    "gold_answer": "gold_answer",
    "reward_mode": "reward_mode_initial",
    "difficulty_level": "difficulty_level",
    "kaggle_dataset": "kaggle_dataset_name",
}


def _resolve_agent(agent: str | type) -> type:
    """Resolve ``agent=`` to a harness class, with TRL's rules and errors.

    Accepts a ``HarborEnv`` subclass, a built-in name (``"bash"``), a module
    import path (``"pkg.module:Class"``) or a file path (``"path/to/file.py:Class"``).
    The class is the shim's ``HarborEnv`` subclass or, unchanged, a subclass of
    TRL's ``trl.experimental.harbor.HarborEnv`` (run on the engine through
    :func:`~shim.trl_harness.adapt_trl_harness`, applied by :func:`_env_class`).
    """
    if isinstance(agent, type):
        cls = agent
    elif agent in AGENTS:
        cls = AGENTS[agent]
    elif ":" in agent:
        cls = import_reference(agent)
    else:
        raise ValueError(
            f"Unknown agent {agent!r}; use a built-in name ({sorted(AGENTS)}), an import path "
            "'pkg.module:Class', a file path 'path/to/file.py:Class', or a HarborEnv subclass."
        )
    if is_trl_harness(cls):
        return cls
    if not (isinstance(cls, type) and issubclass(cls, HarborEnv)):
        raise TypeError(f"agent {agent!r} must resolve to a HarborEnv subclass, got {cls!r}")  # TRL's text
    return cls


def _agent_reference(agent: str | type, cls: type) -> str | type:
    """What the environment factory holds: the class, or for a harness file its absolute ``path:Class``.

    A class loaded from a file is not importable by name, so it does not pickle;
    the path does, and the factory resolves it (once per process) where it runs.
    """
    if isinstance(agent, str) and ":" in agent and agent not in AGENTS:
        target, _, cls_name = agent.rpartition(":")
        if target.endswith(".py") or os.path.sep in target:
            return f"{Path(target).absolute()}:{cls_name}"
    return cls


def _harbor_agent(agent: str | type, model_name: str | None, agent_kwargs: Mapping[str, Any] | None) -> HarborAgentSpec | None:
    """The Harbor agent ``agent`` names (``"terminus-2"``, ``"module:Class"`` of a Harbor agent), or ``None`` for a harness.

    Raises:
        ValueError: ``model_name`` or ``agent_kwargs`` given with a harness (they are a Harbor agent's ``-m``/``--ak``).
    """
    if isinstance(agent, str) and agent not in AGENTS and is_harbor_agent(agent):
        return HarborAgentSpec(agent, model_name, dict(agent_kwargs or {}))
    if model_name is not None or agent_kwargs:
        raise ValueError(f"model_name and agent_kwargs are a Harbor agent's options; agent {agent!r} is a harness")
    return None


def _instruction(task: Any) -> str:
    """The task's instruction (Harbor's, canary lines stripped); empty for a multi-step task (one per step)."""
    return str(task.instruction or "")


def _env_class(cls: type) -> type[HarborEnv]:
    """The shim env class for a resolved harness: itself, or a TRL harness rebased on the shim."""
    return adapt_trl_harness(cls) if is_trl_harness(cls) else cls


def _make_env(
    cls: type | str,
    environment_type: str,
    options: EngineOptions,
    backend_kwargs: Mapping[str, Any],
    env_reward: bool,
    token: str | None = None,
) -> HarborEnv:
    """The environment factory's body (module level, so the partial pickles).

    ``cls`` is the harness as resolved, or the ``path:Class`` of a harness file
    (see :func:`_agent_reference`). A TRL harness is adapted here, so that the
    partial holds the importable class, not the adapted one.
    """
    cls = _env_class(_resolve_agent(cls) if isinstance(cls, str) else cls)
    env_cls = with_env_reward(cls) if env_reward else cls  # type: ignore[arg-type]  # a class is hashable (mypy's check of type[...] against Hashable fails)
    env = env_cls(environment_type=environment_type)
    env._configure(options, backend_kwargs)
    if token is not None:
        _SPEC_ENVS.setdefault(token, weakref.WeakSet()).add(env)
    return env


class HarborSpec:
    """Single spec object that wires a Harbor task suite into a TRL trainer.

    Args:
        dataset: a Hugging Face dataset repo id holding a Harbor task tree
            (``"org/name"`` as in TRL, or ``"hf:org/name[@revision]"``), a local
            folder holding ``tasks/<name>/task.toml`` (or ``<name>/task.toml``), a
            dataset of Harbor's registry (``"name@version"``, downloaded into
            Harbor's task cache), or a list of task folders (such as
            ``harbor_async.tasks.registry.resolve_dataset(...).source`` for another registry).
        agent: the harness, i.e. the tool surface: a built-in name (``"bash"``),
            ``"package.module:Class"``, ``"path/to/file.py:Class"`` or a
            :class:`~shim.env.HarborEnv` subclass. A harness written for TRL
            (a subclass of ``trl.experimental.harbor.HarborEnv``) runs unchanged
            on the engine (see :mod:`shim.trl_harness`). Unknown names raise
            ``ValueError``; anything that is not a ``HarborEnv`` subclass ``TypeError``.
            Or one of Harbor's own agents (``"terminus-2"``, a ``module:Class``
            of a Harbor agent): it then drives its own turns, through
            :attr:`rollout_func` (see :mod:`shim.agent_rollouts`).
        environment_type: the backend: a Harbor type (``"docker"``, ``"e2b"``,
            ...), ``"local"`` (bubblewrap), ``"simulated"``, or an import path
            ``"package.module:Class"``. Checked here: an unknown name or a
            class that does not load raises ``ValueError``.
        num_tasks: keep the first ``num_tasks`` tasks (sorted by folder name).
        indices: keep the tasks at these positions. Exclusive with ``num_tasks``
            (``ValueError``).
        include, exclude: keep only the tasks whose name matches an ``include``
            glob and no ``exclude`` glob (``harbor run``'s ``-i``/``-x``); then
            ``num_tasks`` counts the tasks kept. The same selection as ``run`` and ``eval``.
        include_metadata: fold ``task.toml`` metadata (``gold_answer``,
            ``reward_mode``, ``difficulty_level``, ``kaggle_dataset``) into the rows.
        env_reward: ``True`` makes the factory's envs own their reward through
            an async ``get_reward()`` and leaves ``reward_funcs`` empty (for
            AsyncGRPOTrainer, see :mod:`shim.rewards`). ``None`` (default):
            ``True`` only if the harness class defines ``get_reward`` itself.
        environment_kwargs: extra constructor arguments for every Harbor environment
            (Harbor's ``--ek``; ``backend_kwargs`` is the deprecated name).
        preflight: start and stop one sandbox of the backend here, on the first
            task, and raise :class:`~harbor_async.core.errors.PreflightError` if it
            cannot start (a missing extra, bubblewrap, credentials, image).
            ``False`` skips it.
        agent_kwargs: a Harbor agent's options (``harbor run --ak``), such as
            ``{"max_turns": 8}``; ``{"api_base": URL}`` with ``model_name``
            points it at a model server of its own instead of the trainer's model.
        model_name: a Harbor agent's model (``-m``, LiteLLM's ``provider/name``),
            with ``api_base``; without, the trainer's own model answers in-process.
        **engine_options: limits, timeouts and retries shared by the envs; see
            :class:`~shim.options.EngineOptions` (``max_live_sandboxes``,
            ``creates_per_second``, ``concurrent_execs``, ``start_timeout``,
            ``exec_timeout``, ``verify_timeout``, ``stop_timeout``,
            ``episode_timeout``, ``start_attempts``), rank awareness
            (``per_rank_limits``), the cluster budget (``budget="ray"``,
            ``ray_address``, ``cluster_max_live``, ``cluster_creates_per_second``)
            and ``job_dir`` (every rollout's record appended there, as ``run`` writes it).
    """

    def __init__(
        self,
        dataset: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        agent: str | type[HarborEnv] = "bash",
        environment_type: str = "docker",
        num_tasks: int | None = None,
        indices: list[int] | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        include_metadata: bool = True,
        env_reward: bool | None = None,
        environment_kwargs: Mapping[str, Any] | None = None,
        backend_kwargs: Mapping[str, Any] | None = None,
        preflight: bool = True,
        agent_kwargs: Mapping[str, Any] | None = None,
        model_name: str | None = None,
        **engine_options: Unpack[EngineOptionsKwargs],
    ) -> None:
        if num_tasks is not None and indices is not None:
            raise ValueError("Provide num_tasks or indices, not both.")
        self._harbor_agent = _harbor_agent(agent, model_name, agent_kwargs)
        self._dataset = dataset
        self._environment_type = environment_type
        self._num_tasks = num_tasks
        self._indices = indices
        self._globs = (include, exclude)  # load_suite reads a string as one glob
        self._include_metadata = include_metadata
        if self._harbor_agent is not None:  # Harbor's own agent: rollout_func, not environment_factory
            if env_reward:
                raise ValueError(f"agent {agent!r} is a Harbor agent: its reward comes with rollout_func, env_reward=True does not apply")
            agent = "bash"  # the harness attributes below stay defined; the agent path never builds an env
        agent_cls = _resolve_agent(agent)
        self._agent_ref = _agent_reference(agent, agent_cls)  # what the factory pickles
        self._env_cls = _env_class(agent_cls)
        owns_reward = callable(getattr(self._env_cls, "get_reward", None))
        if env_reward is False and owns_reward:
            raise ValueError(
                f"agent {self._env_cls.__name__} defines get_reward, which TRL always counts; with "
                "env_reward=False the reward would be counted twice (get_reward + reward_funcs)"
            )
        self._env_reward = self._harbor_agent is None and (owns_reward if env_reward is None else bool(env_reward))
        if self._env_reward:  # TRL reads get_reward from 1.8 on; before, it would be a tool the model sees
            require_supported("trl", "HarborSpec(env_reward=True)", "trl-env-reward")
        self._options = EngineOptions.from_kwargs(dict(engine_options))
        self._backend_kwargs = dict(renamed_kwargs(environment_kwargs, backend_kwargs) or {})
        backend = resolve_backend(environment_type)
        backend.check_options(self._backend_kwargs)  # fail here, not mid-training
        self._selection  # noqa: B018 - the suite is read (and its ${VAR}s checked) here, not mid-training
        self._token = uuid.uuid4().hex
        if preflight and self._selection:
            run_preflight(self._selection[0][1], backend, self._options, self._backend_kwargs)

    # ── public surface ───────────────────────────────────────────────────

    @cached_property
    def _selection(self) -> list[tuple[int, Path]]:
        """(task_index, task folder) per row: TRL's selection, validated by Harbor.

        A folder that is not a valid Harbor task is left out with a warning
        (TRL would keep it and fail at its ``reset``); ``task_index`` stays its
        position in the suite. Task folders are absolute.
        """
        include, exclude = self._globs
        suite = load_suite(self._dataset, num_tasks=self._num_tasks, indices=self._indices, include=include, exclude=exclude)
        # refused now, not at a reset mid-training: a ${VAR} not allowed, a feature TRL's loop cannot honour
        driver = TRL if self._harbor_agent is None else Driver("TRL's rollout_func", agent=self._harbor_agent.agent_class)
        check_tasks(
            suite.tasks, resolve_backend(self._environment_type), driver=driver, env_allow=self._options.env_allow,
            backend_kwargs=self._backend_kwargs, allow_flag="env_allow=[NAME]",
        )  # fmt: skip
        self._metadata = [dict(task.config.metadata) for task in suite.tasks]
        self._tasks = {str(task.task_dir): task for task in suite.tasks}
        return list(zip(suite.positions, (task.task_dir for task in suite.tasks), strict=True))

    @cached_property
    def train_dataset(self) -> Dataset:
        """A ``datasets.Dataset`` of tasks. Plugs into TRL's ``train_dataset=``.

        Columns: ``prompt`` (an empty user message; TRL appends the env's
        instruction from ``reset``), ``task_dir`` (passed to ``reset``),
        ``task_index`` (position in the sorted suite, matching ``indices``),
        and the task metadata when ``include_metadata``. With a Harbor agent
        the prompt is the task's instruction, its message naming the task
        folder (``harbor_task``): ``rollout_func`` receives only the prompts.
        """
        from datasets import (
            Dataset,  # imported here: heavy, and only the trainer needs it
        )

        selection = self._selection
        if self._harbor_agent is None:
            prompts = [[{"role": "user", "content": ""}] for _ in selection]
        else:
            prompts = [[{"role": "user", "content": _instruction(self._tasks[str(path)]), TASK_FIELD: str(path)}] for _, path in selection]
        rows: dict[str, list[Any]] = {
            "prompt": prompts,
            "task_dir": [str(path) for _, path in selection],
            "task_index": [index for index, _ in selection],
        }
        if self._include_metadata:  # the suite already parsed each task.toml
            for column, key in _META_COLUMNS.items():
                rows[column] = [meta.get(key) for meta in self._metadata]
        return Dataset.from_dict(rows)

    @cached_property
    def environment_factory(self) -> Callable[[], HarborEnv]:
        """Zero-argument callable returning a fresh env. Plugs into TRL's ``environment_factory=``.

        A ``functools.partial`` of a module-level function (not a closure), so
        it pickles: AsyncGRPOTrainer sends it to a spawned rollout process.

        Raises:
            ValueError: the spec's agent is a Harbor agent, which runs through :attr:`rollout_func` instead.
        """
        if self._harbor_agent is not None:
            raise ValueError(
                f"agent {self._harbor_agent.name!r} is a Harbor agent, which drives its own turns: pass "
                "rollout_func=spec.rollout_func to GRPOTrainer, not environment_factory"
            )
        return partial(
            _make_env,
            self._agent_ref,
            self._environment_type,
            self._options,
            self._backend_kwargs,
            self._env_reward,
            self._token,
        )

    @property
    def reward_funcs(self) -> Callable[..., list[float | None]] | list[Callable[..., list[float | None]]]:
        """The verifier's outcome reward. Plugs into TRL's ``reward_funcs=``.

        A single function that verifies the batch concurrently; an empty list
        (a new one each time: TRL appends to it) when the envs own their reward
        (``env_reward``), so that no reward is counted twice.
        """
        if self._harbor_agent is not None:
            return agent_reward
        if self._env_reward:
            return []
        return _outcome_reward_func

    @cached_property
    def rollout_func(self) -> AgentRollouts:
        """TRL's ``rollout_func`` for a Harbor agent (``agent="terminus-2"``): see :mod:`shim.agent_rollouts`.

        Raises:
            ValueError: the spec's agent is a harness (use ``environment_factory``).
        """
        if self._harbor_agent is None:
            raise ValueError("rollout_func runs a Harbor agent (agent='terminus-2', ...); a harness runs through environment_factory")
        rollouts = AgentRollouts(
            self._harbor_agent, self._tasks, resolve_backend(self._environment_type), self._backend_kwargs, self._options
        )
        rollouts.agent_spec().check_capture()  # an agent that cannot be captured is refused here, not mid-training
        return rollouts

    @property
    def session_factory(self) -> Callable[..., Any]:
        """For ``AsyncGRPOTrainer``'s harness worker: ``session_factory(sampling=...)`` is an OpenEnv ``ResourceSessionFactory``.

        Its sessions are this spec's Harbor agent episodes (see :mod:`shim.openenv_sessions`); a Harbor agent
        with a model server of its own only (the trainer's vLLM server).
        """
        from shim.openenv_sessions import session_factory

        return partial(session_factory, self.rollout_func)

    @property
    def env_reward(self) -> bool:
        """Whether the factory's envs own their reward (``get_reward``)."""
        return self._env_reward

    def close(self) -> None:
        """Stop every sandbox of every env this spec's factory made, and wait (idempotent).

        Bounded by the stop budget. The envs stay usable (a later ``reset``
        starts anew). Interpreter exit and SIGTERM stop all sandboxes anyway.
        """
        envs = list(_SPEC_ENVS.get(self._token, ()))
        episodes = [episode for env in envs for episode in env._detach_episodes()]
        if episodes and engines.loop_running():
            engines.call(stop_episodes, episodes, timeout=_close_budget(self._options))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
