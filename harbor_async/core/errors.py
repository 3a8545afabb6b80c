"""Typed errors raised by the engine.

Every sandbox error carries the phase it happened in, the task, the sandbox id
and the attempt number, so that a failure in a batch of hundreds of episodes
can be traced to one sandbox without reading logs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from harbor.environments.base import SandboxBuildFailedError


class Phase(StrEnum):
    """The lifecycle phases of a sandbox, each with its own time budget."""

    START = "start"
    EXEC = "exec"
    VERIFY = "verify"
    STOP = "stop"
    AGENT = "agent"


class HarborAsyncError(Exception):
    """Base class of every error this package raises on purpose."""


class LoopThreadError(HarborAsyncError, RuntimeError):
    """A blocking call was made from the loop thread itself (it would deadlock)."""


class TransferLimitError(HarborAsyncError, OSError):
    """A file transfer from a sandbox went past its bound (bytes, entries or depth); the host kept nothing past it.

    Attributes:
        path: the sandbox path being transferred.
        limit: the byte limit.
    """

    def __init__(self, path: str, limit: int, detail: str | None = None) -> None:
        what = detail or f"more than {limit / 2**20:g} MiB (apparent size: sparse files count in full)"
        super().__init__(f"transfer of {path!r} refused: {what}; raise the backend's transfer_limit_mb to allow it")
        self.path = path
        self.limit = limit

    def __reduce__(self):
        return (type(self), (self.path, self.limit))


class BackendError(HarborAsyncError, ValueError):
    """The backend name or import path cannot be resolved to a Harbor environment."""


class BackendStartError(HarborAsyncError, RuntimeError):
    """A backend failed to start a sandbox; raised by a backend's adapter from its library's untyped error.

    Attributes:
        transient: whether another attempt may work (a daemon hiccup) or not
            (a missing image, a failed build): read by the error policy.
    """

    transient: bool = True


class BackendThrottledError(BackendStartError):
    """The provider refused a create for its load, not for the sandbox: the start window halves.

    Transient: a later attempt, with fewer starts in flight, may be accepted.

    Attributes:
        retry_after: the seconds the provider asked the caller to wait, where it said.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then each error it was raised from (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or current.__context__


def throttle_in(exc: BaseException) -> BackendThrottledError | None:
    """The provider's rate-limit or quota answer that ``exc`` is, or was raised from (the first in its chain)."""
    return next((error for error in error_chain(exc) if isinstance(error, BackendThrottledError)), None)


def is_throttle(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a provider's rate-limit or quota answer."""
    return throttle_in(exc) is not None


class BackendRateLimitError(BackendThrottledError):
    """The provider's create rate was exceeded (an HTTP 429, a "rate limit" answer)."""


class BackendQuotaError(BackendThrottledError):
    """The provider's quota of sandboxes (concurrent, or per account) was reached."""


class BackendNotInstalledError(BackendError):
    """The backend's client package (a Harbor extra) is not installed: found before any sandbox starts.

    Attributes:
        install: the command that installs it.
    """

    def __init__(self, backend: str, package: str, install: str) -> None:
        super().__init__(f"backend {backend!r} needs the {package!r} package, which is not installed: {install}")
        self.install = install


class BackendOptionsError(BackendError):
    """Options (``--ek``, ``backend_kwargs``) the backend does not take, refused before any sandbox starts.

    Attributes:
        backend: the backend's name.
        unknown: the option names it does not take.
        valid: the names it takes (its own first).
        suggestions: unknown name -> the closest valid one.
        detail: the installed Harbor's own reason, for a value its schema refuses.
    """

    def __init__(
        self,
        backend: str,
        unknown: Sequence[str],
        valid: Sequence[str],
        suggestions: dict[str, str],
        *,
        detail: str = "",
    ) -> None:
        self.backend, self.unknown, self.valid = backend, list(unknown), list(valid)
        self.suggestions, self.detail = dict(suggestions), detail
        if unknown:
            names = ", ".join(
                repr(name) + (f" (did you mean {suggestions[name]!r}?)" if name in suggestions else "")
                for name in unknown
            )
            reason = f"backend {backend!r} has no option {names}"
        else:
            reason = f"backend {backend!r} refuses its options: {detail}"
        super().__init__(f"{reason}; its options: {', '.join(valid) or 'none'}")


class AsyncLibraryError(HarborAsyncError, RuntimeError):
    """A Harbor backend that only runs on asyncio was used under another async library."""


class SandboxError(HarborAsyncError):
    """A sandbox lifecycle phase failed.

    Attributes:
        phase: the lifecycle phase that failed.
        task: the task name.
        sandbox_id: the engine's id of the sandbox.
        start_attempt: the start attempt it happened in (1-based; only starts are retried).
    """

    kind = "failed"

    def __init__(
        self,
        phase: Phase,
        task: str,
        sandbox_id: str,
        detail: str = "",
        *,
        start_attempt: int = 1,
    ) -> None:
        self.phase = Phase(phase)
        self.task = task
        self.sandbox_id = sandbox_id
        self.detail = detail
        self.start_attempt = start_attempt
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"task {self.task!r}, sandbox {self.sandbox_id}"
        if self.start_attempt > 1:
            where += f", start attempt {self.start_attempt}"
        text = f"{self.phase.value} {self.kind} ({where})"
        return f"{text}: {self.detail}" if self.detail else text

    def __reduce__(self):  # keep the error picklable across processes
        return (
            _rebuild_sandbox_error,
            (type(self), self.phase, self.task, self.sandbox_id, self.detail, self.start_attempt),
        )


def _rebuild_sandbox_error(cls, phase, task, sandbox_id, detail, start_attempt):
    return cls(phase, task, sandbox_id, detail, start_attempt=start_attempt)


class SandboxTimeout(SandboxError, TimeoutError):
    """A phase ran past its own budget or past the episode deadline."""

    kind = "timed out"


class EpisodeDeadlineError(SandboxTimeout):
    """A phase was cut short, or not begun, because the episode deadline passed."""

    kind = "ran past the episode deadline"


class BackendExecTimeout(HarborAsyncError, TimeoutError, RuntimeError):
    """A backend's ``exec`` ran past its ``timeout_sec`` (raised by this project's backends).

    One timeout family: every timeout is a ``TimeoutError`` (this one, and
    :class:`SandboxTimeout` with :class:`EpisodeDeadlineError`, the engine's).
    Also a ``RuntimeError`` with the message Harbor's docker backend uses, so
    that code written for Harbor's backends treats it the same way.
    """

    def __init__(self, timeout_sec: float, stdout: str | None = None, stderr: str | None = None) -> None:
        super().__init__(f"Command timed out after {timeout_sec} seconds")
        self.timeout_sec = timeout_sec
        self.stdout = stdout
        self.stderr = stderr

    def __reduce__(self):
        return (type(self), (self.timeout_sec, self.stdout, self.stderr))


class StartError(SandboxError):
    """The sandbox could not be started (after any retries)."""


class TaskDefinitionError(HarborAsyncError, SandboxBuildFailedError):
    """What a backend found wrong in a task's environment definition (a Dockerfile line, a missing COPY source).

    Not the host's or the backend's failure: the start is not retried and the episode is ``invalid_task``.
    """


class InvalidTaskError(StartError):
    """The task cannot be started as written (its Dockerfile, a COPY source that is not there): ``invalid_task``."""


class ExecError(SandboxError):
    """A command could not be run in the sandbox (not a non-zero exit code)."""


class VerifyError(SandboxError):
    """The task's verifier could not produce a reward."""


class VerifierFailure(VerifyError):
    """The verifier ran but gave no valid reward, or ran past its budget: the episode scores 0.

    Attributes:
        output: the verifier's stdout and stderr (their tails), if any.
    """

    def __init__(self, *args: Any, output: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.output = output

    def __reduce__(self):
        return (_rebuild_verifier_failure, (self.phase, self.task, self.sandbox_id, self.detail, self.start_attempt, self.output))


def _rebuild_verifier_failure(phase, task, sandbox_id, detail, start_attempt, output):
    return VerifierFailure(phase, task, sandbox_id, detail, start_attempt=start_attempt, output=output)


class StopError(SandboxError):
    """The sandbox could not be stopped cleanly."""


class SandboxClosedError(SandboxError):
    """The sandbox was already stopped (or never started) when it was used."""

    kind = "unavailable"


class SandboxCancelledError(SandboxError):
    """The phase was cancelled before it finished (a stop, a superseded start, a signal): not a failure."""

    kind = "cancelled"


PHASE_ERRORS: dict[Phase, type[SandboxError]] = {
    Phase.START: StartError,
    Phase.EXEC: ExecError,
    Phase.VERIFY: VerifyError,
    Phase.STOP: StopError,
    Phase.AGENT: ExecError,
}



class EngineClosedError(HarborAsyncError, RuntimeError):
    """The engine is closing or closed and takes no new sandboxes."""

class ReaperError(HarborAsyncError, RuntimeError):
    """A sandbox could not be listed or removed."""

class JobFolderError(HarborAsyncError, OSError):
    """A job folder cannot be created, written or read."""

class SuiteNotFoundError(HarborAsyncError, FileNotFoundError):
    """The suite source is neither an existing local directory nor a reachable Hub dataset."""

class RegistryError(SuiteNotFoundError):
    """A Harbor registry dataset (``-d name@version``) that cannot be resolved or downloaded."""

class RegistryUnreachableError(RegistryError):
    """Harbor's registry (its service, or a ``--registry-url``) did not answer."""

class RegistryFileError(RegistryError):
    """A ``--registry-path`` file (or a ``--registry-url`` document) that cannot be read or is no Harbor registry."""

class UnknownDatasetError(RegistryError):
    """The registry has no such dataset, or not that version of it.

    Attributes:
        name: the dataset's name.
        version: the version asked for (``None``: the name itself is unknown).
        known: the dataset's versions (a version unknown), or registry names close to the name.
    """

    def __init__(self, message: str, name: str, version: str | None, known: Sequence[str]) -> None:
        super().__init__(message)
        self.name, self.version, self.known = name, version, list(known)

    def __reduce__(self):
        return (type(self), (str(self), self.name, self.version, self.known))

class EmptySuiteError(HarborAsyncError, ValueError):
    """The suite (or the selected part of it) holds no valid task.

    Attributes:
        root: the folder that was searched for task folders.
        invalid: the tasks that were found but failed validation, with reasons
            (:class:`harbor_async.tasks.suite.InvalidTask`).
    """

    def __init__(self, root: Path, invalid: Sequence[Any] = ()) -> None:
        self.root = root
        self.invalid = list(invalid)
        if self.invalid:
            reasons = "\n".join(f"  - {t.path.name}: {t.reason}" for t in self.invalid)
            msg = f"no valid task in suite {root}; {len(self.invalid)} invalid:\n{reasons}"
        else:
            msg = (
                f"no tasks found under {root} (expected <root>/tasks/<name>/task.toml "
                "or <root>/<name>/task.toml)"
            )
            if (root / "task.toml").is_file():
                msg += "; this folder is a single task: load it with load_task()"
        super().__init__(msg)

class TaskLoadError(HarborAsyncError, ValueError):
    """One task folder is not a valid Harbor task.

    Attributes:
        path: the task folder.
        reason: why it is invalid, in one line.
    """

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"invalid task {self.path}: {reason}")

    def __reduce__(self):  # keep it picklable (two-argument constructor)
        return (type(self), (self.path, self.reason))


class FailureClass(StrEnum):
    """Who a failed episode is blamed on; used alike by the shim, ``run``, ``eval``, the report and the cluster.

    - ``infrastructure``: the backend's start, exec or stop, or a sandbox limit;
    - ``verifier``: a missing or malformed reward file, a failing or timed-out test script;
    - ``agent``: the agent timed out or its harness failed;
    - ``model_server``: the policy's server failed (evaluation only);
    - ``cancelled``: the episode was interrupted (a signal, a superseded start);
    - ``invalid_task``: the task cannot be run as written (its Dockerfile, a COPY
      source that is not there): found only at its start, else refused up front.

    Infrastructure, model-server, cancelled and invalid-task failures leave the
    model unjudged (no reward, in no score), are rerun by a resume (an invalid
    task once it is fixed: it fails at once again otherwise, never retried) and
    make a command exit 1; verifier and agent failures are the model's episode,
    scored as the verifier says (0 when there is no reward).
    """

    INFRASTRUCTURE = "infrastructure"
    VERIFIER = "verifier"
    AGENT = "agent"
    MODEL_SERVER = "model_server"
    CANCELLED = "cancelled"
    INVALID_TASK = "invalid_task"

    @property
    def rerun(self) -> bool:
        """Whether a resume runs the episode again (the model was not judged)."""
        return self in _RERUN

    @property
    def scored(self) -> bool:
        """Whether the episode counts as the model's (scored 0 without a reward): the model was judged."""
        return not self.rerun


_RERUN = frozenset(
    {FailureClass.INFRASTRUCTURE, FailureClass.MODEL_SERVER, FailureClass.CANCELLED, FailureClass.INVALID_TASK}
)


class SettingError(HarborAsyncError, ValueError):
    """A configuration value out of its range.

    Attributes:
        name: the setting's name.
        value: the value given.
        requirement: what the value must be.
    """

    def __init__(self, name: str, value: Any, requirement: str) -> None:
        self.name, self.value, self.requirement = name, value, requirement
        super().__init__(f"{name} must be {requirement}, got {value!r}")

    def __reduce__(self):  # keep it picklable (three-argument constructor)
        return (type(self), (self.name, self.value, self.requirement))


class UnknownSettingError(HarborAsyncError, TypeError):
    """A name that is no setting (a typo, or a setting of another release): refused, never ignored.

    A ``TypeError``, as Python's own answer to an unexpected keyword argument.

    Attributes:
        name: the name given.
        known: the settings' names.
    """

    def __init__(self, name: str, known: Sequence[str] = ()) -> None:
        self.name, self.known = name, tuple(known)
        listed = f"; settings are: {', '.join(self.known)}" if self.known else ""
        super().__init__(f"unknown setting {name!r}{listed}")

    def __reduce__(self):
        return (type(self), (self.name, self.known))


class ResumeConflictError(HarborAsyncError, ValueError):
    """A setting given to a resume differs from the one the job was started with (its ``harbor-async.json``).

    Attributes:
        name: the setting's name.
        stored: the job's value.
        given: the value given now.
    """

    def __init__(self, name: str, stored: Any, given: Any) -> None:
        self.name, self.stored, self.given = name, stored, given
        super().__init__(
            f"the job was started with {name}={stored!r}, the resume was given {name}={given!r}: "
            "a resume runs the job as it was started (drop the setting, or start a new job)"
        )

    def __reduce__(self):
        return (type(self), (self.name, self.stored, self.given))


class LogSettingError(HarborAsyncError, ValueError):
    """A log level or format that does not exist (from a flag or the environment)."""


class EvalConfigError(HarborAsyncError, ValueError):
    """The evaluation's settings are inconsistent (no model, a missing API key, a bad glob...)."""


class HarnessError(HarborAsyncError, ValueError):
    """A harness (``-a``, ``agent=``) that cannot be loaded or has no usable tools."""


class AgentConfigError(HarborAsyncError, ValueError):
    """A Harbor agent (``-a``, ``-m``, ``--ak``) that is unknown, cannot be loaded or refuses its options."""


class ModelServerError(HarborAsyncError):
    """The policy's model server failed (unreachable, errors after retries, died): not the model's episode.

    Attributes:
        status: the HTTP status of the failed request, if it got one.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return (type(self), (str(self), self.status))


class ModelServerConfigError(ModelServerError):
    """The model server refused the request as misconfigured (a wrong key, model or URL): every episode would be.

    The episode is ``model_server`` (not judged); the run stops at once (:class:`ModelServerRefusedError`).
    """


class ModelServerDownError(HarborAsyncError, RuntimeError):
    """The model server failed ``failures`` episodes in a row: the evaluation stopped instead of scoring them.

    Attributes:
        url: the server's base URL.
        failures: episodes in a row that failed for it.
        cause: the last episode's error text (its first line names the status and the server's error).
        job_dir: the job folder, to resume once the server works.
    """

    def __init__(self, url: str, failures: int, cause: str, job_dir: Path) -> None:
        first = (cause or "no detail").strip().splitlines()[0][:300]
        super().__init__(f"model server {url} failed {failures} episodes in a row: {first}")
        self.url, self.failures, self.cause, self.job_dir = url, failures, cause, job_dir

    def __reduce__(self):
        return (type(self), (self.url, self.failures, self.cause, self.job_dir))


class ModelServerRefusedError(ModelServerDownError):
    """The model server refused a request as misconfigured (a wrong key, model or URL): the run stopped at once.

    Another episode would be refused the same way, so one is enough (see
    :class:`ModelServerConfigError`, the episode's error).
    """

    def __init__(self, url: str, cause: str, job_dir: Path) -> None:
        super().__init__(url, 1, cause, job_dir)
        first = (cause or "no detail").strip().splitlines()[0][:300]
        self.args = (f"model server {url} refused the run's requests: {first}",)

    def __reduce__(self):
        return (type(self), (self.url, self.cause, self.job_dir))


class InfrastructureBudgetError(HarborAsyncError, RuntimeError):
    """Too many sandboxes failed for infrastructure reasons: the run stops instead of scoring zeros.

    Attributes:
        cause: the last infrastructure error seen.
    """

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class SandboxLimitError(HarborAsyncError, ValueError):
    """A live-sandbox limit is below what the caller needs alive at once (it would wait on itself)."""


class PreflightError(HarborAsyncError, RuntimeError):
    """The backend could not start and stop one sandbox before the run: a configuration problem."""


# ── Outcomes the engine reaches itself, typed so that the error policy's table decides them ──────
# (harbor_async.core.policy.ERROR_POLICY): a caller raises or records one of these, and names no failure class


class EpisodeInterruptedError(HarborAsyncError):
    """The episode was interrupted before it finished (a signal, a cancelled batch): ``cancelled``, not judged."""

    def __init__(self, message: str = "the episode was interrupted before it finished") -> None:
        super().__init__(message)


class AgentSetupError(HarborAsyncError):
    """The agent's harness setup failed (its own code, a command it bounded itself, or the start budget): ``agent``.

    The harness is the model's side of the episode: scored 0 without a reward.
    Raised from the original error (its ``__cause__``).
    """


class NetworkPhaseError(HarborAsyncError):
    """The backend could not apply the task's network policy for a phase (no agent runs unconfined): ``infrastructure``.

    Raised from the backend's error (its ``__cause__``).
    """


class LaunchError(HarborAsyncError):
    """A sandbox's start could not be scheduled (an unknown backend, a closed engine): ``infrastructure``.

    Raised from the original error (its ``__cause__``).
    """


class EpisodeClosedError(SandboxClosedError, SandboxCancelledError):
    """The episode was closed, or ended, before its sandbox was ready: ``cancelled``, no one's failure.

    A :class:`SandboxClosedError` to a command that asks for the sandbox (it is not there).
    """


class FinalStepRewardError(VerifierFailure):
    """A multi-step task scored by its final step (``multi_step_reward_strategy = "final"``) whose final step has
    no reward: ``verifier``, scored 0."""

    def __reduce__(self):
        return (_rebuild_final_step_error, (self.phase, self.task, self.sandbox_id, self.detail, self.start_attempt, self.output))


def _rebuild_final_step_error(phase, task, sandbox_id, detail, start_attempt, output):
    return FinalStepRewardError(phase, task, sandbox_id, detail, start_attempt=start_attempt, output=output)


class VerifierPathError(HarborAsyncError):
    """A folder the verifier uses in the sandbox (``/tests``, ``/logs/verifier``) is not a folder there: the agent
    replaced it (a file, a dangling link). Raised by a backend; the sandbox turns it into a :class:`VerifierFailure`.

    Attributes:
        path: the sandbox path.
    """

    def __init__(self, path: str, detail: str = "") -> None:
        super().__init__(f"{path} in the sandbox is not a folder" + (f": {detail}" if detail else ""))
        self.path, self.detail = path, detail

    def __reduce__(self):
        return (type(self), (self.path, self.detail))
