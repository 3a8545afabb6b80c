"""Harbor agent episodes as OpenEnv resource sessions, for TRL's ``AsyncGRPOTrainer`` harness worker.

TRL's ``HarnessRolloutWorker`` (``trl/experimental/async_grpo/openenv_harness.py``)
takes a callable that returns an OpenEnv ``ResourceSessionFactory``; in its
loop-owning mode it calls it with ``sampling=`` (the trainer's policy), creates
one session per prompt, waits for the agent, reads a ``TrainingTrace`` and asks
the session to ``verify``. ``spec.session_factory`` is that callable::

    worker = HarnessRolloutWorker(..., harness_session_factory=spec.session_factory)

Each session is one episode on the engine, exactly as ``spec.rollout_func``
runs it (:mod:`shim.agent_rollouts`: the Harbor agent captured through the
engine's proxy, every limit and failure rule of the engine), started at
``create`` and running in the engine's loop thread while the worker waits. The
trace has one ``TrainingTurn`` per answered call that carried the server's ids
(prompt tokens context, completion tokens trained on, the server's logprobs);
TRL chains them itself. ``verify`` forwards the verifier's reward, ``None``
for an episode without a verdict (host-side evidence only), which TRL leaves
out of the group.

The model is the trainer's vLLM server (``model_name`` and ``agent_kwargs``'s
``api_base`` on the spec); the worker's sampling is merged into every call the
proxy forwards, so the agent samples with the trainer's policy whatever it
asks. Needs ``openenv`` (``pip install openenv``), imported when a factory is
made.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from harbor_async.agents.harbor_episode import CAPTURE_REQUEST, HarborAgentRunner
from harbor_async.core.errors import HarborAsyncError
from harbor_async.engine.loop import wait_done, wait_result
from harbor_async.episodes.runner import run_episode
from shim import engines
from shim.agent_rollouts import AgentRollouts, task_of

if TYPE_CHECKING:
    from harbor_async.core.records import EpisodeRecord
    from harbor_async.models.capture import CaptureSession


class SessionFactoryError(HarborAsyncError, ValueError):
    """The spec cannot make OpenEnv sessions: no model server of its own, or ``openenv`` is not installed."""


def session_factory(rollouts: AgentRollouts, sampling: Mapping[str, Any] | None = None) -> Any:
    """An OpenEnv ``ResourceSessionFactory`` of Harbor agent episodes (what ``spec.session_factory(sampling=...)`` returns)."""
    try:
        from openenv.core.harness import ResourceSession, ResourceSessionFactory
    except ImportError as exc:
        raise SessionFactoryError(f"AsyncGRPOTrainer's harness worker needs OpenEnv: pip install openenv ({exc})") from None
    if rollouts.in_process:
        raise SessionFactoryError(
            "AsyncGRPOTrainer samples from its vLLM server: give HarborSpec model_name='hosted_vllm/NAME' and "
            "agent_kwargs={'api_base': URL} of that server"
        )
    request_extra = {**CAPTURE_REQUEST, **dict(sampling or {})}

    class HarborAgentSession(ResourceSession):  # type: ignore[misc]  # openenv's ABC (an optional package)
        """One Harbor agent episode on the engine; a ``TrainableSession`` (OpenEnv's loop-owning contract)."""

        def __init__(self, task: str, episode_id: str) -> None:
            self.task, self.episode_id = task, episode_id
            self.capture: CaptureSession | None = None
            self._ready = threading.Event()
            runner = HarborAgentRunner(
                rollouts.agent_spec(), capture=True, capture_request=request_extra, on_session=self._opened,
            )  # fmt: skip
            engines.engine_for(rollouts.options)  # opened here, on the worker's thread, not on the loop
            self.record: Future[EpisodeRecord] = engines.submit(_episode, rollouts, task, runner)

        def _opened(self, session: CaptureSession) -> None:
            self.capture = session
            self._ready.set()

        def initial_messages(self) -> list[dict[str, Any]]:
            return [{"role": "user", "content": str(rollouts.tasks[self.task].instruction or "")}]

        def list_tools(self) -> list[Any]:
            return []  # the agent brings its own tools (its terminal)

        def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
            raise SessionFactoryError("a Harbor agent session owns its loop: it has no tools to call")

        def wait_for_completion(self, timeout_s: float | None = None) -> int:
            """Wait for the episode (verified and stopped); 0 when it was judged, 1 otherwise."""
            if not wait_done(self.record, timeout_s):
                raise TimeoutError(f"episode {self.episode_id} still running after {timeout_s} s")
            return 0 if self.record.result().judged else 1

        def fetch_training_trace(self) -> Any:
            """The captured calls as OpenEnv's ``TrainingTrace`` (see the module docs)."""
            from openenv.core.harness import TrainingTrace

            return TrainingTrace.from_entries(training_entries(self.capture, self.episode_id))

        def verify(self, transcript: list[dict[str, Any]], final_state: Any | None = None) -> Any:
            from openenv.core.harness import VerifyResult

            record = wait_result(self.record)
            reward = None if not record.judged else 0.0 if record.reward is None else float(record.reward)
            return VerifyResult(env_reward=reward, done=True, metrics={
                "judged": record.judged, "error_class": record.error_class, "calls": len(self.capture.calls) if self.capture else 0,
            })  # fmt: skip

        def close(self) -> None:
            if not self.record.done():
                self.record.cancel()  # a session dropped mid-episode: the engine stops its sandbox

    class HarborSessionFactory(ResourceSessionFactory):  # type: ignore[misc]
        """Sessions of the spec's tasks; ``create`` takes a prompt of ``spec.train_dataset``."""

        def create(self, task: Any, seed: int | None = None, episode_id: str | None = None) -> HarborAgentSession:
            key = task_of(task) if not isinstance(task, str) else task
            if key not in rollouts.tasks:
                raise SessionFactoryError(f"no task {key!r} in this spec")
            return HarborAgentSession(key, episode_id or uuid.uuid4().hex)

    return HarborSessionFactory()


async def _episode(rollouts: AgentRollouts, task: str, runner: HarborAgentRunner) -> EpisodeRecord:
    """One episode with the spec's backend options and record sink (on the loop thread)."""
    options = rollouts.options
    return await run_episode(
        engines.engine_for(options), rollouts.tasks[task], rollouts.backend, runner, task_path=task,
        model=runner.spec.model_name, on_done=engines.record_sink(options), backend_kwargs=rollouts.backend_kwargs,
    )  # fmt: skip


def training_entries(capture: CaptureSession | None, episode_id: str) -> list[dict[str, Any]]:
    """One OpenEnv trace entry per answered call with the server's ids: the prompt as context, the completion trained."""
    entries = []
    for call in capture.calls if capture is not None else []:
        if call.status != 200 or not call.tokens_from_server:
            continue
        prompt, completion = list(call.prompt_token_ids or []), list(call.completion_token_ids or [])
        logprobs = call.logprobs if call.logprobs is not None and len(call.logprobs) == len(completion) else None
        if logprobs is None:
            continue  # OpenEnv's contract wants the sampled logprobs: a call without them is not trainable
        entries.append({
            "prompt_token_ids": prompt, "completion_token_ids": completion, "per_token_logps": list(logprobs),
            "loss_mask": [0] * len(prompt) + [1] * len(completion), "request": call.request, "response": call.reply or {},
            "metadata": {"node_id": f"{episode_id}-{call.index}"},
        })  # fmt: skip
    return entries
