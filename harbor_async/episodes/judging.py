"""Where an episode's verifier runs, and what of its output comes back.

:func:`judge` collects the episode's artifacts and runs the verifier (of a
step) in the episode's own sandbox, or in a fresh one of the task's (or the
verifier's) environment when the task asks for a separate verifier.
:func:`verifier_output` reads the end of the test script's output back from
the sandbox when the verifier's own download did not bring it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from harbor_async.backends import enter_network_phase
from harbor_async.core.errors import Phase, SandboxError, VerifierFailure
from harbor_async.core.offload import off_loop
from harbor_async.core.policy import disk_full
from harbor_async.verification.reward_files import VERIFIER_OUTPUT_LIMIT

if TYPE_CHECKING:
    from harbor.models.task.config import StepConfig
    from harbor.models.task.task import Task

    from harbor_async.backends import BackendSpec
    from harbor_async.core.records import EpisodeRecord
    from harbor_async.core.results import VerifyResult
    from harbor_async.engine.engine import Engine
    from harbor_async.engine.sandbox import Sandbox

#: Where Harbor's verifier writes the test script's stdout and stderr, in the sandbox.
VERIFIER_OUTPUT_PATH = "/logs/verifier/test-stdout.txt"
#: Seconds granted to fetch the verifier's output from a sandbox after the verifier failed.
VERIFIER_OUTPUT_TIMEOUT = 10.0


class Episode(Protocol):
    """What judging reads of an episode (:class:`harbor_async.episodes.episode.Episode`, which imports this module)."""

    engine: Engine
    task: Task
    backend: BackendSpec
    backend_kwargs: dict[str, Any]
    sandbox: Sandbox | None
    record: EpisodeRecord
    judge_seconds: float  # the billed seconds of its separate verifiers' sandboxes, added to here

    @property
    def trial_folder(self) -> Path | None: ...


async def judge(episode: Episode, step: StepConfig | None = None) -> VerifyResult | None:
    """Collect ``episode``'s artifacts, then run the verifier (of ``step``): in its sandbox, or in a fresh one.

    ``None``: the engine runs no verifier (harbor run's ``--disable-verification``); the artifacts are
    collected all the same, as Harbor collects them, and the record says it was not judged.

    A separate verifier (``environment_mode = "separate"``) runs in a new
    sandbox of the task's environment, given the collected artifacts
    (:mod:`harbor_async.verification.artifacts`); it is stopped once it has judged.
    """
    from harbor_async.verification.artifacts import collect_artifacts, upload_artifacts
    from harbor_async.verification.verifier_env import separate_verifier, verifier_task

    sandbox = episode.sandbox
    assert sandbox is not None
    separate = separate_verifier(episode.task, step)
    root = episode.trial_folder
    if root is not None:
        folder: Path | None = root / "steps" / step.name / "artifacts" if step is not None else root / "artifacts"
    else:  # kept only for a separate verifier, in the sandbox's own (temporary) trial folder
        trial = sandbox.trial_dir
        folder = trial / "collected-artifacts" if separate and trial is not None else None
    if folder is not None:
        await sandbox.wait_started()
        await collect_artifacts(sandbox.environment, episode.task, folder, step)  # its manifest.json kept, as Harbor's
    logs = None if root is None else root / "steps" / step.name if step is not None else root
    if not episode.engine.verify:
        episode.record.verification_disabled = True
        if logs is not None and step is not None:
            await _keep_logs(sandbox.trial_dir, logs, ("agent",))
        return None
    if not separate:
        await enter_network_phase(sandbox.environment, episode.task, "verifier", step)
        try:
            return await sandbox.verify(step)
        finally:
            if logs is not None and step is not None:  # each step's agent and verifier logs, as Harbor keeps them
                await _keep_logs(sandbox.trial_dir, logs)
    task, tests_in_image = verifier_task(episode.task, step)  # the task's environment, or the verifier's own
    # No host mount: what the agent wrote through a writable one, or still writes, is not the judge's to read.
    judge_box = episode.engine.launch(task, episode.backend, backend_kwargs=episode.backend_kwargs, host_mounts=False)
    try:
        await judge_box.wait_started()
        if folder is not None:
            try:
                await upload_artifacts(judge_box.environment, task, folder, step)
            except OSError as exc:
                with anyio.CancelScope(shield=True):  # the walk decides whose failure this is: it finishes
                    outgrown = await off_loop(_outgrown, exc, folder, task)
                if outgrown is None:
                    raise
                raise VerifierFailure(Phase.VERIFY, task.name, judge_box.id, outgrown) from exc
        await enter_network_phase(judge_box.environment, task, "verifier", step)
        return await judge_box.verify(step, tests_in_image=tests_in_image)
    finally:
        if logs is not None:  # the verifier's output is the judge's, in its own trial folder
            await _keep_logs(judge_box.trial_dir, logs, ("verifier",))
            if step is not None:
                await _keep_logs(sandbox.trial_dir, logs, ("agent",))
        await judge_box.stop()
        episode.judge_seconds += judge_box.sandbox_seconds


async def _keep_logs(trial_dir: Path | None, logs: Path, only: tuple[str, ...] | None = None) -> None:
    """:func:`~harbor_async.jobs.harbor_layout.keep_trial_logs` in a worker thread (it moves, copies and walks)."""
    from harbor_async.jobs.harbor_layout import keep_trial_logs

    kwargs = {} if only is None else {"only": only}
    with anyio.CancelScope(shield=True):  # in a finally: a cancelled caller still keeps them, then stops its judge
        await off_loop(functools.partial(keep_trial_logs, trial_dir, logs, **kwargs))


def _outgrown(exc: OSError, folder: Path, task: Task) -> str | None:
    """Why a judge ran out of space because of what the agent left, on host-side evidence; else ``None``.

    The evidence: the artifacts collected on the host are larger (apparent size,
    sparse files count in full) than the judge's whole ``storage_mb``. A judge
    that runs out of space for less is not the agent's doing: infrastructure.
    """
    storage_mb = task.config.environment.storage_mb
    if not disk_full(exc) or storage_mb is None:
        return None
    size = sum(entry.stat().st_size for entry in folder.rglob("*") if entry.is_file() and not entry.is_symlink())
    if size <= storage_mb * 1024 * 1024:
        return None
    return (
        f"the artifacts the agent left ({size / 2**20:.0f} MiB) do not fit the verifier's environment "
        f"({storage_mb} MB): {exc}"
    )


def stdout_came_back(episode: Episode) -> bool:
    """Whether the verifier's download put the test's stdout file in ``episode``'s sandbox's trial folder."""
    from harbor.models.trial.paths import TrialPaths

    trial = None if episode.sandbox is None else episode.sandbox.trial_dir
    return trial is not None and os.path.lexists(TrialPaths(trial_dir=trial).test_stdout_path)


async def verifier_output(episode: Episode) -> str | None:
    """The end of the test script's stdout read from ``episode``'s sandbox, or ``None`` when there is none.

    Not where the verifier had folders of its own: the sandbox's are the agent's.
    """
    sandbox = episode.sandbox
    assert sandbox is not None
    if getattr(sandbox.environment, "verifier_scope", None) is not None:
        return None
    try:
        with anyio.fail_after(VERIFIER_OUTPUT_TIMEOUT):
            found = await sandbox.exec(
                f"tail -c {VERIFIER_OUTPUT_LIMIT} {VERIFIER_OUTPUT_PATH} 2>/dev/null",
                timeout=VERIFIER_OUTPUT_TIMEOUT,
                max_output=None,
            )
    except (SandboxError, TimeoutError, OSError):
        return None
    text = found.stdout if found.exit_code == 0 else None
    return text[-VERIFIER_OUTPUT_LIMIT:] if text else None
