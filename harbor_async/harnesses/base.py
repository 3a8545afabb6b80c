"""The harness protocol: what a tool harness needs from a sandbox, and what it gives the model.

A harness is a class whose public methods are the model's tools (listed as
TRL lists them, see :mod:`harbor_async.harnesses.toolset`), with a prompt
suffix appended to the task instruction and an optional ``_setup`` run once
the sandbox is up. It reaches its sandbox only through the current
:class:`~harbor_async.episodes.episode.Episode`:

- ``self._exec(command, timeout)``: run a command from a thread that is not the
  loop's (sync tools), get TRL's output text;
- ``await self._aexec(command, timeout)``: the same from async code and ``_setup``;
- ``self._env`` / ``self._task``: the live Harbor environment and the task.

``eval`` binds a harness to each episode (:meth:`Harness._bind`) and drives
it with a model; the shim's ``HarborEnv`` is a harness whose current episode
is the rollout TRL last reset. The bundled harnesses (``bash``, ``terminal``,
``python``) are plain harnesses here; the shim adds TRL's API to them.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harbor.environments.base import BaseEnvironment
    from harbor.models.task.task import Task

    from harbor_async.episodes.episode import Episode

#: Commands TRL's env runs after every start, before the harness setup.
BASE_SETUP_COMMAND = "mkdir -p /workdir /home/user/input"

#: Backends whose image build drops the Dockerfile's COPY'd files, so TRL's env
#: uploads them after the start (E2B's ``from_dockerfile``). Other backends
#: honour COPY, and the per-file uploads would only cost round trips.
BACKENDS_DROPPING_COPY = frozenset({"e2b"})


def command_error(command: object, timeout: object) -> str | None:
    """An error message for arguments of the wrong type (the model wrote them), else None."""
    if not isinstance(command, str):
        return f"Error: `command` must be a string, got {type(command).__name__}: {command!r}."
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        return f"Error: `timeout` must be a positive number of seconds, got {timeout!r}."
    return None


class Harness:
    """Base of every tool harness: tools run commands in the current episode's sandbox.

    Subclasses define the tools (public methods with type hints and a
    Google-style docstring), ``PROMPT_SUFFIX`` and, if needed, ``_setup``.
    Nothing public may be defined here: every public function is a tool.
    """

    #: Extra guidance appended to the task instruction.
    PROMPT_SUFFIX: str = ""
    #: The name records give the harness (default: the class name).
    NAME: str = ""

    _session: Episode | None = None

    def _bind(self, episode: Episode | None) -> None:
        """Make ``episode`` the one this harness's tools act on (``None``: unbind)."""
        self._session = episode

    def _current(self) -> Episode | None:
        """The episode the tools act on now."""
        return self._session

    @classmethod
    def _name(cls) -> str:
        return cls.NAME or cls.__name__

    def _prompt(self, task: Task) -> str:
        """What the model is first told: the task's instruction and the harness's suffix."""
        return task.instruction + self.PROMPT_SUFFIX

    def _exec(self, command: str, timeout: float | None = None) -> str:
        """Run a shell command in the sandbox; return combined stdout+stderr (cut at 8k).

        Callable from any thread except the episode's loop thread (use
        :meth:`_aexec` in async code and in ``_setup``). ``timeout`` (seconds,
        default the engine's exec budget) bounds the command alone. A command
        that times out, a sandbox that could not start and arguments of the
        wrong type return an ``"Error: ..."`` message for the model.
        """
        if (message := command_error(command, timeout)) is not None:
            return message
        episode = self._current()
        if episode is None:
            return "Error: no task is loaded; reset() must be called first."
        return episode.call(episode.exec_text, command, self._timeout(timeout))

    async def _aexec(self, command: str, timeout: float | None = None) -> str:
        """:meth:`_exec` for async tools and ``_setup``."""
        if (message := command_error(command, timeout)) is not None:
            return message
        episode = self._current()
        if episode is None:
            return "Error: no task is loaded; reset() must be called first."
        return await episode.call_async(episode.exec_text, command, self._timeout(timeout))

    def _timeout(self, timeout: float | None) -> float | None:
        return None if timeout is None else float(timeout)

    @property
    def _env(self) -> BaseEnvironment | None:
        """The live Harbor environment of the current episode (``None`` before it started)."""
        episode = self._current()
        return None if episode is None else episode.environment

    @property
    def _task(self) -> Task | None:
        """The Harbor task of the current episode."""
        episode = self._current()
        return None if episode is None else episode.task

    async def _setup(self) -> None:
        """Harness-specific sandbox preparation, run once per episode after the sandbox is up.

        Runs on the engine's loop (await, never block): use ``await
        self._aexec(...)`` or the Harbor environment ``self._env``. If it raises,
        the episode's tool calls return an error message and it scores 0.0.
        """

    async def _prepare(self) -> None:
        """TRL's steps after the start: COPY re-upload where needed, base folders, then ``_setup``.

        The engine's start already ran the task's healthcheck. A base step that
        cannot run raises (the sandbox is unusable).
        """
        episode = self._current()
        assert episode is not None and episode.sandbox is not None
        if episode.backend.type in BACKENDS_DROPPING_COPY:
            await self._upload_build_files()
        await episode.sandbox.exec(BASE_SETUP_COMMAND)
        await self._setup()

    async def _upload_build_files(self) -> None:
        """Replicate the task Dockerfile's ``COPY`` directives into the sandbox (TRL's E2B fix).

        The COPY lines are read by the project's Dockerfile parser (the local
        backend's); plain files are uploaded, as TRL does.
        """
        env, task = self._env, self._task
        if env is None or task is None:
            return
        dockerfile = task.paths.environment_dir / "Dockerfile"
        if not dockerfile.exists():
            return
        from harbor_async.backends.local.dockerfile import (
            parse_dockerfile,  # the project's one COPY parser
        )

        context = task.paths.environment_dir
        for step in parse_dockerfile(dockerfile.read_text()).copies:
            for src in step.sources:
                local = context / src
                if not local.is_file():  # globs and folders: as TRL, plain files only
                    continue
                remote = step.dest.rstrip("/") + "/" + Path(src).name if step.dest_is_dir else step.dest
                parent = remote.rsplit("/", 1)[0] or "/"
                tmp = "/tmp/" + uuid.uuid4().hex
                await env.upload_file(local, tmp)
                await env.exec(f"mkdir -p {parent} && mv {tmp} {remote}", user="root")
