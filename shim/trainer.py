"""``HarborGRPOTrainer``: TRL's ``GRPOTrainer`` with concurrent tool rounds, failed sandboxes out of the loss, env metrics.

Opt-in, one line::

    from shim import HarborGRPOTrainer, HarborSpec

    trainer = HarborGRPOTrainer(              # was: GRPOTrainer(
        model=..., args=GRPOConfig(...),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
    )

Three changes to a ``GRPOTrainer`` step, nothing else:

1. **Concurrent tool rounds.** TRL's ``_tool_call_loop`` calls the tools of
   one rollout after another; here each round's calls of *all* rollouts run at
   once on a thread pool (each thread blocks in the env's sync tool method,
   which waits on the shim's loop thread). A rollout's own calls stay in order,
   sync results before async ones, with TRL's ``{"error": ...}`` messages and
   failure counts: the messages, their order, the masks, the logprobs and the
   token accounting are GRPOTrainer's own: TRL's own loop runs unchanged, and
   each round's calls run ahead of it (see :mod:`shim.tool_rounds`). Tools passed as
   ``tools=`` (not env methods) are shared by all rollouts, so they must be
   thread-safe; ``tool_workers=1`` gives TRL's serial behaviour back.
   (TRL's ``AsyncGRPOTrainer`` needs none of this: its rollout worker already
   runs rollouts concurrently and sync tools on a thread pool, ``_tool_pool``.)
2. **Infrastructure failures out of the loss.** A rollout whose rewards are
   all ``None`` (TRL: NaN, already left out of its group's statistics and
   given advantage 0) or whose env reports ``infrastructure_failure`` gets its
   completion mask (and tool mask) zeroed and the batch's token count
   recomputed, so neither the policy term, the KL term nor the token-count
   normalisation sees it; for the loss types that average over sequences
   (``grpo``, ``sapo``, ``luspo``, ``dr_grpo``) its rows are dropped before the
   loss, so the sequence count does not see it either. Counted and logged as
   ``harbor/infrastructure_failures``.
3. **Environment metrics** appended to the trainer's logs each generation
   batch (see :data:`METRIC_KEYS`): the seconds the trainer thread waited on
   environments (resets, tool rounds, rewards), the engines' start / exec /
   verify latency p50 and p99 (over the engine's life), new failures by phase,
   and live sandboxes.
4. **Prefetch** (opt-in, ``prefetch=True``): once a generation is scored,
   the next generation's rows are read from the sampler (see
   :mod:`shim.lookahead`) and their sandboxes started (see
   :mod:`shim.prefetch`), so the starts run while this step computes the loss
   and steps the optimiser, and the next one generates its first turn; the
   next step's resets claim them. Not earlier, during the verifiers: on a
   host where starts cost CPU (Docker, the local backend), starts launched
   beside the verifiers slowed them by about what they saved (measured in
   ``benchmarks/docker_step.py``). Unclaimed ones are stopped once those
   resets are in. It costs up to a second batch of live sandboxes at the step
   boundary, which a ``max_live_sandboxes`` limit bounds (starts ahead then
   queue for slots). Logged as ``env/prefetch_hits`` and ``env/prefetch_unused``.

Runs on the TRL releases CI trains it on (:data:`SUPPORTED_TRL`: the lowest
the range allows to the highest released); another version is refused with
:class:`UnsupportedTRLVersionError`. Nothing of TRL's is copied: it overrides
the trainer's own steps and calls them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, cast

import torch
import trl
from transformers.trainer_utils import IntervalStrategy
from trl import GRPOTrainer

from harbor_async.cli.machine_checks import SUPPORTED, in_range
from harbor_async.core.errors import HarborAsyncError
from harbor_async.core.logs import get_logger
from shim import engines, prefetch
from shim.env import HarborEnv
from shim.lookahead import TASK_COLUMN, GenerationLookahead, LookaheadSampler, task_key
from shim.prefetch import PrefetchCounts
from shim.tool_rounds import ToolCallsAhead, worker_threads

log = get_logger("harbor_async.shim")

#: The TRL releases HarborGRPOTrainer runs on: those of the range CI trains on (its lowest and highest), as for all
#: code that overrides TRL's private methods (``trl-internals``); a later release may change them.
SUPPORTED_TRL = SUPPORTED["trl-internals"]
#: Key of the per-row "failed for infrastructure reasons" flag in the trainer's generation batch.
FAILED_KEY = "harbor_infrastructure_failed"
#: Loss types that average over sequences: failed rows are dropped so the count of sequences excludes them.
ROW_AVERAGED_LOSSES = frozenset({"grpo", "sapo", "luspo", "dr_grpo"})
#: Default size of the tool-round thread pool (threads are made as rounds need them).
DEFAULT_TOOL_WORKERS = 256
#: Phases whose latency percentiles are logged.
LATENCY_PHASES = ("start", "exec", "verify")
#: Phases whose failures are logged.
FAILURE_PHASES = ("start", "exec", "verify", "stop")
#: Every metric this trainer adds to the logs (latencies only for phases with samples).
METRIC_KEYS = (
    "harbor/infrastructure_failures",
    "harbor/infrastructure_failure_frequency",
    "env/wait_s",
    "env/wait_reset_s",
    "env/wait_tools_s",
    "env/wait_rewards_s",
    "env/live_sandboxes",
    "env/start_window",
    "env/start_throttles",
    "env/sandbox_seconds",
    "env/cpu_seconds",
    "env/memory_peak_mb",
    *(f"env/{phase}_{q}_s" for phase in LATENCY_PHASES for q in ("p50", "p99")),
    *(f"env/failures/{phase}" for phase in FAILURE_PHASES),
)
#: Metrics added with ``prefetch=True`` (summed over processes): resets that claimed a sandbox started ahead,
#: and ones stopped unclaimed.
PREFETCH_METRIC_KEYS = ("env/prefetch_hits", "env/prefetch_unused")
#: Seconds ``train()`` waits for the loop to take back what was started ahead (the stops run in the background).
RELEASE_TIMEOUT = 30.0


class UnsupportedTRLVersionError(HarborAsyncError, RuntimeError):
    """The installed TRL is outside the releases ``HarborGRPOTrainer`` runs on (:data:`SUPPORTED_TRL`)."""

    def __init__(self, found: str) -> None:
        self.found = found
        self.supported = SUPPORTED_TRL
        super().__init__(
            f"HarborGRPOTrainer runs on TRL {SUPPORTED_TRL} (it drives GRPOTrainer's own tool loop); TRL {found} "
            f"is installed. Install 'trl{SUPPORTED_TRL}' or use GRPOTrainer with the shim's "
            "HarborSpec (serial tool rounds)."
        )


def check_trl_version(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTRLVersionError` unless ``version`` (default: TRL's) is within :data:`SUPPORTED_TRL`."""
    found = trl.__version__ if version is None else version
    if not in_range(found, SUPPORTED_TRL):
        raise UnsupportedTRLVersionError(found)


class HarborGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose tool rounds run all rollouts at once, with failed sandboxes kept out of the loss.

    Takes every ``GRPOTrainer`` argument, plus:

    Args:
        tool_workers: threads running a round's rollouts (default
            :data:`DEFAULT_TOOL_WORKERS`; more rollouts than threads queue).
            ``1`` runs them one after another, as TRL does.
        prefetch: start the next generation's sandboxes while the current step
            computes its loss and optimises (default ``False``). Needs a map-style
            dataset with a ``task_dir`` column and one environment factory of
            the shim's envs; otherwise it does nothing (with a warning when
            the dataset or the factories are why). Skipped for the run's last
            generation and before an evaluation.

    Raises:
        UnsupportedTRLVersionError: the installed TRL is outside :data:`SUPPORTED_TRL`.
    """

    # As GRPOTrainer sets them (transformers' Trainer types them wider: an optional model, TrainingArguments).
    model: torch.nn.Module
    args: trl.GRPOConfig

    def __init__(self, *args: Any, tool_workers: int | None = None, prefetch: bool = False, **kwargs: Any) -> None:
        check_trl_version()
        if tool_workers is not None and (isinstance(tool_workers, bool) or tool_workers < 1):
            raise ValueError(f"tool_workers must be a positive integer or None, got {tool_workers!r}")
        self._harbor_tool_workers = DEFAULT_TOOL_WORKERS if tool_workers is None else int(tool_workers)
        self._harbor_run_ahead = worker_threads(self._harbor_tool_workers)
        self._harbor_wait: dict[str, float] = defaultdict(float)
        self._harbor_batch_begin = time.perf_counter()
        self._harbor_rewards: torch.Tensor | None = None
        # Engines are shared per option set: count the failures from now on, not an earlier trainer's.
        seen = engine_snapshot()
        self._harbor_failures_seen: dict[str, int] = dict(seen["failures"])
        self._harbor_throttles_seen: int = seen["throttled"]
        self._harbor_usage_seen: dict[str, float] = {k: seen[k] for k in ("sandbox_seconds", "cpu_seconds")}
        self._harbor_prefetch = bool(prefetch)
        self._harbor_lookahead: GenerationLookahead | None = None
        self._harbor_next_tasks: list[Any] | None = None
        self._harbor_prefetch_counts: PrefetchCounts | None = None
        self._harbor_prefetch_warned = False
        super().__init__(*args, **kwargs)

    # ── concurrent tool rounds ───────────────────────────────────────────

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, *rest):
        """TRL's own loop, with each round's sync calls of every rollout run at once ahead of it (:mod:`shim.tool_rounds`)."""
        originals = self._sync_tool_dicts
        ahead = ToolCallsAhead(completions, originals, self._harbor_run_ahead)
        self._sync_tool_dicts = ahead.tool_dicts()
        try:
            with ahead:
                return super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, *rest)
        finally:
            self._sync_tool_dicts = originals
            self._harbor_wait["tools"] += ahead.waited

    # ── timing of the other environment calls ────────────────────────────

    def _generate(self, prompts: list):
        # GRPOTrainer resets every env (and builds the batch's env pool) between the start of
        # _generate_and_score_completions and this call: that span is the reset wait.
        if self._harbor_prefetch:
            # The resets are in (and claimed on the loop, in order): what is still parked was a wrong guess.
            # Evaluation releases too: parked sandboxes hold live slots its resets may be waiting for.
            self._harbor_prefetch_counts = prefetch.release()
        self._harbor_wait["reset"] += time.perf_counter() - self._harbor_batch_begin
        return super()._generate(prompts)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        begin = time.perf_counter()
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._harbor_wait["rewards"] += time.perf_counter() - begin
        self._harbor_rewards = rewards
        return rewards

    # ── prefetch ─────────────────────────────────────────────────────────

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if not self._harbor_prefetch:
            return sampler
        data = self.train_dataset if dataset is None else dataset
        key = task_key(data)
        if key is None or getattr(self, "_multi_environment", False):  # TRL < 1.16: one factory
            log.warning(
                "prefetch is off: it needs a `task_dir` column and a single environment factory",
                multi_environment=getattr(self, "_multi_environment", False),
            )
            self._harbor_prefetch_warned = True
            return sampler
        wrapped = LookaheadSampler(sampler)
        self._harbor_lookahead = GenerationLookahead(
            wrapped,
            key,
            global_batch=self.args.generation_batch_size,
            processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index,
            repeat=self.num_iterations * self.args.steps_per_generation,
        )
        return wrapped

    def _prefetch_next(self) -> None:
        """Start the next generation's sandboxes, unless none follows or an evaluation comes first."""
        tasks, self._harbor_next_tasks = self._harbor_next_tasks, None
        if not tasks or not self.model.training or any(t is None for t in tasks):
            return
        env = self.environments[0] if self.environments else None
        if not isinstance(env, HarborEnv) or not self._next_generation_comes_first():
            return
        prefetch.prefetch(env, [str(t) for t in tasks])

    def _next_generation_comes_first(self) -> bool:
        """Whether the run generates again after this generation, with no evaluation in between.

        This generation serves ``R`` micro-steps from the current one
        (``self._step``); an evaluation in between would stop the sandboxes
        started ahead (its resets may need their slots), so none are started.
        """
        accumulation = self.args.gradient_accumulation_steps
        serves = self.num_iterations * cast(int, self.args.steps_per_generation)  # micro-steps that reuse this generation (set by GRPOConfig)
        state = self.state
        into_step = self._step % accumulation
        if state.max_steps and (state.max_steps - state.global_step) * accumulation - into_step <= serves:
            return False  # it serves the run's last micro-steps
        strategy = self.args.eval_strategy
        if strategy == IntervalStrategy.EPOCH and self._harbor_lookahead is not None:
            return not self._harbor_lookahead.crossed_epoch
        if strategy == IntervalStrategy.STEPS and state.eval_steps:
            completed = range(state.global_step + 1, state.global_step + (into_step + serves) // accumulation + 1)
            return not any(g % state.eval_steps == 0 and self.args.eval_delay <= g for g in completed)
        return True

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._harbor_prefetch:
                self._release_prefetched()

    def _release_prefetched(self) -> None:
        """Stop what was started ahead when training ends, however it ends; never mask the run's own error."""
        try:
            prefetch.release(timeout=RELEASE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the engines' close stops them at exit anyway
            log.warning("could not stop the sandboxes started ahead", error=repr(exc))

    # ── failed sandboxes out of the loss ─────────────────────────────────

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._harbor_wait.clear()
        self._harbor_rewards = None
        self._harbor_prefetch_counts = None
        self._harbor_next_tasks = None
        if self._harbor_lookahead is not None and self.model.training:
            keys = [row.get(TASK_COLUMN) if isinstance(row, dict) else None for row in inputs]
            self._harbor_next_tasks = self._harbor_lookahead.next_keys(keys)
        elif self._harbor_prefetch and self.model.training and not self._harbor_prefetch_warned:
            # An iterable dataset has no sampler to read ahead from (_get_train_sampler is never called).
            self._harbor_prefetch_warned = True
            log.warning("prefetch is off: the training dataset has no sampler to read the next rows from")
        self._harbor_batch_begin = time.perf_counter()
        output = super()._generate_and_score_completions(inputs)
        failed = self._failed_rows(len(inputs), output["completion_mask"].device)
        mask_failed_rows(output, failed, self.accelerator.gather)
        self._log_env_metrics("train" if self.model.training else "eval", failed)
        self._prefetch_next()
        return output

    def _failed_rows(self, count: int, device: torch.device) -> torch.Tensor:
        """This process's rows that failed for infrastructure reasons (bool, shape ``(count,)``)."""
        failed = torch.zeros(count, dtype=torch.bool, device=device)
        rewards = self._harbor_rewards
        if rewards is not None and rewards.ndim == 2 and rewards.shape[1] > 0:
            start = self.accelerator.process_index * count  # rewards are gathered over processes
            failed |= torch.isnan(rewards[start : start + count]).all(dim=1).to(device)
        if self.environments:
            flags = [bool(getattr(env, "infrastructure_failure", False)) for env in self.environments]
            failed |= torch.tensor(flags, dtype=torch.bool, device=device)
        return failed

    def _compute_loss(self, model, inputs):
        failed = inputs.get(FAILED_KEY)
        if failed is None or not bool(failed.any()) or self.loss_type not in ROW_AVERAGED_LOSSES:
            return super()._compute_loss(model, inputs)  # masks alone exclude the rows from this loss
        if "pixel_values" in inputs:
            return super()._compute_loss(model, inputs)  # image rows cannot be cut per row; masks only
        if bool(failed.all()):
            # Nothing to learn from: a zero loss that still reaches every parameter (the backward needs a graph).
            return super()._compute_loss(model, inputs) * 0.0
        return super()._compute_loss(model, select_rows(inputs, ~failed))

    # ── metrics ──────────────────────────────────────────────────────────

    def _log_env_metrics(self, mode: str, failed: torch.Tensor) -> None:
        metrics = self._metrics[mode]
        device = failed.device
        n_failed = self.accelerator.gather(failed.sum()).sum().item()
        n_rows = self.accelerator.gather(torch.tensor(failed.numel(), device=device)).sum().item()
        metrics["harbor/infrastructure_failures"].append(float(n_failed))
        metrics["harbor/infrastructure_failure_frequency"].append(n_failed / n_rows if n_rows else 0.0)
        wait = self._harbor_wait
        for part in ("reset", "tools", "rewards"):
            metrics[f"env/wait_{part}_s"].append(wait[part])
        metrics["env/wait_s"].append(wait["reset"] + wait["tools"] + wait["rewards"])
        snapshot = engine_snapshot()
        metrics["env/live_sandboxes"].append(float(snapshot["live"]))
        metrics["env/start_window"].append(float(snapshot["start_window"]))
        metrics["env/start_throttles"].append(float(snapshot["throttled"] - self._harbor_throttles_seen))
        self._harbor_throttles_seen = snapshot["throttled"]
        # the sandboxes stopped since the last step: their billed and CPU seconds; the highest peak memory so far
        for part in ("sandbox_seconds", "cpu_seconds"):
            metrics[f"env/{part}"].append(snapshot[part] - self._harbor_usage_seen.get(part, 0.0))
            self._harbor_usage_seen[part] = snapshot[part]
        metrics["env/memory_peak_mb"].append(snapshot["memory_peak_bytes"] / 2**20)
        if self._harbor_lookahead is not None:  # prefetch on (and possible: the same on every process)
            counts = self._harbor_prefetch_counts or prefetch.PrefetchCounts()
            local = torch.tensor([counts.hits, counts.unused], dtype=torch.long, device=device)
            hits, unused = self.accelerator.gather(local).reshape(-1, 2).sum(dim=0).tolist()
            metrics["env/prefetch_hits"].append(float(hits))
            metrics["env/prefetch_unused"].append(float(unused))
        for key, value in snapshot["latency"].items():
            metrics[key].append(value)
        for phase in FAILURE_PHASES:
            total = snapshot["failures"].get(phase, 0)
            metrics[f"env/failures/{phase}"].append(float(total - self._harbor_failures_seen.get(phase, 0)))
            self._harbor_failures_seen[phase] = total


def mask_failed_rows(output: dict[str, Any], failed: torch.Tensor, gather: Any) -> None:
    """Zero the failed rows' completion and tool masks; recompute the token count; add :data:`FAILED_KEY`.

    ``num_items_in_batch`` is recomputed exactly as GRPOTrainer computes it
    (the gathered sum of ``completion_mask * tool_mask``), so it is unchanged
    when nothing failed.
    """
    keep = (~failed).to(output["completion_mask"].dtype).unsqueeze(1)
    output["completion_mask"] = output["completion_mask"] * keep
    loss_mask = output["completion_mask"]
    if output.get("tool_mask") is not None:
        output["tool_mask"] = output["tool_mask"] * keep.to(output["tool_mask"].dtype)
        loss_mask = loss_mask * output["tool_mask"]
    output["num_items_in_batch"] = gather(loss_mask.sum()).sum()
    output[FAILED_KEY] = failed


def select_rows(inputs: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
    """The micro-batch's rows where ``keep`` is true (tensors and lists of one entry per row; scalars as they are)."""
    rows = keep.numel()
    index = keep.nonzero(as_tuple=True)[0].tolist()
    selected: dict[str, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == rows:
            selected[key] = value[keep.to(value.device)]
        elif isinstance(value, list) and len(value) == rows:
            selected[key] = [value[i] for i in index]
        else:
            selected[key] = value
    return selected


def engine_snapshot() -> dict[str, Any]:
    """Live sandboxes, start windows, latency percentiles and failure totals by phase, over every engine the shim opened.

    Read on the loop thread, where the counters change. With several engines
    a percentile is the largest of theirs (percentiles do not add up).
    """
    empty: dict[str, Any] = {
        "live": 0, "start_window": 0, "throttled": 0, "latency": {}, "failures": {},
        "sandbox_seconds": 0.0, "cpu_seconds": 0.0, "memory_peak_bytes": 0,
    }  # fmt: skip
    if not engines.loop_running():
        return empty

    def read() -> list[Any]:
        return [engine.stats() for engine in engines.open_engines()]

    stats = engines.call(read)
    latency: dict[str, float] = {}
    failures: dict[str, int] = defaultdict(int)
    for snapshot in stats:
        for phase, summary in snapshot.phases.items():
            failures[phase] += summary.failures
            if phase in LATENCY_PHASES and summary.count:
                for q in ("p50", "p99"):
                    key = f"env/{phase}_{q}_s"
                    latency[key] = max(latency.get(key, 0.0), float(getattr(summary, q)))
    windows = [s.start_window.get("window") or 0 for s in stats if s.start_window is not None]
    return {
        "live": sum(s.live for s in stats),
        "start_window": sum(windows),  # 0: fixed starts (no window)
        "throttled": sum(s.throttled for s in stats),
        "sandbox_seconds": sum(s.sandbox_seconds for s in stats),
        "cpu_seconds": sum(s.cpu_seconds for s in stats),
        "memory_peak_bytes": max((s.memory_peak_bytes for s in stats), default=0),
        "latency": latency,
        "failures": dict(failures),
    }
