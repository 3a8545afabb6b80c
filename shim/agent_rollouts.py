"""``HarborSpec(suite, agent="terminus-2")``: Harbor's own agent acting in the episodes, as TRL's ``rollout_func``.

TRL drives no turn here. ``spec.rollout_func(prompts, trainer)`` runs one
episode per prompt on the engine (concurrently, with every limit, timeout,
retry and failure rule of ``run``: it is :func:`~harbor_async.episodes.runner.run_suite`)
with the Harbor agent calling its model through the engine's capture proxy,
one session per episode. Each episode's captured calls become one row
(:func:`~harbor_async.models.capture.rows.token_row`): the first call's prompt
ids, then the model's tokens and what the environment and the agent's
scaffolding added in between, with ``env_mask`` (TRL's mask of the model's
tokens: 1 trained on, 0 not) and the sampled tokens' logprobs.

The model: with no server of the agent's own (no ``api_base`` in
``agent_kwargs``), the trainer's current model answers in this process
(:class:`~shim.policy_server.PolicyTransport`): exact ids and logprobs,
on-policy, no vLLM. With one (``agent_kwargs={"api_base": URL}`` and
``model_name="hosted_vllm/NAME"``, a ``vllm serve``), calls go there; such a
server gets the trainer's new weights only if it is the one TRL syncs
(``use_vllm=True, vllm_mode="server"``), otherwise the rollouts are off-policy.

What the trainer gets for each episode:

- judged: its reward (``harbor_reward``, read by ``spec.reward_funcs``);
- not judged (the infrastructure, the model server, cancelled: host-side
  evidence only, :mod:`harbor_async.core.policy`): reward ``None`` (TRL: NaN,
  no advantage) and an all-zero ``env_mask``, so it leaves the loss;
- no model call at all: the chat prompt of the instruction and one ``eos``,
  masked (TRL cannot take an empty completion).

Rows are cut at ``max_completion_length`` (TRL does not cut them). The task
of each prompt travels in the prompt itself (the message's ``harbor_task``:
``rollout_func`` receives nothing else), so the agent path needs
``spec.train_dataset``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harbor_async.agents.harbor import HarborAgentSpec
from harbor_async.agents.harbor_episode import HarborAgentRunner
from harbor_async.core.errors import HarborAsyncError
from harbor_async.episodes.runner import PlannedEpisode, run_suite
from harbor_async.models.capture.rows import TokenRow, token_row
from shim import engines

if TYPE_CHECKING:
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.core.records import EpisodeRecord
    from harbor_async.models.capture import CaptureSession
    from shim.options import EngineOptions
    from shim.policy_server import PolicyTransport

#: The prompt message's field that names its task folder (the only thing ``rollout_func`` receives is the prompt).
TASK_FIELD = "harbor_task"
#: Where the agent is pointed when the trainer's own model answers: never resolved, the proxy answers in-process.
POLICY_BASE_URL = "http://trainer-policy.invalid/v1"
POLICY_MODEL = "hosted_vllm/policy"


class EpisodeNotJudgedError(HarborAsyncError):
    """An agent episode without a verdict, as its record tells it (the last one names the trainer's stop)."""


class PromptTaskError(HarborAsyncError, ValueError):
    """A prompt that names no task of the spec (not a row of ``spec.train_dataset``)."""


class TrainerToolsError(HarborAsyncError, ValueError):
    """``rollout_func=spec.rollout_func`` given to a trainer that also has ``tools=`` or ``environment_factory=``."""


def check_trainer(trainer: Any) -> None:
    """Refuse a trainer whose own tool loop would run beside the Harbor agent (raises :class:`TrainerToolsError`).

    With tools (an ``environment_factory``'s methods among them), GRPOTrainer runs its tool loop on what
    ``rollout_func`` returned and ignores ``env_mask``: the environment's tokens would be trained on.
    """
    factories = getattr(trainer, "environment_factories", None) or getattr(trainer, "environments", None)
    if getattr(trainer, "tools", None) or factories:
        raise TrainerToolsError(
            "rollout_func=spec.rollout_func runs the Harbor agent with its own tools: give GRPOTrainer neither "
            "tools= nor environment_factory= beside it (TRL would run its tool loop and train the environment's tokens)"
        )


def task_of(prompt: Any) -> str:
    """The task folder a prompt of the agent path's dataset names (raises :class:`PromptTaskError`)."""
    if isinstance(prompt, list):
        for message in prompt:
            if isinstance(message, Mapping) and message.get(TASK_FIELD):
                return str(message[TASK_FIELD])
    raise PromptTaskError(
        f"the prompt names no Harbor task (no {TASK_FIELD!r} in its messages): with a Harbor agent, "
        "train on spec.train_dataset, whose prompts carry their task"
    )


@dataclass
class Rollout:
    """One episode as the trainer got it (kept in :attr:`AgentRollouts.last` for metrics and checks)."""

    task: str
    record: EpisodeRecord | None
    session: CaptureSession | None
    row: TokenRow | None

    @property
    def reward(self) -> float | None:
        """The verifier's reward; ``None``: not judged (left out of the loss)."""
        if self.record is None or not self.record.judged:
            return None
        return 0.0 if self.record.reward is None else float(self.record.reward)


@dataclass
class AgentRollouts:
    """TRL's ``rollout_func`` over a Harbor agent (see the module docs); built by :class:`~shim.spec.HarborSpec`."""

    agent: HarborAgentSpec
    tasks: Mapping[str, Task]  # by task folder, as the dataset's prompts name them
    backend: BackendSpec
    backend_kwargs: Mapping[str, Any]
    options: EngineOptions
    last: list[Rollout] = field(default_factory=list)
    _policy: PolicyTransport | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def in_process(self) -> bool:
        """Whether the trainer's own model answers the agent (no ``model_name``: no server of the agent's own)."""
        return self.agent.model_name is None

    def agent_spec(self) -> HarborAgentSpec:
        """The agent as the episodes build it: pointed at the in-process policy when it has no server of its own."""
        if not self.in_process:
            return self.agent
        return HarborAgentSpec(self.agent.name, POLICY_MODEL, {**self.agent.kwargs, "api_base": POLICY_BASE_URL})

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        """One row per prompt, in order: ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask`` and the episode's fields."""
        with self._lock:  # one batch at a time: the policy's model is switched to eval mode for it
            if trainer is not None:
                check_trainer(trainer)
            tasks = [task_of(prompt) for prompt in prompts]
            unknown = sorted(set(tasks) - set(self.tasks))
            if unknown:
                raise PromptTaskError(f"prompts name tasks that are not in this spec: {unknown[:3]}")
            transport = self._policy_for(trainer) if self.in_process else None
            model = trainer.accelerator.unwrap_model(trainer.model) if transport is not None else None
            was_training = bool(model is not None and model.training)
            if model is not None:
                model.eval()  # no dropout while sampling: the rollouts' logprobs are the policy's
            try:
                self.last = self._run(tasks, transport)
            finally:
                if model is not None and was_training:
                    model.train()
            return self._outputs(prompts, trainer)

    def _policy_for(self, trainer: Any) -> PolicyTransport:
        from shim.policy_server import PolicyTransport, Sampling

        model = trainer.accelerator.unwrap_model(trainer.model)
        if self._policy is None or self._policy.model is not model:
            self._policy = PolicyTransport(model, trainer.processing_class, Sampling.of_trainer(trainer.args))
        self._policy.generations.clear()
        return self._policy

    def _run(self, tasks: list[str], transport: PolicyTransport | None) -> list[Rollout]:
        sessions: dict[str, CaptureSession] = {}
        factory = functools.partial(
            HarborAgentRunner, self.agent_spec(), capture=True, upstream_transport=transport,
            on_session=lambda session: sessions.__setitem__(session.name, session),
        )  # fmt: skip
        seen: dict[str, int] = {}
        planned = []
        for task in tasks:  # the repetitions of a task (num_generations) are its attempts 0, 1, ...
            planned.append(PlannedEpisode(self.tasks[task], attempt=seen.get(task, 0), task_path=task))
            seen[task] = seen.get(task, 0) + 1
        engine = engines.engine_for(self.options)
        run = functools.partial(
            run_suite, engine, planned, self.backend, agent=factory, concurrency=self.options.max_live_sandboxes or len(planned),
            on_done=engines.record_sink(self.options), model=self.agent_spec().model_name, backend_kwargs=self.backend_kwargs,
        )  # fmt: skip
        records: list[EpisodeRecord] = engines.call(run)
        by_key = {(r.task_path, r.attempt): r for r in records}  # a record per episode, cancelled ones too
        rollouts = []
        for task, episode in zip(tasks, planned, strict=True):
            record = by_key.get((task, episode.attempt))
            session = sessions.get(record.sandbox or "") if record is not None else None
            rollouts.append(Rollout(task, record, session, None))
        return rollouts

    def _outputs(self, prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        tokenizer = trainer.processing_class
        limit = getattr(trainer.args, "max_completion_length", None)
        eos = tokenizer.eos_token_id
        out: dict[str, list[Any]] = {key: [] for key in (
            "prompt_ids", "completion_ids", "logprobs", "env_mask", "harbor_reward", "harbor_calls",
            "harbor_dropped_calls", "harbor_retokenized", "harbor_truncated", "harbor_not_judged",
        )}  # fmt: skip
        failed: list[EpisodeRecord] = []
        for prompt, rollout in zip(prompts, self.last, strict=True):
            calls = [call.to_json() for call in rollout.session.calls] if rollout.session is not None else []
            rollout.row = token_row(calls, max_completion_length=limit, retokenize=functools.partial(retokenize, tokenizer))
            row, reward = rollout.row, rollout.reward
            if row is None or not row.completion_ids:  # no model call: TRL needs a completion, so one masked eos
                prompt_ids = row.prompt_ids if row is not None else _chat_ids(tokenizer, _plain_prompt(prompt))
                answered = sum(1 for call in calls if call.get("status") == 200)  # none of them could start a row
                row = TokenRow(prompt_ids, [eos], [0.0], [0], dropped=row.dropped if row is not None else answered)
            mask = row.env_mask if reward is not None else [0] * len(row.env_mask)  # not judged: out of the loss
            if reward is None and rollout.record is not None:
                failed.append(rollout.record)
            out["prompt_ids"].append(row.prompt_ids)
            out["completion_ids"].append(row.completion_ids)
            out["logprobs"].append(row.logprobs)
            out["env_mask"].append(mask)
            out["harbor_reward"].append(reward)
            out["harbor_calls"].append(row.calls)
            out["harbor_dropped_calls"].append(row.dropped)
            out["harbor_retokenized"].append(row.retokenized)
            out["harbor_truncated"].append(int(row.truncated))
            out["harbor_not_judged"].append(int(reward is None))
        guard = engines.guard_for(self.options)  # too many rollouts without a verdict stops the trainer, as for envs
        guard.record_batch(len(failed), len(self.last), _error_of(failed[-1]) if failed else None)
        guard.check()
        return out


def agent_reward(
    harbor_reward: Sequence[float | None] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    **fields: Any,
) -> list[float | None]:
    """The agent path's ``reward_funcs``: each episode's verifier reward, as ``rollout_func`` returned it.

    ``None`` (not judged) stays ``None``: TRL leaves the rollout out of its group. With ``log_metric``
    (GRPOTrainer passes it), the batch's means are logged as ``env/*``: model calls per episode, calls left out
    of the row, re-tokenized calls, rows cut at the completion budget, episodes not judged.
    """
    if harbor_reward is None:
        raise ValueError("the Harbor agent reward reads rollout_func's harbor_reward: pass rollout_func=spec.rollout_func")
    if log_metric is not None and harbor_reward:
        for name in ("calls", "dropped_calls", "retokenized", "truncated", "not_judged"):
            values = fields.get(f"harbor_{name}") or []
            if values:
                log_metric(f"env/{name}", sum(values) / len(values))
    return [None if reward is None else float(reward) for reward in harbor_reward]


def retokenize(tokenizer: Any, request: dict[str, Any], reply: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """A call's ids by the model's tokenizer and chat template, for a server that gave none (an ``eos`` ends it).

    ``None`` for a reply with tool calls: how the model wrote them (its template's tool-call syntax) is not in
    the reply, so the row ends before that call (counted as dropped) rather than train on made-up tokens.
    """
    choice = (reply.get("choices") or [{}])[0]
    message = (choice.get("message") if isinstance(choice, dict) else None) or {}
    if message.get("tool_calls"):
        return None
    prompt = _chat_ids(tokenizer, request.get("messages") or [], request.get("tools"))
    completion = tokenizer(str(message.get("content") or ""), add_special_tokens=False)["input_ids"]
    return prompt, [*completion, tokenizer.eos_token_id]


def _chat_ids(tokenizer: Any, messages: list[Any], tools: Any = None) -> list[int]:
    from shim.policy_server import plain_message

    text = tokenizer.apply_chat_template(
        [plain_message(m) for m in messages], tools=tools or None, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _plain_prompt(prompt: Any) -> list[dict[str, Any]]:
    """The dataset prompt's messages without the task field."""
    return [{k: v for k, v in m.items() if k != TASK_FIELD} for m in prompt] if isinstance(prompt, list) else []


def _error_of(record: EpisodeRecord) -> BaseException:
    return EpisodeNotJudgedError(f"{record.task} (attempt {record.attempt}): {record.unjudged_as}: {record.error or 'no verdict'}")
