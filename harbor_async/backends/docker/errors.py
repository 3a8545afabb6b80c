"""Harbor's docker errors, typed: the one place that reads what a failed ``docker compose`` call said.

Harbor's docker backend raises a bare ``RuntimeError`` whatever went wrong,
from one template (``Docker compose command failed for environment E.
Command: C. Return code: N. Stdout: O. Stderr: S.``). The engine's error
policy decides by type only, so a docker start's error is turned into one of
the types below here, and nowhere else:

1. the template's fields are read (:func:`compose_failure`): the compose
   subcommand that failed, its exit status and its output;
2. the exit status first: a compose process killed by a signal (a negative
   status) left output that says nothing about the task, so it is a
   :class:`DockerStartError`, worth another attempt, whatever it printed;
3. then the subcommand: a failed ``build`` is the task's image (never retried),
   an invalid task when the builder named the Dockerfile's own fault;
4. then the daemon's own words, each pattern a phrase the daemon, the
   registry (its error code, as ``code: message``, or its HTTP status) or the
   docker client prints, never a word a task, image or project name could
   hold (the output names them): :data:`NO_IMAGE`, :data:`REFUSED`.

Anything else is a :class:`DockerStartError` (a daemon hiccup, a network blip
to the registry), and an error not in Harbor's template passes through
unchanged. The tests hold the daemon's real messages for every pattern.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harbor_async.core.errors import BackendStartError, TaskDefinitionError

#: Harbor's template (``environments/docker/docker.py``, ``_run_docker_compose_command``).
_HARBOR_TEMPLATE = re.compile(
    r"\ADocker compose command failed for environment .*?\. Command: (?P<command>.*?)\. "
    r"Return code: (?P<code>-?\d+)\. Stdout: (?P<stdout>.*)\. Stderr: (?P<stderr>.*)\. \Z",
    re.S,
)
#: What follows the last compose file (``-f PATH``, a path that may hold spaces): the subcommand and its arguments.
_AFTER_FILES = re.compile(r".*\s-f\s.*?\.(?:ya?ml|json)\s(?P<rest>.*)", re.S)
#: Compose's global options that take a value (the subcommand is the first word that is neither).
_VALUED_OPTIONS = frozenset({"-p", "--project-name", "--project-directory", "-f", "--file", "--env-file", "--profile"})

#: The builder says the Dockerfile itself is wrong: an instruction, a COPY source that is not there (BuildKit's
#: ``dockerfile parse error on line N: ...`` and ``failed to compute cache key: ...: not found``, the legacy
#: builder's ``COPY failed: ...``). ``failed to create LLB definition`` wraps the Dockerfile frontend's errors.
DOCKERFILE = re.compile(
    r"dockerfile parse error|failed to create LLB definition|failed to compute cache key: [^\n]*\bnot found\b|"
    r"\bCOPY failed: ",
    re.I,
)
#: The image can neither be found on the host nor pulled: the daemon's ``No such image: X``, the registry's
#: ``pull access denied for X, repository does not exist ...``, its ``MANIFEST_UNKNOWN`` and ``NAME_UNKNOWN``
#: codes, and containerd's ``failed to resolve reference "X": X: not found`` (not its network errors, which
#: follow the same prefix: ``failed to resolve reference "X": failed to do request: ... i/o timeout``).
NO_IMAGE = re.compile(
    r"\bno such image: |\bpull access denied for |\brepository does not exist\b|\bmanifest unknown\b|"
    r"\bname unknown: |failed to resolve reference \"[^\"\n]*\": [^\s\"]+: not found\b",
    re.I,
)
#: The daemon refuses the container for a reason another attempt has too: credentials (the registry's
#: ``UNAUTHORIZED`` code, a 401 or 403 status, no credentials at all), the docker socket's permissions, an
#: image reference or a mount the daemon cannot take, a full disk or quota (the kernel's own words).
REFUSED = re.compile(
    r"\bunauthorized: |\bno basic auth credentials\b|"
    r"unexpected status from [A-Z]+ request to \S+: (?:401 Unauthorized|403 Forbidden)\b|"
    r"permission denied while trying to connect to the docker (?:daemon socket|api)\b|"
    r"\binvalid reference format\b|\binvalid mount config for type \"|error while creating mount source path '|"
    r"\bno space left on device\b|\bdisk quota exceeded\b",
    re.I,
)


class DockerStartError(BackendStartError):
    """A ``docker compose`` call of a start failed for a reason another attempt may not have (a daemon hiccup)."""

    transient = True


class DockerBuildError(DockerStartError):
    """The task's image failed to build: the Dockerfile is wrong, retrying builds it again in vain."""

    transient = False


class DockerfileError(DockerBuildError, TaskDefinitionError):
    """The task's Dockerfile cannot be built as written (the builder said so): an invalid task."""

    transient = False


class DockerImageError(DockerStartError):
    """The task's image is neither on the host nor pullable: retrying cannot find it."""

    transient = False


class DockerRefusedError(DockerStartError):
    """The daemon refused the container (credentials, an invalid image reference or mount, quota, a full disk)."""

    transient = False


@dataclass(frozen=True)
class ComposeFailure:
    """The fields of Harbor's failed-compose error.

    Attributes:
        subcommand: the compose subcommand that failed (``build``, ``up``, ``down``...; ``""`` if not found).
        return_code: compose's exit status (negative: killed by that signal).
        output: what it printed (Harbor merges stderr into stdout).
    """

    subcommand: str
    return_code: int
    output: str

    @property
    def killed(self) -> bool:
        """Whether compose was killed by a signal (its output cut short: no verdict on the task)."""
        return self.return_code < 0


def compose_failure(exc: BaseException) -> ComposeFailure | None:
    """The fields of ``exc`` when it is Harbor's failed-compose ``RuntimeError``, else ``None``."""
    if type(exc) is not RuntimeError:
        return None
    found = _HARBOR_TEMPLATE.match(str(exc))
    if found is None:
        return None
    output = "\n".join(part for part in (found["stdout"], found["stderr"]) if part and part != "None")
    return ComposeFailure(_subcommand(found["command"]), int(found["code"]), output)


def _subcommand(command: str) -> str:
    """The compose subcommand of Harbor's command line (``docker compose [options] SUBCOMMAND ...``)."""
    after = _AFTER_FILES.match(command)
    words = (after["rest"] if after else command.partition(" compose ")[2]).split()
    while words and words[0].startswith("-"):  # a global option, with its value if it takes one
        words = words[2:] if words[0] in _VALUED_OPTIONS else words[1:]
    return words[0] if words else ""


def start_error_type(failure: ComposeFailure) -> type[DockerStartError]:
    """The type of a failed compose call of a start, from its exit status, its subcommand and its output."""
    if failure.killed:
        return DockerStartError
    if failure.subcommand == "build":
        return DockerfileError if DOCKERFILE.search(failure.output) else DockerBuildError
    if NO_IMAGE.search(failure.output):
        return DockerImageError
    if REFUSED.search(failure.output):
        return DockerRefusedError
    return DockerStartError


#: Where the daemon, the registry or the client names the image a pull was for (the image in group 1, or the
#: registry host, path and tag of a manifest request in groups 2-4).
_PULLED = re.compile(
    r'failed to resolve reference "([^"\n]+)"|\bpull access denied for ([^,\s]+)|\bmanifest for (\S+) not found|'
    r"\bno such image: (\S+)|unable to get image '([^'\n]+)'|"
    r"request to https?://([^/\s]+)/v2/(\S+?)/manifests/([^:\s]+)",
    re.I,
)


def pulled_image(output: str) -> str | None:
    """The image a failed pull named in ``output`` (``registry/path:tag`` from a manifest request), else ``None``."""
    found = _PULLED.search(output)
    if found is None:
        return None
    host, path, tag = found.group(6, 7, 8)
    if host is not None:
        return f"{host}/{path}:{tag}"
    return next(group for group in found.groups()[:5] if group)


def typed_start_error(exc: BaseException) -> BaseException:
    """The typed error for a failed docker start (chained to ``exc``), or ``exc`` itself when it is not one.

    Where the output names the image a pull was for, the message's first line
    says which image could not be had and the daemon's words for why; the
    whole of Harbor's message follows.
    """
    failure = compose_failure(exc)
    if failure is None:
        return exc
    image = pulled_image(failure.output)
    message = str(exc)
    if image is not None:
        said = next((line.strip() for line in failure.output.splitlines() if image.split("/")[-1] in line), "")
        message = f"image {image} could not be pulled: {said[:300]}\n{message}"
    error = start_error_type(failure)(message)
    error.__cause__ = exc
    return error
