"""Harbor's docker errors, typed: the one place that reads what a failed ``docker compose`` call said.

Harbor's docker backend raises a bare ``RuntimeError`` whatever went wrong
(``Docker compose command failed ... Command: ... Return code: ... Stderr: ...``).
The engine's error policy decides by type only, so a docker start's error is
turned into one of the types below here, from the failed subcommand and the
daemon's own words; anything else passes through unchanged.
"""

from __future__ import annotations

import re

from harbor_async.errors import BackendStartError, TaskDefinitionError

_COMPOSE_FAILURE = re.compile(r"^Docker compose command failed .*?Command: (?P<command>.*?)\. Return code: ", re.S)
#: What the daemon says when the image can neither be found locally nor pulled.
_NO_IMAGE = re.compile(
    r"no such image|pull access denied|manifest unknown|repository does not exist|"
    r"not found: manifest|failed to resolve reference",
    re.I,
)
#: What the builder says when the Dockerfile itself is wrong (an instruction, a COPY source that is not there).
_DOCKERFILE = re.compile(
    r"dockerfile parse error|unknown instruction|failed to create LLB definition|failed to compute cache key|"
    r"COPY failed",
    re.I,
)
#: What the daemon says when the task's or the host's configuration is wrong: another attempt fails the same way.
_REFUSED = re.compile(
    r"unauthorized|authentication required|permission denied|forbidden|invalid|quota|no space left", re.I
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
    """The daemon refused the container (credentials, an invalid option or mount, quota, a full disk)."""

    transient = False


def typed_start_error(exc: BaseException) -> BaseException:
    """The typed error for a failed docker start (chained to ``exc``), or ``exc`` itself when it is not one."""
    if type(exc) is not RuntimeError:
        return exc
    found = _COMPOSE_FAILURE.match(str(exc))
    if found is None:
        return exc
    words = found["command"].split()
    kind: type[DockerStartError] = DockerStartError
    if "build" in words:
        kind = DockerfileError if _DOCKERFILE.search(str(exc)) else DockerBuildError
    elif _NO_IMAGE.search(str(exc)):
        kind = DockerImageError
    elif _REFUSED.search(str(exc)):
        kind = DockerRefusedError
    error = kind(str(exc))
    error.__cause__ = exc
    return error
