"""Prefetch: the next generation read from TRL's sampler, sandboxes started ahead and claimed, wrong guesses stopped.

The order is checked against TRL's own ``RepeatSampler`` sharded by
accelerate's own ``BatchSamplerShard`` (what a multi-process GRPOTrainer
reads); the pool on a real engine; the whole path on a real
HarborGRPOTrainer over bubblewrap sandboxes.
"""

from __future__ import annotations

import anyio
import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler
from trl.trainer.utils import RepeatSampler

from harbor_async.backends import resolve_backend
from harbor_async.core.errors import EpisodeDeadlineError
from harbor_async.core.policy import Limits, Timeouts
from harbor_async.engine.engine import Engine
from shim.lookahead import GenerationLookahead, LookaheadSampler, task_key
from shim.prefetch import PrefetchPool


def _shard(sampler: LookaheadSampler, global_batch: int, processes: int, process: int) -> BatchSamplerShard:
    """What accelerate makes of the trainer's batch sampler for one process."""
    batches = BatchSampler(sampler, global_batch // processes, drop_last=False)
    return BatchSamplerShard(batches, num_processes=processes, process_index=process)


def _repeat_sampler(rows: int, generations: int, global_batch: int, repeat: int) -> RepeatSampler:
    return RepeatSampler(
        data_source=list(range(rows)),
        mini_repeat_count=generations,
        batch_size=global_batch // generations,
        repeat_count=repeat,
        shuffle=True,
        seed=7,
    )


@pytest.mark.parametrize(("processes", "repeat"), [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_lookahead_names_every_next_generation_as_accelerate_shards_it(processes: int, repeat: int) -> None:
    rows, generations, global_batch, epochs = 24, 2, 8, 3
    keys = [f"task-{i}" for i in range(rows)]
    for process in range(processes):
        sampler = LookaheadSampler(_repeat_sampler(rows, generations, global_batch, repeat))
        shard = _shard(sampler, global_batch, processes, process)
        # What this process's trainer generates on: the first of each `repeat` consecutive batches.
        generations_seen = []
        for _ in range(epochs):
            batches = list(shard)
            generations_seen += [[keys[i] for i in b] for b in batches[::repeat]]
        assert len(generations_seen) == epochs * rows // (global_batch // generations)
        # Replay the same epochs and ask, at each generation, for the next one (across epoch ends too).
        sampler2 = LookaheadSampler(_repeat_sampler(rows, generations, global_batch, repeat))
        lookahead = GenerationLookahead(
            sampler2, keys.__getitem__, global_batch=global_batch, processes=processes, process_index=process,
            repeat=repeat,
        )  # fmt: skip
        shard2 = _shard(sampler2, global_batch, processes, process)
        predicted = []
        for _ in range(epochs):
            for batch in list(shard2)[::repeat]:
                predicted.append(lookahead.next_keys([keys[i] for i in batch]))
        assert predicted[:-1] == generations_seen[1:]


def test_reading_ahead_leaves_the_samplers_order_unchanged() -> None:
    plain = _repeat_sampler(12, 2, 4, 2)
    wrapped = LookaheadSampler(_repeat_sampler(12, 2, 4, 2))
    expected = [list(plain) for _ in range(3)]
    got = []
    for _ in range(3):
        it = iter(wrapped)
        wrapped.epoch(1)  # read the next epoch before this one is consumed
        got.append(list(it))
    assert got == expected


def test_lookahead_finds_a_resumed_run_and_says_none_for_unknown_rows() -> None:
    keys = [f"t{i}" for i in range(16)]
    sampler = LookaheadSampler(_repeat_sampler(16, 2, 4, 1))
    lookahead = GenerationLookahead(sampler, keys.__getitem__, global_batch=4)
    order = [keys[i] for i in iter(sampler)]
    generation = [order[i : i + 4] for i in range(0, len(order), 4)]
    assert lookahead.next_keys(generation[3]) == generation[4]  # first call lands mid-epoch (a resume)
    assert lookahead.next_keys(generation[4]) == generation[5]
    assert lookahead.next_keys(["t0", "t0", "nope", "nope"]) is None


def test_task_key_reads_the_column_or_says_there_is_none() -> None:
    from datasets import Dataset

    data = Dataset.from_dict({"prompt": ["a", "b"], "task_dir": ["/x", "/y"]})
    assert task_key(data)(1) == "/y"
    assert task_key(Dataset.from_dict({"prompt": ["a"]})) is None
    assert task_key([{"task_dir": "/z"}])(0) == "/z"


@pytest.mark.slow
@pytest.mark.anyio
async def test_pool_claims_started_sandboxes_stops_unclaimed_and_renews_the_deadline(example_tasks) -> None:
    simulated = resolve_backend("simulated")
    first, second = example_tasks[0], example_tasks[1]
    async with Engine(timeouts=Timeouts(episode=2.0), backend_kwargs={"start_latency": 0.05}) as engine:
        pool = PrefetchPool(engine)
        pool.start(first, simulated, {})
        pool.start(first, simulated, {})
        pool.start(second, simulated, {})
        assert pool.parked == 3
        await anyio.sleep(2.5)  # past the episode budget counted from the launch
        claimed = pool.claim(first, simulated, {})
        assert claimed is not None and pool.claim(first, simulated, {"other": 1}) is None
        await claimed.wait_started()
        assert (await claimed.exec("echo ok")).exit_code == 0  # the budget counts from the claim
        others = [s for s in engine.live_sandboxes() if s is not claimed]
        counts = pool.release()
        assert (counts.hits, counts.unused) == (1, 2)
        assert pool.parked == 0 and pool.claim(first, simulated, {}) is None
        with anyio.fail_after(5):
            for sandbox in others:
                await sandbox.stop()  # already stopping: returns when stopped
        assert all(s.done for s in others)
        await anyio.sleep(2.5)  # past the budget counted from the claim
        with pytest.raises(EpisodeDeadlineError):
            await claimed.exec("echo late")


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_claim_renews_a_wait_for_a_live_slot_still_in_progress(example_tasks) -> None:
    simulated = resolve_backend("simulated")
    task = example_tasks[0]
    async with Engine(limits=Limits(live_sandboxes=1), timeouts=Timeouts(slot=4.0)) as engine:
        holder = engine.launch(task, simulated)
        await holder.wait_started()
        pool = PrefetchPool(engine)
        pool.start(task, simulated, {})  # waits for the only slot
        await anyio.sleep(2.4)
        claimed = pool.claim(task, simulated, {})
        assert claimed is not None
        await anyio.sleep(2.0)  # 4.4 s after its launch: past the slot budget counted from there
        await holder.stop()
        await claimed.wait_started()  # the budget counts from the claim: it got the slot
        assert (await claimed.exec("echo ok")).exit_code == 0


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_claim_renews_a_start_in_progress(example_tasks) -> None:
    simulated = resolve_backend("simulated")
    task, slow = example_tasks[0], {"start_latency": 3.5}
    async with Engine(timeouts=Timeouts(episode=3.0)) as engine:
        pool = PrefetchPool(engine)
        pool.start(task, simulated, slow)
        await anyio.sleep(2.5)
        claimed = pool.claim(task, simulated, slow)
        assert claimed is not None
        # The start ends 3.5 s after its launch: past the episode budget counted from the launch,
        # within the one counted from the claim.
        await claimed.wait_started()
        assert (await claimed.exec("echo ok")).exit_code == 0


@pytest.mark.anyio
async def test_a_claim_meets_other_spellings_of_the_folder_and_refuses_a_changed_task(
    example_tasks, tmp_path, monkeypatch
) -> None:
    import shutil

    from shim.task_cache import load_task_cached

    simulated = resolve_backend("simulated")
    folder = tmp_path / "task"
    shutil.copytree(example_tasks[0].paths.task_dir, folder)
    monkeypatch.chdir(tmp_path)
    async with Engine() as engine:
        pool = PrefetchPool(engine)
        pool.start(load_task_cached("task"), simulated, {})  # relative, as a dataset may spell it
        assert pool.claim(load_task_cached(str(folder)), simulated, {}) is not None
        pool.start(load_task_cached(str(folder)), simulated, {})
        toml = folder / "task.toml"
        toml.write_text(toml.read_text() + "\n")  # the task changed after its sandbox was started ahead
        changed = load_task_cached(str(folder))
        assert pool.claim(changed, simulated, {}) is None
        assert pool.release().unused == 1


def test_accelerate_keeps_the_wrapped_samplers_generator_in_step() -> None:
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, SequentialSampler

    inner = _repeat_sampler(16, 2, 4, 1)
    loader = DataLoader(list(range(16)), batch_size=4, sampler=LookaheadSampler(inner))
    prepared = prepare_data_loader(loader, num_processes=2, process_index=0, put_on_device=False)
    assert prepared.synchronized_generator is inner.generator  # as for the bare RepeatSampler
    assert not hasattr(LookaheadSampler(SequentialSampler(range(4))), "generator")


# ── TRL's base step runs ahead with the start ───────────────────────────────


class _ExecLog:
    """Every simulated exec: (session, command, begin, end) on the monotonic clock; optionally failing some."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_first: str | None = None) -> None:
        import time

        from harbor_async.backends.simulated import SimulatedEnvironment

        self.calls: list[tuple[str, str, float, float]] = []
        self._fail = fail_first
        real = SimulatedEnvironment.exec

        async def exec_(sandbox, command, *args, **kwargs):
            begin = time.monotonic()
            if command == self._fail:
                self._fail = None
                raise RuntimeError("simulated base step failure")
            try:
                return await real(sandbox, command, *args, **kwargs)
            finally:
                self.calls.append((sandbox.session_id, command, begin, time.monotonic()))

        monkeypatch.setattr(SimulatedEnvironment, "exec", exec_)

    def of(self, session: str) -> list[tuple[str, float, float]]:
        return [(command, begin, end) for s, command, begin, end in self.calls if s == session]


def _ahead_then_reset(env, task_dir: str) -> str:
    """Start ``task_dir``'s sandbox ahead, reset onto it, run one tool call; the claimed sandbox's id."""
    from shim import prefetch

    assert prefetch.prefetch(env, [task_dir]) == 1
    env.reset(task_dir=task_dir)  # at once: the base step ahead may still be running
    assert env.bash("ls /workdir") == "(empty output, rc=0)"
    assert prefetch.release().hits == 1
    return env.episode_record.sandbox


@pytest.mark.parametrize("fail_ahead", [False, True])
def test_a_reset_onto_a_sandbox_started_ahead_skips_the_base_step_that_ran_ahead(
    monkeypatch, example_tasks, fail_ahead: bool
) -> None:
    """With prefetch, the first tool round must not wait one exec round trip for TRL's mkdir: it ran with the start.

    If that step failed ahead, the reset runs it itself (and the tool call still works).
    """
    import shim
    from harbor_async.harnesses.base import BASE_SETUP_COMMAND

    log = _ExecLog(monkeypatch, fail_first=BASE_SETUP_COMMAND if fail_ahead else None)
    env = shim.HarborBashEnv("simulated", environment_kwargs={"start_latency": 0.05, "exec_latency": 0.2})
    try:
        session = _ahead_then_reset(env, str(example_tasks[0].paths.task_dir))
    finally:
        env.close()
    calls = log.of(session)
    assert [command for command, _, _ in calls] == [BASE_SETUP_COMMAND, "ls /workdir"]
    (_, _, base_end), (_, tool_begin, _) = calls
    assert base_end <= tool_begin  # the tool call waited for the step (ahead or the reset's own)


def test_a_harness_with_its_own_prepare_runs_it_whole_on_a_sandbox_started_ahead(monkeypatch, example_tasks) -> None:
    import shim
    from harbor_async.harnesses.base import BASE_SETUP_COMMAND

    class OwnPrepare(shim.HarborBashEnv):
        async def _prepare(self) -> None:
            await super()._prepare()

    log = _ExecLog(monkeypatch)
    env = OwnPrepare("simulated", environment_kwargs={"start_latency": 0.05})
    try:
        session = _ahead_then_reset(env, str(example_tasks[0].paths.task_dir))
    finally:
        env.close()
    # Ahead and again in its _prepare (the two may overlap: the order is not the point).
    assert sorted(command for command, _, _ in log.of(session)) == sorted([BASE_SETUP_COMMAND] * 2 + ["ls /workdir"])
