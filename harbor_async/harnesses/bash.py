"""``bash``: TRL's single-tool harness (the shim's ``HarborBashEnv``): TRL's tool, a prompt that claims nothing.

The tool (its name, arguments and description) is TRL's, so that a policy
trained through either sees the same schema. The prompt's suffix is TRL's
less its claim that Python 3 with pandas, numpy and scikit-learn is
preinstalled, which neither the bundled suite's image nor a local sandbox
has: a policy told so learns to call tools that are not there. (The dataset
files are in ``/home/user/input/``, as TRL's text says: the bundled suite's
tasks put them there, and the harness makes the folder.)
:data:`TRL_PROMPT_SUFFIX` is TRL's text, for a subclass that must match it.
"""

from __future__ import annotations

from harbor_async.harnesses.base import Harness

#: TRL's ``HarborBashEnv.PROMPT_SUFFIX``, word for word (it claims files and packages a sandbox may not have).
TRL_PROMPT_SUFFIX = (
    "\n\nYou have a single `bash` tool: run a shell command in the sandbox and get its stdout+stderr. "
    "The dataset files are in /home/user/input/. Python 3 + pandas + numpy + scikit-learn are "
    "preinstalled. **Submit your final answer by writing it to /workdir/answer.txt via the `bash` "
    'tool**, e.g. `echo -n "<value>" > /workdir/answer.txt`. Stating the answer in prose does NOT submit '
    "it; only writing the file counts. Keep the answer short, and do not end your turn without submitting."
)
#: TRL's text without the packages the sandbox does not promise.
PROMPT_SUFFIX = (
    "\n\nYou have a single `bash` tool: run a shell command in the sandbox and get its stdout+stderr. "
    "The dataset files are in /home/user/input/. Look before you assume a program is installed. "
    "**Submit your final answer by writing it to /workdir/answer.txt via the `bash` "
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
