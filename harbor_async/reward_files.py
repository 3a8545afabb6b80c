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
import stat
from pathlib import Path
from typing import Any

from harbor.verifier.verifier import RewardFileEmptyError, Verifier, VerifierOutputParseError

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
    except ValueError as exc:  # json.JSONDecodeError
        raise InvalidRewardFileError(f"reward.json is not JSON: {exc.msg} at {exc.pos}") from exc
    if not isinstance(rewards, dict) or not rewards:
        raise InvalidRewardFileError("reward.json is not an object of rewards")
    if len(rewards) > MAX_REWARD_KEYS:
        raise InvalidRewardFileError(f"reward.json has {len(rewards)} keys; at most {MAX_REWARD_KEYS}")
    return {str(key): _checked(str(key)[:40], value) for key, value in rewards.items()}


class BoundedVerifier(Verifier):
    """Harbor's verifier, reading the reward files with bounds (see the module doc).

    Args:
        verifier_dir_emptied: the caller emptied the sandbox's verifier folder
            just before (``Sandbox.verify`` does), so Harbor's removal of the
            stale reward files there is skipped; the trial folder's copies are
            still removed. Every other argument is Harbor's.
    """

    def __init__(self, *args: Any, verifier_dir_emptied: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verifier_dir_emptied = verifier_dir_emptied

    async def _remove_reward_files(self) -> None:
        if not self._verifier_dir_emptied:
            return await super()._remove_reward_files()
        # Its `rm -f` in a folder emptied a moment ago removes nothing, and costs an exec round trip on the
        # reward's critical path (every rollout of a GRPO batch waits for its verdict).
        from harbor.models.trial.paths import EnvironmentPaths

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
