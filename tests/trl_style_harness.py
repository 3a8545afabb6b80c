"""A harness written for TRL, unchanged: it subclasses ``trl.experimental.harbor.HarborEnv``.

Used by tests/test_trainer_harness.py through ``shim.HarborSpec(agent="tests/trl_style_harness.py:NotesHarness")``:
nothing here knows about the shim.
"""

from trl.experimental.harbor import HarborEnv


class NotesHarness(HarborEnv):
    """Two tools on ``_exec``: run a command, submit an answer; ``_setup`` leaves a marker file."""

    PROMPT_SUFFIX = "\n\nUse `run` to look around and `submit` to give the final answer."

    def __init__(self, environment_type: str = "docker"):
        super().__init__(environment_type)
        self.calls = 0

    def run(self, command: str) -> str:
        """
        Run a shell command in the sandbox.

        Args:
            command: The shell command to run.

        Returns:
            The command's combined stdout and stderr.
        """
        self.calls += 1
        return self._exec(command)

    def submit(self, answer: str) -> str:
        """
        Submit the final answer.

        Args:
            answer: The answer.

        Returns:
            A confirmation.
        """
        self.calls += 1
        return self._exec(f"printf '%s' '{answer}' > /workdir/answer.txt && cat /workdir/.harness")

    async def _setup(self) -> None:
        await self._env.exec("echo harness-ready > /workdir/.harness")
