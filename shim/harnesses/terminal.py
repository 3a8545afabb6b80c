"""``HarborTerminalEnv``: the core terminal harness (:mod:`harbor_async.harnesses.terminal`) with TRL's API."""

from harbor_async.harnesses.terminal import (
    JOBS_DIR,
    MAX_RUN_TIMEOUT,
    MAX_TEXT,
    NOTES_DIR,
    PROMPT_SUFFIX,
    TERMINAL_DIR,
    TerminalHarness,
)
from shim.env import HarborEnv

__all__ = ["PROMPT_SUFFIX", "JOBS_DIR", "MAX_RUN_TIMEOUT", "MAX_TEXT", "NOTES_DIR", "TERMINAL_DIR", "HarborTerminalEnv"]


class HarborTerminalEnv(TerminalHarness, HarborEnv):
    """Harness with a terminal (``run``), background jobs and notes; submit by writing ``/workdir/answer.txt``."""
