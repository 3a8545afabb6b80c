"""``bash``: TRL's single-tool harness (the shim's ``HarborBashEnv``), with TRL's prompt text."""

from __future__ import annotations

from harbor_async.harnesses.base import Harness

PROMPT_SUFFIX = (
    "\n\nYou have a single `bash` tool: run a shell command in the sandbox and get its stdout+stderr. "
    "The dataset files are in /home/user/input/. Python 3 + pandas + numpy + scikit-learn are "
    "preinstalled. **Submit your final answer by writing it to /workdir/answer.txt via the `bash` "
    'tool**, e.g. `echo -n "<value>" > /workdir/answer.txt`. Stating the answer in prose does NOT submit '
    "it; only writing the file counts. Keep the answer short, and do not end your turn without submitting."
)


class BashHarness(Harness):
    """Single-`bash`-tool harness; submit by writing `/workdir/answer.txt`."""

    PROMPT_SUFFIX = PROMPT_SUFFIX
    NAME = "bash"

    def bash(self, command: str) -> str:
        """
        Run a shell command in the sandbox and return its combined stdout+stderr. The shell is non-stateful between
        calls. Use it to explore files (ls, head, cat), run Python (`python3 -c "..."`), and submit the answer (`echo
        -n "<value>" > /workdir/answer.txt`).

        Args:
            command: The shell command to run.

        Returns:
            The command's combined stdout and stderr.
        """
        return self._exec(command)
