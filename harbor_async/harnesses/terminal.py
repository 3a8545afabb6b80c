"""``terminal``: a terminal with background jobs and a notes toolkit (the shim's ``HarborTerminalEnv``).

Tools the model sees:

- ``run(command, timeout=60)``: run a shell command in the foreground and get
  its output (stdout and stderr merged, in order, as a terminal shows them),
  with ``[exit code: N]`` appended when it fails. The working folder carries
  over between calls (``cd`` sticks); shell variables do not. Past ``timeout``
  seconds (at most 600) the command is stopped.
- ``start_background(command, name)``: start a long-running command (a server,
  a training run, a watcher) in the background under a name; it keeps running
  between tool calls. Its output goes to a log.
- ``read_output(name, tail_lines=50)``: the job's status (running, or how it
  ended) and the last lines of its output.
- ``stop_background(name)``: stop the job and all its processes (SIGTERM, then
  SIGKILL after 3 s).
- ``list_background()``: every job with its status and command.
- ``write_note(title, text)`` / ``read_notes()``: a scratchpad that persists
  for the rollout; a note with the same title is replaced. Notes are files in
  ``/workdir/.notes/`` (one Markdown file per note).

The task is submitted by writing the answer to ``/workdir/answer.txt``; the
task's verifier reads it.

How it works: every tool is one command in the sandbox. Jobs run detached in
their own session (``setsid``), so they outlive the command that started them:
on the ``local`` backend sandboxes keep background processes between commands,
as Docker containers do. Each job has a folder
``/tmp/.harbor-terminal/jobs/<name>/`` holding ``command.sh``, ``pid``,
``output.log`` and, once it ended, ``status``. The working folder of ``run``
is kept in ``/tmp/.harbor-terminal/cwd``. Strings from the model (commands,
notes) reach the sandbox base64-encoded, so no quoting can break them.
"""

from __future__ import annotations

import base64
import hashlib
import re

from harbor_async.harnesses.base import Harness

#: Where the terminal keeps its state (the working folder, the jobs) in the sandbox.
TERMINAL_DIR = "/tmp/.harbor-terminal"
JOBS_DIR = f"{TERMINAL_DIR}/jobs"
#: Where notes live in the sandbox.
NOTES_DIR = "/workdir/.notes"
#: Longest foreground command ``run`` accepts, in seconds.
MAX_RUN_TIMEOUT = 600
#: Longest command or note text accepted (a command line carries it, base64-encoded).
MAX_TEXT = 60_000

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# A job's status, for the shell: how it ended, else running, else "ended".
_STATUS_FUNCTION = (
    '_status() { if [ -f "$1/status" ]; then cat "$1/status"; '
    'elif kill -0 "$(cat "$1/pid" 2>/dev/null)" 2>/dev/null; then echo "running (pid $(cat "$1/pid"))"; '
    'else echo "ended"; fi; }\n'
)

PROMPT_SUFFIX = (
    "\n\nYou have a terminal. `run` runs a shell command in the foreground and returns its output (the "
    "working folder carries over between calls). `start_background` starts a long-running command under a "
    "name; `read_output` shows its status and latest output, `stop_background` stops it and "
    "`list_background` lists the jobs. `write_note` and `read_notes` keep notes for yourself. Commands "
    "start in the task's working folder. **Submit your final answer by writing it to /workdir/answer.txt** "
    'with `run`, e.g. `echo -n "<value>" > /workdir/answer.txt`. Stating the answer in prose does NOT submit '
    "it; only writing the file counts. Keep the answer short, and do not end your turn without submitting."
)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _text_error(name: str, value: object, *, allow_empty: bool = False) -> str | None:
    if not isinstance(value, str):
        return f"Error: `{name}` must be a string, got {type(value).__name__}: {value!r}."
    if not allow_empty and not value.strip():
        return f"Error: `{name}` must not be empty."
    if len(value) > MAX_TEXT:
        return f"Error: `{name}` is too long ({len(value)} characters; at most {MAX_TEXT})."
    return None


def _name_error(name: object) -> str | None:
    if not isinstance(name, str) or not _NAME.match(name):
        return (
            f"Error: invalid job name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit."
        )
    return None


def _note_file(title: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60]
    if not slug:  # a title with no ASCII letters or digits
        slug = "note-" + hashlib.sha1(title.encode()).hexdigest()[:10]
    return f"{NOTES_DIR}/{slug}.md"


class TerminalHarness(Harness):
    """Harness with a terminal (``run``), background jobs and notes; submit by writing ``/workdir/answer.txt``."""

    PROMPT_SUFFIX = PROMPT_SUFFIX
    NAME = "terminal"

    # ── terminal ─────────────────────────────────────────────────────────

    def run(self, command: str, timeout: int = 60) -> str:
        """
        Run a shell command in the foreground and return its output (stdout and stderr merged, in order). A
        failing command ends with "[exit code: N]". The working folder carries over between calls (`cd` sticks);
        shell variables do not. For servers and other long-running programs use `start_background` instead.

        Args:
            command: The shell command to run.
            timeout: Seconds after which the command is stopped (at most 600).

        Returns:
            The command's output, with its exit code when it is not zero.
        """
        if (error := _text_error("command", command)) is not None:
            return error
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            return f"Error: `timeout` must be a positive number of seconds, got {timeout!r}."
        script = (
            f'exec 2>&1; __hd={TERMINAL_DIR}; mkdir -p "$__hd"\n'
            'if [ -s "$__hd/cwd" ]; then cd "$(cat "$__hd/cwd")" 2>/dev/null '
            '|| echo "(the folder $(cat "$__hd/cwd") is gone; running in $PWD)"; fi\n'
            f"{command}\n"
            '__rc=$?; pwd > "$__hd/cwd"; [ "$__rc" -eq 0 ] || echo "[exit code: $__rc]"; exit "$__rc"'
        )
        return self._exec(script, timeout=min(float(timeout), MAX_RUN_TIMEOUT))

    # ── background jobs ──────────────────────────────────────────────────

    def start_background(self, command: str, name: str) -> str:
        """
        Start a long-running shell command (a server, a long computation, a watcher) in the background under a
        name. It keeps running while you use other tools; its stdout and stderr go to a log that `read_output`
        shows. It starts in the current working folder of `run`.

        Args:
            command: The shell command to run in the background.
            name: A short name for the job (letters, digits, '_', '.', '-'), used by the other job tools.

        Returns:
            Whether the job started (with its pid), or its output if it ended at once.
        """
        if (error := _text_error("command", command) or _name_error(name)) is not None:
            return error
        job = f"{JOBS_DIR}/{name}"
        script = (
            f"d={job}\n"
            'if [ -f "$d/pid" ] && [ ! -f "$d/status" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; then\n'
            f'  echo "Error: background job \'{name}\' is already running (pid $(cat "$d/pid")); '
            'stop it first or pick another name."; exit 1\n'
            "fi\n"
            'rm -rf "$d" && mkdir -p "$d" || exit 1\n'
            f'if [ -s {TERMINAL_DIR}/cwd ]; then cd "$(cat {TERMINAL_DIR}/cwd)" 2>/dev/null; fi\n'
            f'printf %s {_b64(command)} | base64 -d > "$d/command.sh"\n'
            # Own session: it outlives this command, and stop_background ends its whole group.
            'runner=\'bash "$1/command.sh" > "$1/output.log" 2>&1 < /dev/null; '
            'echo "exited with code $?" > "$1/status"\'\n'
            "if command -v setsid > /dev/null; then\n"
            '  setsid sh -c "$runner" harbor-job "$d" > /dev/null 2>&1 < /dev/null &\n'
            "else\n"
            '  sh -c "$runner" harbor-job "$d" > /dev/null 2>&1 < /dev/null &\n'
            "fi\n"
            'echo $! > "$d/pid"\n'
            "sleep 0.3\n"
            'if [ -f "$d/status" ]; then\n'
            f'  echo "Background job \'{name}\' started and has already ended ($(cat "$d/status")). '
            'Its output:"\n'
            '  tail -n 20 "$d/output.log"\n'
            "else\n"
            f'  echo "Started background job \'{name}\' (pid $(cat "$d/pid")). '
            'Read its output with read_output; end it with stop_background."\n'
            "fi"
        )
        return self._exec(script, timeout=30)

    def read_output(self, name: str, tail_lines: int = 50) -> str:
        """
        Show a background job's status (running, or how it ended) and the last lines of its output.

        Args:
            name: The job's name, as given to `start_background`.
            tail_lines: How many of the last output lines to show (1 to 1000).

        Returns:
            The job's status line followed by the last lines of its output.
        """
        if (error := _name_error(name)) is not None:
            return error
        if isinstance(tail_lines, bool) or not isinstance(tail_lines, int) or tail_lines < 1:
            return f"Error: `tail_lines` must be a positive integer, got {tail_lines!r}."
        lines = min(tail_lines, 1000)
        script = (
            _STATUS_FUNCTION
            + f"d={JOBS_DIR}/{name}\n"
            + self._missing_job_check(name)
            + 'total=$(wc -l < "$d/output.log" 2>/dev/null || echo 0)\n'
            + f'echo "[job \'{name}\': $(_status "$d"); $total lines of output; the last {lines}:]"\n'
            + f'tail -n {lines} "$d/output.log" 2>/dev/null'
        )
        return self._exec(script, timeout=30)

    def stop_background(self, name: str) -> str:
        """
        Stop a background job and every process it started (SIGTERM, then SIGKILL if it is still running after
        3 seconds), and show the last lines of its output.

        Args:
            name: The job's name, as given to `start_background`.

        Returns:
            How the job ended and the last lines of its output.
        """
        if (error := _name_error(name)) is not None:
            return error
        script = (
            f"d={JOBS_DIR}/{name}\n" + self._missing_job_check(name) + 'if [ -f "$d/status" ]; then\n'
            f'  echo "Background job \'{name}\' had already ended ($(cat "$d/status")). '
            'The last lines of its output:"\n'
            '  tail -n 20 "$d/output.log"; exit 0\n'
            "fi\n"
            'pid=$(cat "$d/pid")\n'
            'kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null\n'
            "i=0\n"
            'while [ $i -lt 30 ] && { kill -0 -- "-$pid" 2>/dev/null || kill -0 "$pid" 2>/dev/null; }; do\n'
            "  sleep 0.1; i=$((i + 1))\n"
            "done\n"
            'if kill -0 -- "-$pid" 2>/dev/null || kill -0 "$pid" 2>/dev/null; then\n'
            '  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null; how=SIGKILL\n'
            "else how=SIGTERM; fi\n"
            '[ -f "$d/status" ] || echo "stopped by stop_background ($how)" > "$d/status"\n'
            f"echo \"Stopped background job '{name}' ($how). The last lines of its output:\"\n"
            'tail -n 20 "$d/output.log"'
        )
        return self._exec(script, timeout=30)

    def list_background(self) -> str:
        """
        List the background jobs started with `start_background`, with their status and command.

        Returns:
            One line per job: its name, its status and the start of its command.
        """
        script = (
            _STATUS_FUNCTION + "found=0\n" + f"for d in {JOBS_DIR}/*/; do\n"
            '  [ -f "$d/pid" ] || continue; found=1; d=${d%/}\n'
            '  printf "%s: %s; command: %s\\n" "$(basename "$d")" "$(_status "$d")" '
            '"$(head -n 1 "$d/command.sh" | cut -c 1-100)"\n'
            "done\n"
            '[ "$found" = 1 ] || echo "No background jobs."'
        )
        return self._exec(script, timeout=30)

    # ── notes ────────────────────────────────────────────────────────────

    def write_note(self, title: str, text: str) -> str:
        """
        Save a note for yourself (findings, a plan, intermediate results) to read back later with `read_notes`.
        A note with the same title is replaced.

        Args:
            title: The note's title.
            text: The note's text.

        Returns:
            Where the note was saved.
        """
        if (error := _text_error("title", title) or _text_error("text", text, allow_empty=True)) is not None:
            return error
        title = " ".join(title.split())
        path = _note_file(title)
        content = f"# {title}\n\n{text.rstrip()}\n"
        script = (
            f"mkdir -p {NOTES_DIR} || exit 1\n"
            f"if [ -f {path} ]; then echo replaced; else echo saved; fi\n"
            f"printf %s {_b64(content)} | base64 -d > {path}"
        )
        outcome = self._exec(script, timeout=30)
        verb = outcome.strip()
        if verb not in ("saved", "replaced"):
            return f"Error: the note could not be saved: {outcome}"
        return f"{'Saved' if verb == 'saved' else 'Replaced'} note {title!r} ({path})."

    def read_notes(self) -> str:
        """
        Read every note saved with `write_note`, oldest first.

        Returns:
            The notes, each with its title, separated by lines of dashes; or a message that there are none.
        """
        script = (
            f"if ls {NOTES_DIR}/*.md > /dev/null 2>&1; then\n"
            f'  for f in $(ls -tr {NOTES_DIR}/*.md); do cat "$f"; echo ---; done\n'
            'else echo "No notes yet."; fi'
        )
        return self._exec(script, timeout=30)

    # ── helpers ──────────────────────────────────────────────────────────

    @staticmethod
    def _missing_job_check(name: str) -> str:
        return (
            'if [ ! -f "$d/pid" ]; then\n'
            f"  echo \"Error: no background job named '{name}'. Jobs: "
            f'$(ls {JOBS_DIR} 2>/dev/null | tr "\\n" " ")"; exit 1\n'
            "fi\n"
        )
