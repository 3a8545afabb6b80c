"""Harbor's own agent trained through TRL's ``rollout_func``: ``HarborSpec(suite, agent="terminus-2")``.

Real parts: terminus-2 acting in real local sandboxes through the engine's
capture proxy, a real ``GRPOTrainer`` on a tiny Qwen3 built here, and three
model servers: the trainer's own model in-process (exact ids, on-policy), the
scripted server speaking vLLM's token fields (the ids must arrive unchanged, and
its chat "template" chains: the environment's tokens between two calls are
masked), and ``transformers serve`` (no ids: re-tokenized and marked).
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

import shim
from benchmarks.tiny_model import build_tiny_qwen3
from benchmarks.trainer_step import cpu_grpo_config
from harbor_async.core.errors import AgentConfigError, InfrastructureBudgetError
from harbor_async.jobs.folder import JobFolder
from harbor_async.suites import example_suite_path
from shim import engines
from shim.agent_rollouts import PromptTaskError, TrainerToolsError, retokenize, task_of
from tests.requirements import needs_bwrap
from tests.scripted_server import ScriptedServer, chat_ids, token_ids

pytestmark = [pytest.mark.slow, needs_bwrap, pytest.mark.one_worker]  # one worker builds its model

INDICES = [0, 1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    warnings.filterwarnings("ignore", category=UserWarning)
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


def _trainer(spec: shim.HarborSpec, tiny_model, out: Path, steps: int = 1, completion: int = 256):
    from trl import GRPOTrainer

    model_dir, tokenizer = tiny_model
    args = cpu_grpo_config(out, steps, 4, 2, completion, shuffle_dataset=False)
    return GRPOTrainer(
        model=str(model_dir), processing_class=tokenizer, args=args, train_dataset=spec.train_dataset,
        rollout_func=spec.rollout_func, reward_funcs=spec.reward_funcs,
    )  # fmt: skip


def _recording(trainer, spec: shim.HarborSpec) -> list[dict]:
    """Each generation batch: the trainer's tensors and the rollouts (with the policy's own generations)."""
    batches: list[dict] = []
    inner = trainer._generate_and_score_completions

    def recording(inputs):
        output = inner(inputs)
        rollouts = spec.rollout_func
        policy = rollouts._policy
        batches.append({"output": output, "last": list(rollouts.last), "generations": list(policy.generations) if policy else []})
        return output

    trainer._generate_and_score_completions = recording
    return batches


def _rows(output: dict) -> list[tuple[list[int], list[int]]]:
    """(completion ids, env mask) of each row of the trainer's batch, its padding removed."""
    rows = []
    for ids, mask, tool in zip(output["completion_ids"], output["completion_mask"], output["tool_mask"], strict=True):
        n = int(mask.sum())
        rows.append((ids[:n].tolist(), tool[:n].tolist()))
    return rows


@pytest.mark.trl_api
def test_grpo_trainer_trains_terminus_2_on_the_trainers_own_model(tmp_path: Path, tiny_model, host_tmux: None) -> None:
    spec = shim.HarborSpec(
        example_suite_path(), agent="terminus-2", environment_type="local", indices=INDICES, preflight=False,
        agent_kwargs={"max_turns": 1}, job_dir=tmp_path / "job",
    )  # fmt: skip
    trainer = _trainer(spec, tiny_model, tmp_path / "out", steps=2)
    batches = _recording(trainer, spec)
    trainer.train()
    assert len(batches) == 2
    for batch in batches:
        last, generations = batch["last"], batch["generations"]
        assert len(last) == 4 and {r.task for r in last} == {str(p) for p in spec._tasks}
        captured = [call for r in last for call in r.session.calls if call.status == 200]
        assert captured and all(call.tokens_from_server for call in captured)
        # exact: every captured call is a generation of the trainer's model, ids and logprobs as it sampled them
        made = sorted((tuple(g.prompt_ids), tuple(g.completion_ids)) for g in generations)
        assert sorted((tuple(c.prompt_token_ids), tuple(c.completion_token_ids)) for c in captured) == made
        by_ids = {tuple(g.completion_ids): g.logprobs for g in generations}
        assert all(c.logprobs == by_ids[tuple(c.completion_token_ids)] for c in captured)
        # the loss is computed on the rows the rollouts returned: the captured ids, the model's tokens unmasked
        for (ids, mask), rollout in zip(_rows(batch["output"]), last, strict=True):
            assert rollout.reward is not None  # judged: 0 or 1, whatever the model wrote
            first = next(c for c in rollout.session.calls if c.status == 200)
            assert ids == rollout.row.completion_ids and ids[: len(first.completion_token_ids)] == first.completion_token_ids
            assert mask == rollout.row.env_mask and sum(mask) == rollout.row.model_tokens > 0
            # terminus-2's own record of its ids (collect_rollout_details) agrees with the capture, turn by turn
            # (it keeps its chat's turns, not the calls it repeats after a reply it could not parse: those are missing)
            answered = [c for c in rollout.session.calls if c.status == 200]
            checked = rollout.record.capture["rollout_details"]
            assert checked["mismatches"] == 0 and checked["turns"] >= 1 and checked["turns"] + checked["missing"] == len(answered)
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"env/calls", "env/dropped_calls", "env/retokenized", "env/truncated", "env/not_judged"} <= logged
    assert len(JobFolder(tmp_path / "job").records()) == 8  # every rollout's record, as run writes it
    spec.close()


@pytest.mark.trl_api
def test_a_vllm_style_servers_ids_arrive_unchanged_and_the_environments_tokens_are_masked(
    tmp_path: Path, tiny_model, host_tmux: None
) -> None:
    suite = example_suite_path()
    with ScriptedServer(suite / "tasks") as server:
        spec = shim.HarborSpec(
            suite, agent="terminus-2", environment_type="local", indices=INDICES, preflight=False,
            model_name="hosted_vllm/terminus", agent_kwargs={"api_base": server.base_url},
        )  # fmt: skip
        trainer = _trainer(spec, tiny_model, tmp_path / "out", completion=8192)
        batches = _recording(trainer, spec)
        trainer.train()
    (batch,) = batches
    for (ids, mask), rollout in zip(_rows(batch["output"]), batch["last"], strict=True):
        assert rollout.reward == 1.0  # the scripted model solves the task
        calls = rollout.session.calls
        assert len(calls) == rollout.row.calls == 3 and rollout.row.dropped == 0
        for call in calls:  # the server's own ids and logprobs, as it gave them
            content = call.reply["choices"][0]["message"]["content"]
            assert call.prompt_token_ids == chat_ids(call.request["messages"])
            assert call.completion_token_ids == token_ids(content)
            assert call.logprobs == [-0.125 * (b % 4) for b in content.encode()]
        # one sequence: the first prompt, then each answer and what the environment added before the next call
        last_call = calls[-1]
        assert rollout.row.prompt_ids == calls[0].prompt_token_ids
        assert rollout.row.prompt_ids + ids == last_call.prompt_token_ids + last_call.completion_token_ids
        model_tokens = [t for t, m in zip(ids, mask, strict=True) if m]
        assert model_tokens == [t for call in calls for t in call.completion_token_ids]
        assert 0 in mask and sum(mask) == sum(len(call.completion_token_ids) for call in calls)
        assert rollout.record.capture["rollout_details"] == {"turns": 3, "mismatches": 0, "missing": 0}
        assert rollout.record.capture["trajectory"] == {"steps": 3, "mismatches": 0}  # Harbor's ATIF file agrees too
        # the sessions never mix: each episode's calls are about its own task
        instruction = spec._tasks[rollout.task].instruction
        assert all(call.request["messages"][0]["content"].count(instruction.strip()[:60]) for call in calls)
    # a session is closed once its agent is done: its key is refused, as an unknown one is
    (proxy,) = [p for e in engines.open_engines() for p in e._captures.values() if p.upstream_base_url == server.base_url]
    session = batch["last"][0].session
    for key in (session.api_key, "hb-capture-not-a-session"):
        answer = httpx.post(f"{proxy.base_url}/chat/completions", headers={"authorization": f"Bearer {key}"},
                            json={"model": "terminus", "messages": [{"role": "user", "content": "again"}]}, timeout=30)  # fmt: skip
        assert answer.status_code == 401
    assert len(session.calls) == 3
    spec.close()


def test_a_server_without_token_ids_is_retokenized_and_marked(tmp_path: Path, tiny_model, host_tmux: None) -> None:
    model_dir, tokenizer = tiny_model
    port = _free_port()
    transformers = Path(sys.executable).parent / "transformers"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [str(transformers), "serve", str(model_dir), "--port", str(port), "--host", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    try:
        _wait_ready(f"http://127.0.0.1:{port}/v1/models", server)
        spec = shim.HarborSpec(
            example_suite_path(), agent="terminus-2", environment_type="local", indices=INDICES[:1], preflight=False,
            model_name=f"openai/{model_dir}", agent_kwargs={
                "api_base": f"http://127.0.0.1:{port}/v1", "max_turns": 1, "temperature": 0, "llm_call_kwargs": {"max_tokens": 64},
            },
            max_failure_share=None, agent_timeout_multiplier=0.1,  # terminus-2 answers parse errors without end: 12 s
            # greedy: the same text each run (sampled, it can trip the server's own parser: a 500)
        )  # fmt: skip
        trainer = _trainer(spec, tiny_model, tmp_path / "out")
        out = spec.rollout_func([row["prompt"] for row in spec.train_dataset], trainer)
    finally:
        server.terminate()
        server.wait(30)
    (rollout,) = spec.rollout_func.last
    answered = [call for call in rollout.session.calls if call.status == 200]
    assert rollout.session.calls[0].request.get("return_token_ids") is True  # terminus-2 asks too: dropped for it
    assert rollout.record.capture.get("rollout_details") is None  # Harbor's record has no ids either
    assert rollout.record.capture.get("trajectory") is None  # nor ids from the server to check its counts by
    assert rollout.reward is not None, rollout.record.error
    assert answered and not any(call.tokens_from_server for call in answered) and rollout.session.retokenize
    assert out["harbor_retokenized"] == [rollout.row.calls] and rollout.row.retokenized >= 1
    first = answered[0]
    text = tokenizer.apply_chat_template(first.request["messages"], add_generation_prompt=True, tokenize=False)
    assert out["prompt_ids"][0] == tokenizer(text, add_special_tokens=False)["input_ids"]
    content = first.reply["choices"][0]["message"]["content"]
    expected = [*tokenizer(content, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id][:256]  # the row's cut
    assert out["completion_ids"][0][: len(expected)] == expected and out["env_mask"][0][: len(expected)] == [1] * len(expected)
    spec.close()


def test_episodes_without_a_verdict_leave_the_loss_and_stop_the_trainer_past_the_share(
    tmp_path: Path, tiny_model, host_tmux: None
) -> None:
    suite = example_suite_path()
    with ScriptedServer(suite / "tasks") as server:
        common = dict(
            agent="terminus-2", environment_type="local", indices=INDICES[:1], preflight=False,
            model_name="hosted_vllm/always-500", agent_kwargs={"api_base": server.base_url, "max_turns": 1},
        )  # fmt: skip
        spec = shim.HarborSpec(suite, max_failure_share=None, **common)
        trainer = _trainer(spec, tiny_model, tmp_path / "out")
        prompts = [row["prompt"] for row in spec.train_dataset] * 2
        out = spec.rollout_func(prompts, trainer)
        assert out["harbor_reward"] == [None, None] and out["harbor_not_judged"] == [1, 1]
        assert all(set(mask) == {0} for mask in out["env_mask"])  # nothing of theirs is trained on
        assert {r.record.error_class for r in spec.rollout_func.last} == {"model_server"}
        spec.close()
        guarded = shim.HarborSpec(suite, **common)  # the default share: a batch of server failures stops training
        with pytest.raises(InfrastructureBudgetError, match="model_server"):
            guarded.rollout_func(prompts, trainer)
        guarded.close()


def test_an_episode_without_a_model_call_is_one_masked_eos_and_a_trainer_with_tools_is_refused(
    tmp_path: Path, tiny_model, host_tmux: None
) -> None:
    from trl import GRPOTrainer

    suite = example_suite_path()
    with ScriptedServer(suite / "tasks") as server:
        spec = shim.HarborSpec(
            suite, agent="terminus-2", environment_type="local", indices=INDICES[:1], preflight=False,
            model_name="hosted_vllm/terminus", agent_kwargs={"api_base": server.base_url, "max_turns": 0},
        )  # fmt: skip
        trainer = _trainer(spec, tiny_model, tmp_path / "out")
        out = spec.rollout_func([spec.train_dataset[0]["prompt"]], trainer)
        assert server.requests["terminus"] == 0 and out["harbor_calls"] == [0]
        # judged (the verifier's 0 for an untouched sandbox) with nothing of the model's: TRL needs a completion,
        # an empty one crashes it, so the row is one eos, masked out
        assert out["harbor_reward"] == [0.0] and out["completion_ids"] == [[trainer.processing_class.eos_token_id]]
        assert out["env_mask"] == [[0]] and out["logprobs"] == [[0.0]]
        spec.close()
        # a reply with tool calls from a server that gave no ids: its tokens are not re-made from the text
        request = {"messages": [{"role": "user", "content": "hi"}]}
        calling = {"choices": [{"message": {"content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}}]}
        assert retokenize(trainer.processing_class, request, calling) is None
        talking = retokenize(trainer.processing_class, request, {"choices": [{"message": {"content": "ok"}}]})
        assert talking is not None and talking[1][-1] == trainer.processing_class.eos_token_id

        model_dir, tokenizer = tiny_model

        def shell(command: str) -> str:
            """Runs a command.

            Args:
                command: the command.
            """
            return ""

        tooled = shim.HarborSpec(
            suite, agent="terminus-2", environment_type="local", indices=INDICES, preflight=False,
            model_name="hosted_vllm/terminus", agent_kwargs={"api_base": server.base_url},
        )  # fmt: skip
        both = GRPOTrainer(
            model=str(model_dir), processing_class=tokenizer, args=cpu_grpo_config(tmp_path / "tools", 1, 4, 2, 64),
            train_dataset=tooled.train_dataset, rollout_func=tooled.rollout_func, reward_funcs=tooled.reward_funcs,
            tools=[shell],
        )  # fmt: skip
        with pytest.raises(TrainerToolsError, match="neither tools= nor environment_factory="):
            both.train()  # TRL would run its own tool loop on the agent's rows and train the environment's tokens
        assert server.requests["terminus"] == 0  # refused before any episode
        tooled.close()


def test_what_the_agent_path_cannot_do_is_refused_up_front(tmp_path: Path) -> None:
    suite = example_suite_path()
    spec = shim.HarborSpec(suite, agent="terminus-2", environment_type="local", indices=INDICES, preflight=False)
    with pytest.raises(ValueError, match="rollout_func=spec.rollout_func"):
        spec.environment_factory  # noqa: B018
    row = spec.train_dataset[0]
    assert task_of(row["prompt"]) == row["task_dir"] and row["prompt"][0]["content"].startswith("# Count the log files")
    with pytest.raises(PromptTaskError):
        spec.rollout_func([[{"role": "user", "content": "no task here"}]], None)
    with pytest.raises(ValueError, match="harness"):
        shim.HarborSpec(suite, agent="bash", environment_type="local", model_name="hosted_vllm/x", preflight=False)
    installed = shim.HarborSpec(suite, agent="claude-code", environment_type="docker", indices=INDICES, preflight=False,
                                model_name="anthropic/claude", agent_kwargs={})  # fmt: skip
    with pytest.raises(AgentConfigError, match="runs inside the sandbox"):
        installed.rollout_func  # noqa: B018
    harness = shim.HarborSpec(suite, agent="bash", environment_type="local", indices=INDICES, preflight=False)
    with pytest.raises(ValueError, match="environment_factory"):
        harness.rollout_func  # noqa: B018


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, "transformers serve exited"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"transformers serve not ready within {timeout} s")


def test_async_grpo_sessions_keep_openenvs_contract_and_convert_in_trl(tmp_path: Path, host_tmux: None) -> None:
    from openenv.core.harness import (
        ResourceSession,
        ResourceSessionFactory,
        TrainableSession,
        TrainingTrace,
    )
    from openenv.core.harness.capture.upstream import training_sampling
    from trl.experimental.async_grpo.async_rollout_worker import _chain_to_sequences
    from trl.experimental.async_grpo.openenv_harness import _turns_from_training_trace

    from shim.openenv_sessions import SessionFactoryError

    suite = example_suite_path()
    with ScriptedServer(suite / "tasks") as server:
        spec = shim.HarborSpec(
            suite, agent="terminus-2", environment_type="local", indices=INDICES, preflight=False,
            model_name="hosted_vllm/terminus", agent_kwargs={"api_base": server.base_url, "temperature": 0.2},
        )  # fmt: skip
        # as TRL's HarnessRolloutWorker calls it in its loop-owning mode
        factory = spec.session_factory(sampling=training_sampling({"temperature": 0.7, "top_p": 1.0}))
        assert isinstance(factory, ResourceSessionFactory)
        row = spec.train_dataset[0]
        sessions = [factory.create(row["prompt"], seed=0, episode_id=f"e{i}") for i in range(2)]  # one group
        for session in sessions:
            assert isinstance(session, ResourceSession) and isinstance(session, TrainableSession)
            assert session.initial_messages()[0]["content"].startswith("# Count the log files")
            assert session.wait_for_completion(timeout_s=300) == 0
            trace = session.fetch_training_trace()
            assert isinstance(trace, TrainingTrace) and len(trace.turns) == 3
            for turn, call in zip(trace.turns, session.capture.calls, strict=True):
                content = call.reply["choices"][0]["message"]["content"]
                assert turn.prompt_token_ids == chat_ids(call.request["messages"])
                assert turn.completion_token_ids == token_ids(content)
                assert turn.loss_mask == [0] * len(turn.prompt_token_ids) + [1] * len(turn.completion_token_ids)
            assert session.verify([]).env_reward == 1.0
            # TRL's own conversion of the trace: one sequence, the three answers trained, nothing between them
            sequences, tally = _chain_to_sequences(_turns_from_training_trace(trace), session.episode_id, 0)
            assert len(sequences) == 1 and tally["fork"] == 0 and tally["clean"] == 2
            session.close()
        # the trainer's policy, not the agent's 0.2: every forwarded call sampled at the worker's temperature
        assert server.sampling and all(s["temperature"] == 0.7 for s in server.sampling)
        assert len({s.episode_id for s in sessions}) == 2 and sessions[0].capture is not sessions[1].capture
        spec.close()

        failing = shim.HarborSpec(
            suite, agent="terminus-2", environment_type="local", indices=INDICES[:1], preflight=False,
            model_name="hosted_vllm/always-500", agent_kwargs={"api_base": server.base_url, "max_turns": 1},
        )  # fmt: skip
        session = failing.session_factory(sampling=training_sampling({"temperature": 1.0})).create(failing.train_dataset[0]["prompt"])
        assert session.wait_for_completion(timeout_s=300) == 1  # no verdict: the model server failed
        assert session.verify([]).env_reward is None and session.fetch_training_trace().turns == []
        failing.close()
    in_process = shim.HarborSpec(suite, agent="terminus-2", environment_type="local", indices=INDICES, preflight=False)
    with pytest.raises(SessionFactoryError, match="vLLM server"):
        in_process.session_factory(sampling={})
