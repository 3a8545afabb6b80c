"""Reward files read with bounds: what a sandbox wrote is hostile, and the reward is what it wants most.

Harbor's verifier downloads ``/logs/verifier`` into the trial folder and reads
``reward.txt`` or ``reward.json`` there. :class:`BoundedVerifier` is Harbor's
verifier with those two reads replaced: the file is opened without following a
symlink, must be a regular file of at most :data:`MAX_REWARD_FILE_BYTES`
(apparent size), and its content must be a reward:

- ``reward.txt``: one decimal number (``1``, ``0.5``, ``-2e-3``; no ``1_000``,
  ``inf`` or ``nan``);
- ``reward.json``: an object of at most :data:`MAX_REWARD_KEYS` string keys whose
  values are numbers (not booleans), nested at most :data:`MAX_JSON_DEPTH` deep
  while parsing, with integers of at most :data:`MAX_INTEGER_DIGITS` digits;
- every reward finite and within ``±MAX_REWARD_MAGNITUDE``.

Anything else raises :class:`InvalidRewardFileError`, a Harbor
``VerifierOutputParseError``: the verifier's failure (graded 0, never
"infrastructure"). Harbor itself accepts some of it (booleans, ``1_000``,
larger magnitudes); docs/backends.md lists the differences.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import stat
import weakref
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.models.trial.paths import EnvironmentPaths
from harbor.models.verifier.result import VerifierResult
from harbor.verifier.verifier import (
    RewardFileEmptyError,
    Verifier,
    VerifierOutputParseError,
)

#: Largest reward file read (bytes, apparent size: a sparse file counts in full).
MAX_REWARD_FILE_BYTES = 64 * 1024
#: Largest reward magnitude accepted.
MAX_REWARD_MAGNITUDE = 1e6
#: Most keys a reward.json may have.
MAX_REWARD_KEYS = 64
#: Deepest nesting of brackets a reward.json may have (an object of numbers needs 1).
MAX_JSON_DEPTH = 4
#: Most digits of an integer in a reward.json.
MAX_INTEGER_DIGITS = 16

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?")


class InvalidRewardFileError(VerifierOutputParseError):
    """A reward file that is no reward: too large, not a regular file, or not a bounded finite number."""


def read_bounded(path: Path) -> str:
    """The text of ``path``, opened without following a symlink, if it is a small regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidRewardFileError(f"{path.name}: cannot be opened as a plain file ({exc.strerror})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRewardFileError(f"{path.name} is not a regular file")
        if info.st_size == 0:
            raise RewardFileEmptyError(f"Reward file is empty at {path}")
        if info.st_size > MAX_REWARD_FILE_BYTES:
            raise InvalidRewardFileError(f"{path.name} has {info.st_size} bytes; at most {MAX_REWARD_FILE_BYTES}")
        data = os.read(fd, MAX_REWARD_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRewardFileError(f"{path.name} is not UTF-8 text") from exc


def _checked(name: str, value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRewardFileError(f"reward {name!r} is not a number: {type(value).__name__}")
    if not math.isfinite(value) or abs(value) > MAX_REWARD_MAGNITUDE:
        raise InvalidRewardFileError(f"reward {name!r} is outside ±{MAX_REWARD_MAGNITUDE:g}")
    return value


def parse_reward_text(text: str) -> dict[str, float | int]:
    """``reward.txt``: one decimal number."""
    word = text.strip()
    if not _NUMBER.fullmatch(word):
        raise InvalidRewardFileError(f"reward.txt does not hold one decimal number ({len(word)} characters)")
    return {"reward": _checked("reward", float(word))}


def _depth(text: str) -> int:
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _integer(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise InvalidRewardFileError(f"an integer of {len(digits)} digits in reward.json")
    return int(digits)


def _constant(name: str) -> float:
    raise InvalidRewardFileError(f"{name} in reward.json")


def parse_reward_json(text: str) -> dict[str, float | int]:
    """``reward.json``: an object of finite, bounded numbers."""
    if _depth(text) > MAX_JSON_DEPTH:
        raise InvalidRewardFileError(f"reward.json is nested deeper than {MAX_JSON_DEPTH}")
    try:
        rewards = json.loads(text, parse_int=_integer, parse_constant=_constant)
    except json.JSONDecodeError as exc:  # the one ValueError json.loads raises on a str
        raise InvalidRewardFileError(f"reward.json is not JSON: {exc.msg} at {exc.pos}") from exc
    if not isinstance(rewards, dict) or not rewards:
        raise InvalidRewardFileError("reward.json is not an object of rewards")
    if len(rewards) > MAX_REWARD_KEYS:
        raise InvalidRewardFileError(f"reward.json has {len(rewards)} keys; at most {MAX_REWARD_KEYS}")
    return {str(key): _checked(str(key)[:40], value) for key, value in rewards.items()}


class VerifierFolderResetError(VerifierOutputParseError):
    """The sandbox's verifier folder was not emptied before the tests: the reset failed, or its shell died first.

    What the sandbox left there would be read as the reward, so the tests do
    not run and the verdict is the verifier's failure (graded 0), as a
    malformed reward file is.
    """


#: Where the reset finds its tools whatever PATH the verifier's env sets.
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Per sandbox, the verifier users found not to be root (``None``: the image's own user).
_NOT_ROOT: weakref.WeakKeyDictionary[Any, set[str | int | None]] = weakref.WeakKeyDictionary()


class _ResettingEnvironment:
    """The sandbox as Harbor's verifier sees it: the verifier folder is emptied before the tests run.

    Harbor's ``verify`` uploads the tests, makes the test script executable as
    root (one exec), then runs it (another). Every rollout of a GRPO batch waits
    for its verdict, so the reset costs no round trip of its own: Harbor's
    ``chmod`` is held back and run with the reset at the start of the test's
    exec, when the test runs as root (the usual verifier user; an image's own
    user is checked in that exec, and remembered for the sandbox). For another
    user, the reset and the ``chmod`` are one exec as root before the test's.
    Either way the shell goes on only once the reset has printed that it
    finished, and the verdict fails unless it did. Everything else is the
    sandbox's own.
    """

    def __init__(self, environment: BaseEnvironment) -> None:
        self._environment = environment
        self._reset_pending = True
        self._chmod: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._environment, name)

    async def exec(self, command: str, *args: Any, user: str | int | None = None, **kwargs: Any) -> ExecResult:
        environment = self._environment
        if not self._reset_pending:
            return await environment.exec(command, *args, user=user, **kwargs)
        root = environment._reset_dirs_user()  # None where there is no root (Windows)
        if root is not None and self._chmod is None and user == root and command.startswith("chmod +x "):
            self._chmod = command  # Harbor's chmod of the test script, which it does not check
            return ExecResult(return_code=0, stdout="", stderr="")
        self._reset_pending = False
        if root is None:  # Harbor's own reset, as Harbor runs it there
            reset = environment._empty_dirs_command([self._verifier_dir()], chmod=True)
            _reset_finished(await environment.exec(reset, user=root), None)
            return await environment.exec(command, *args, user=user, **kwargs)
        done, not_root = _markers()
        prepare = self._prepare(done)
        runs_as = user if user is not None else environment.default_user
        if runs_as in (None, root, 0) and runs_as not in _NOT_ROOT.get(environment, ()):
            script = (
                f'if ( PATH={_SYSTEM_PATH}; [ "$(id -u)" = 0 ] ); then\n{prepare}\n{command}\n'
                f"else echo {not_root}; fi"
            )
            result = await environment.exec(script, *args, user=user, **kwargs)
            if not_root not in (result.stdout or ""):
                return _reset_finished(result, done)
            _NOT_ROOT.setdefault(environment, set()).add(runs_as)  # nothing ran
        _reset_finished(await environment.exec(prepare, user=root), done)
        return await environment.exec(command, *args, user=user, **kwargs)

    def _verifier_dir(self) -> Any:
        return EnvironmentPaths.for_os(self._environment.os).verifier_dir

    def _prepare(self, done: str) -> str:
        """The reset (Harbor's own ``empty_dirs`` command), then ``done`` printed, then Harbor's chmod.

        The tests must not run on a folder that was not emptied, so the shell
        stops where the reset fails; the chmod's result is not checked, as
        Harbor does not check it (a read-only test script may already be
        executable).
        """
        reset = self._environment._empty_dirs_command([self._verifier_dir()], chmod=True)
        lines = [f"( PATH={_SYSTEM_PATH}; {reset} ) || exit 1", f"echo {done}"]
        if self._chmod is not None:
            lines.append(self._chmod)
        return "\n".join(lines)


#: What the verifier's reset prints once the folder is empty (then a nonce): a backend that runs no shell (the
#: simulated one) prints it back for a command that has it.
RESET_DONE = "harbor-async-verifier-reset-done"


def _markers() -> tuple[str, str]:
    nonce = secrets.token_hex(8)
    return f"{RESET_DONE}-{nonce}", f"harbor-async-not-root-{nonce}"


def _reset_finished(result: ExecResult, done: str | None) -> ExecResult:
    """``result`` if the reset finished (``done`` printed; without a marker, exit code 0), else the error.

    A shell that died before the reset (killed, out of memory) printed nothing: the folder may hold what the
    agent left there, so the verdict fails rather than read it.
    """
    finished = done in (result.stdout or "") if done is not None else result.return_code == 0
    if not finished:
        output = (result.stderr or "").strip()[-500:]
        raise VerifierFolderResetError(
            f"the verifier folder reset did not finish (exit code {result.return_code}): {output}"
        )
    return result


class BoundedVerifier(Verifier):
    """Harbor's verifier, reading the reward files with bounds (see the module doc).

    Args:
        reset_verifier_dir: empty the sandbox's verifier folder (Harbor's
            ``empty_dirs``) after the tests are uploaded and before they run,
            so that nothing the agent left there is read as its reward: in the
            tests' own exec where they run as root, else in one exec with
            Harbor's ``chmod`` of the test script. Harbor's removal of the
            stale reward files there is then skipped (the trial folder's
            copies still go). A failed reset raises
            :class:`VerifierFolderResetError`, and the tests do not run.
            Every other argument is Harbor's.
    """

    environment: Any  # Harbor's (set by its __init__; Harbor ships no types)

    def __init__(self, *args: Any, reset_verifier_dir: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reset_verifier_dir = reset_verifier_dir

    async def verify(self) -> VerifierResult:
        if not self._reset_verifier_dir:
            return await super().verify()
        environment = self.environment
        self.environment = _ResettingEnvironment(environment)  # type: ignore[assignment]
        try:
            return await super().verify()
        finally:
            self.environment = environment

    async def _remove_reward_files(self) -> None:
        if not self._reset_verifier_dir:
            return await super()._remove_reward_files()
        # Its `rm -f` in a folder about to be emptied removes nothing the reset does not, and costs an exec round
        # trip on the reward's critical path.
        env_paths = EnvironmentPaths.for_os(self.environment.os)
        if not self.environment.is_path_mounted(env_paths.verifier_dir, self.trial_paths.verifier_dir):
            self.trial_paths.reward_text_path.unlink(missing_ok=True)
            self.trial_paths.reward_json_path.unlink(missing_ok=True)
        return None

    def _parse_reward_text(self) -> dict[str, float | int]:
        return parse_reward_text(read_bounded(self.trial_paths.reward_text_path))

    def _parse_reward_json(self) -> dict[str, float | int]:
        return parse_reward_json(read_bounded(self.trial_paths.reward_json_path))


#: Characters of verifier output kept (the end of each stream: where test failures are).
VERIFIER_OUTPUT_LIMIT = 20_000


def verifier_output(folder: Path) -> str | None:
    """The tails of ``test-stdout.txt`` and ``test-stderr.txt`` in a trial's verifier folder, read with bounds.

    What the sandbox wrote: never through a symlink (a host file), never a FIFO, only the last
    :data:`VERIFIER_OUTPUT_LIMIT` bytes of each.
    """
    parts = []
    for name in ("test-stdout.txt", "test-stderr.txt"):
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                continue
            size = info.st_size
            fh.seek(max(0, size - VERIFIER_OUTPUT_LIMIT))
            text = fh.read(VERIFIER_OUTPUT_LIMIT).decode(errors="replace")
        if text:
            parts.append(text if size <= VERIFIER_OUTPUT_LIMIT else "[...]\n" + text)
    return "\n".join(parts) if parts else None
