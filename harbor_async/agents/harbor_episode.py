"""One episode of one of Harbor's agents (``terminus-2``, ``claude-code``, ``module:Class``): an EpisodeAgent.

A :class:`HarborAgentRunner` is the :class:`~harbor_async.episodes.runner.EpisodeAgent`
of a :class:`~harbor_async.agents.harbor.HarborAgentSpec`: the agent is built
with Harbor's factory (its logs in the sandbox's trial ``agent/`` folder), set
up in the start phase within Harbor's agent setup timeout, then run on the
task's (each step's) instruction within the agent budget, as Harbor's trial
runs it. Its token counts and cost (Harbor's ``AgentContext``) go into the
record's ``usage``, summed over the steps of a multi-step task.

Blame: a setup that fails (an install, a terminal) is the start's, rerun by a
resume; a model-server error is judged by :mod:`harbor_async.models.model_server`, as
for ``eval``'s harnesses: a transient one (unreachable, 408, 409, 429, 5xx) is
``model_server`` (no verdict, rerun), a refused configuration (401, 403, 404,
another 4xx) is ``model_server`` with
:class:`~harbor_async.core.errors.ModelServerConfigError` (the run stops), and the
model's own refusal (its context outgrown) is the agent's; anything else the
agent does, or its running out of time, is the agent's (the verifier still
judges what it left, as in Harbor).

Capture (``capture=True``, ``--capture``): the agent calls its model through
the engine's capture proxy (:meth:`~harbor_async.engine.engine.Engine.capture_proxy`),
one session per episode; every call, with the server's token ids and logprobs
where it gives them, is written to the trial's ``agent/capture.json`` after each
instruction, and counted in the record's ``capture``. Only agents that run on
the host and take LiteLLM's ``llm_kwargs`` (terminus-2 and its kind) can be
captured: :meth:`~harbor_async.agents.harbor.HarborAgentSpec.check_capture`
refuses the others up front.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from harbor_async.agents.harbor import HarborAgentSpec
from harbor_async.core.errors import Phase, SandboxError, SandboxTimeout
from harbor_async.core.moved import renamed_attribute
from harbor_async.models.capture.rows import token_row
from harbor_async.models.capture.trace import check_rollout_details, check_trajectory
from harbor_async.models.model_server import ServerVerdict, classify, model_server_error

if TYPE_CHECKING:
    from collections.abc import Callable

    import httpx

    from harbor_async.episodes.episode import Episode
    from harbor_async.models.capture import CaptureSession

#: Harbor's ``AgentContext`` counts kept in a record's ``usage`` (summed over the steps of a task).
USAGE_KEYS = ("n_input_tokens", "n_cache_tokens", "n_output_tokens", "cost_usd")
#: What a captured call asks the model server for besides the agent's request: vLLM's token ids and the logprobs.
CAPTURE_REQUEST = {"logprobs": True, "return_token_ids": True}
#: The capture's file in the trial folder (beside Harbor's own ``agent/trajectory.json``).
CAPTURE_FILE = Path("agent") / "capture.json"
#: Where Harbor's agents write their ATIF trajectory (terminus-2 does), beside the capture.
TRAJECTORY_FILE = Path("agent") / "trajectory.json"


@dataclass
class HarborAgentRunner:
    """One episode of a Harbor agent: built and set up in the start phase, run on each instruction.

    Args:
        spec: the agent, its model and options.
        name: recorded as the record's ``agent`` (default: the spec's name).
        timeout: the agent's wall-clock budget per instruction (``eval``'s ``--agent-timeout``);
            ``None``: the task's or step's agent budget, multiplied.
        capture: record every model call through the engine's capture proxy (see the module docs).
        capture_request: merged into each captured request (default: vLLM's token ids and logprobs).
        upstream_transport: answers for the model server in this process (the trainer's own model,
            :mod:`shim.policy_server`) instead of a socket to it; only with ``capture``.
        on_session: called with the episode's capture session once it is open (the trainer's rollouts read
            the calls from it, not from the trial's file).
    """

    spec: HarborAgentSpec
    name: str = ""
    timeout: float | None = None
    capture: bool = False
    capture_request: dict[str, Any] = field(default_factory=lambda: dict(CAPTURE_REQUEST))
    upstream_transport: httpx.AsyncBaseTransport | None = None
    on_session: Callable[[CaptureSession], None] | None = None
    _agent: Any = None
    _acted: bool = False
    _session: CaptureSession | None = None
    _written: int = 0  # the session's calls already in a capture file

    def __post_init__(self) -> None:
        self.name = self.name or self.spec.name

    async def setup(self, episode: Episode) -> None:
        """Build the agent into the sandbox's trial ``agent/`` folder and run its ``setup`` (Harbor's setup timeout)."""
        from harbor.models.trial.paths import TrialPaths

        sandbox = episode.sandbox
        assert sandbox is not None and sandbox.trial_dir is not None
        cls, spec = self.spec.agent_class, self.spec
        if self.capture:
            url, key = spec.check_capture()
            proxy = await episode.engine.capture_proxy(url, key, self.capture_request, self.upstream_transport)
            self._session = proxy.open_session(sandbox.id)
            if self.on_session is not None:
                self.on_session(self._session)
            spec = spec.through_proxy(proxy.base_url, self._session.api_key)
        self._agent = spec.build(TrialPaths(trial_dir=sandbox.trial_dir).agent_dir, episode.task)
        timeouts = episode.engine.timeouts
        budget = cls.DEFAULT_SETUP_TIMEOUT_SEC * (timeouts.agent_setup_timeout_multiplier or timeouts.timeout_multiplier)  # Harbor's rule
        environment = sandbox.environment
        with environment.with_default_user(episode.task.config.agent.user), environment.scoped_exec_env({**self._agent.extra_env, **sandbox.context.agent_env}):
            async with sandbox.context.budget.exec_slot(), sandbox.bounded_phase(Phase.START, budget=budget):
                await self._agent.setup(environment)

    async def act(self, episode: Episode) -> None:
        """Run the agent on the episode's instruction; record its usage and, if it failed, whose failure it was."""
        from harbor.models.agent.context import AgentContext

        sandbox, record = episode.sandbox, episode.record
        assert sandbox is not None and self._agent is not None
        context = AgentContext()
        environment = sandbox.environment
        again = self._acted and sandbox.context.strict_verify and self._keeps_processes()
        self._acted = True
        if self._session is not None:
            self._session.closed = False  # open while the agent acts on this instruction, closed in between
        try:
            with environment.scoped_exec_env({**self._agent.extra_env, **sandbox.context.agent_env}):
                async with sandbox.context.budget.exec_slot(), sandbox.bounded_phase(Phase.AGENT, budget=episode.agent_budget):
                    if again:
                        # The last step's strict verify ended every process the agent had (terminus-2's terminal):
                        # its setup starts them again, within this step's budget; a sandbox the agent broke is its own.
                        await self._agent.setup(environment)
                    await self._agent.run(episode.instruction, environment, context)
        except SandboxError as exc:
            # The agent keeps its own conversation: only context overflow can be the model's refusal here.
            # A phase that ran out of time is the agent's, even while a request of its was failing.
            verdict = None if isinstance(exc, SandboxTimeout) else classify(exc)
            if verdict in (ServerVerdict.TRANSIENT, ServerVerdict.CONFIGURATION):
                # the model server failed or refused its setup, not the model: no verdict (as eval's harnesses)
                server = model_server_error(exc, self.spec.model_name, verdict)
                episode.fail_with(server, "model")
                episode.error = server
            else:  # no server error, or the model's own refusal (its context outgrown): the agent's
                episode.fail_with(exc)
        finally:
            if context.is_empty():  # an installed agent's counts come from its logs (Harbor's post-run step)
                try:
                    self._agent.populate_context_post_run(context)
                except Exception:  # noqa: BLE001 - logs it could not read: no counts, not a failed episode
                    pass
            _add_usage(record.usage, context)
            if self._session is not None:
                self._session.closed = True  # what the agent left running calls in vain
                step = episode.step.name if episode.step is not None else None
                with anyio.CancelScope(shield=True):  # a cancelled episode's calls are kept too
                    await anyio.to_thread.run_sync(self._write_capture, sandbox.trial_dir, step, record, context)

    def _write_capture(self, trial_dir: Path | None, step: str | None, record: Any, context: Any = None) -> None:
        """This instruction's calls into the agent folder's capture file; the record's summary of all calls so far.

        The agent folder is the instruction's own: a multi-step task's is kept as ``steps/NAME/agent``, beside
        the step's trajectory, so each step's file holds that step's calls.
        """
        session = self._session
        assert session is not None
        first = self._written
        calls, self._written = session.calls[first:], len(session.calls)
        as_json = [call.to_json() for call in session.calls]  # once: the row reads them all, the file this part
        summary = dict(record.capture or {"files": []})
        summary.update(calls=len(session.calls), refused=session.refused, retokenize=session.retokenize)
        checked = check_rollout_details(calls, getattr(context, "rollout_details", None))
        if checked is not None:  # the agent's own ids (terminus-2's collect_rollout_details) against this instruction's calls
            before = summary.get("rollout_details") or {"turns": 0, "mismatches": 0, "missing": 0}
            summary["rollout_details"] = {key: before[key] + checked[key] for key in checked}
        row = None if session.retokenize else token_row(as_json)
        # The episode as one training sequence so far (None: no answered call, or no server ids: the trainer and
        # export re-tokenize): what the model generated (env_mask 1) and what the environment or the agent's
        # scaffolding added between two calls (0); calls of a re-templated history left out count as dropped.
        summary["row"] = None if row is None else {
            "calls": row.calls, "dropped": row.dropped, "model_tokens": row.model_tokens,
            "environment_tokens": len(row.env_mask) - row.model_tokens,
        }  # fmt: skip
        if trial_dir is not None:
            checked = check_trajectory(calls, _read_json(Path(trial_dir) / TRAJECTORY_FILE))
            if checked is not None:  # the agent's ATIF trajectory (its steps' ids or token counts) against the calls
                before = summary.get("trajectory") or {"steps": 0, "mismatches": 0}
                summary["trajectory"] = {key: before[key] + checked[key] for key in checked}
            path = Path(trial_dir) / CAPTURE_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            sequence = None if row is None else {
                "prompt_ids": row.prompt_ids, "completion_ids": row.completion_ids,
                "env_mask": row.env_mask, "calls": row.calls, "dropped": row.dropped,
            }  # fmt: skip
            path.write_text(json.dumps({**session.to_json(as_json[first:]), "row": sequence}))
            summary["files"] = [*summary["files"], str(Path("steps", step, CAPTURE_FILE) if step else CAPTURE_FILE)]
        record.capture = summary

    def _keeps_processes(self) -> bool:
        """Whether the agent keeps processes between instructions (a terminal): an installed agent runs one exec each."""
        from harbor.agents.installed.base import BaseInstalledAgent

        return not isinstance(self._agent, BaseInstalledAgent)


def _read_json(path: Path) -> Any:
    """A JSON file the agent wrote (bounded: a trajectory past 64 MiB is not read); ``None`` if missing or not JSON."""
    try:
        if path.stat().st_size > 64 * 2**20:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _add_usage(usage: dict[str, Any], context: Any) -> None:
    """Add the ``AgentContext``'s token counts and cost to a record's ``usage`` (a later step adds to the earlier)."""
    for key in USAGE_KEYS:
        value = getattr(context, key, None)
        if value is not None:
            usage[key] = usage.get(key, 0) + value

if not TYPE_CHECKING:  # hidden from type checkers, which would otherwise take any name as defined

    def __getattr__(name: str) -> Any:
        """The old class names of the move (one release, with a DeprecationWarning)."""
        return renamed_attribute(__name__, name)
