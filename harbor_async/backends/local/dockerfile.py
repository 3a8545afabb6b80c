"""The subset of a Dockerfile the local backend honours without building an image.

``WORKDIR``, ``ENV``, ``COPY``/``ADD`` of build-context files and ``COPY <<EOF``
heredoc files are applied;
``FROM``, ``ARG``, ``LABEL`` and ``MAINTAINER`` are accepted silently; every
other instruction is collected in :attr:`DockerfileSpec.ignored` so that the
backend can name it in one warning. Only the final build stage counts.
``COPY --from`` (another stage's or image's files) cannot be honoured without a
build: :func:`unsupported_instructions` names it, and the run refuses the task.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from harbor.environments.base import SandboxBuildFailedError

from harbor_async.core.errors import TaskDefinitionError


@dataclass(frozen=True)
class CopyStep:
    """One COPY/ADD line: build-context sources (globs allowed) into ``dest``, or a heredoc's text."""

    line: int
    sources: tuple[str, ...]
    dest: str  # absolute sandbox path
    dest_is_dir: bool  # trailing "/" or several sources: copy *into* dest
    content: str | None = None  # COPY <<EOF /dest: the file's text (sources is empty)


@dataclass
class DockerfileSpec:
    """What the local backend takes from a Dockerfile's final stage."""

    workdir: str | None = None
    base_image: str | None = None  # the final stage's FROM image (a named stage resolved to its image)
    env: dict[str, str] = field(default_factory=dict)
    copies: list[CopyStep] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # "line N: INSTRUCTION ..."
    unsupported: list[str] = field(default_factory=list)  # "line N: COPY --from=..." (refused)


_SILENT = {"FROM", "ARG", "LABEL", "MAINTAINER"}
_HEREDOC = re.compile(r"<<-?([\"']?)([A-Za-z_]\w*)\1")
_VAR = re.compile(r"\\\$|\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")
_ARCHIVE = re.compile(r"\.(tar|tgz|tbz2?|txz|tar\.(gz|bz2|xz|zst))$")


def _expand(value: str, variables: dict[str, str]) -> str:
    """Expand ``$VAR``, ``${VAR}``, ``${VAR:-x}``, ``${VAR:+x}`` like a Dockerfile."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "\\$":
            return "$"
        current = variables.get(match.group(1) or match.group(4), "")
        if match.group(2) == "-":
            return current or match.group(3)
        if match.group(2) == "+":
            return match.group(3) if current else ""
        return current

    return _VAR.sub(substitute, value)


def _logical_lines(text: str) -> list[tuple[int, str, dict[str, str]]]:
    """(first line number, instruction, heredoc bodies by name): continuations joined, comments dropped."""
    raw = text.splitlines()
    result: list[tuple[int, str, dict[str, str]]] = []
    parts: list[str] = []
    start = 0
    index = 0
    while index < len(raw):
        line = raw[index].strip()
        index += 1
        # Docker drops comment lines even inside a continuation.
        if not line or line.startswith("#"):
            continue
        if not parts:
            start = index
        if line.endswith("\\"):
            parts.append(line[:-1].strip())
            continue
        parts.append(line)
        instruction = " ".join(p for p in parts if p)
        parts = []
        bodies: dict[str, str] = {}
        # A heredoc body (RUN <<EOF ... EOF) is data, not instructions.
        heredocs = _HEREDOC.finditer(instruction) if re.match(r"(?i)(RUN|COPY|ADD)\s", instruction) else ()
        for match in heredocs:
            body = []
            while index < len(raw) and raw[index].strip() != match.group(2):
                body.append(raw[index].lstrip("\t") if match.group(0).startswith("<<-") else raw[index])
                index += 1
            index += 1
            bodies[match.group(2)] = "".join(f"{b}\n" for b in body)
        result.append((start, instruction, bodies))
    if parts:
        result.append((start, " ".join(p for p in parts if p), {}))
    return result


def _env_pairs(rest: str) -> list[tuple[str, str]]:
    """``ENV a=1 b="2 3"`` or the legacy ``ENV a 1 2``."""
    tokens = shlex.split(rest)
    if tokens and "=" in tokens[0]:
        return [(t.partition("=")[0], t.partition("=")[2]) for t in tokens]
    key, value = (re.split(r"\s+", rest.strip(), maxsplit=1) + [""])[:2]
    return [(key, " ".join(shlex.split(value)))]


def parse_dockerfile(text: str, base_env: dict[str, str] | None = None) -> DockerfileSpec:
    """Read WORKDIR, ENV and COPY/ADD from the Dockerfile's final stage.

    ``base_env`` seeds variable expansion (``ENV PATH=/x:$PATH``).

    Raises:
        SandboxBuildFailedError: a line cannot be parsed (unbalanced quotes ...).
    """
    spec = DockerfileSpec()
    args: dict[str, str] = {}
    stages: dict[str, str | None] = {}  # stage name -> its image
    outer: dict[str, str] | None = None  # ARGs declared before the first FROM
    for number, line, bodies in _logical_lines(text):
        keyword, rest = (re.split(r"\s+", line, maxsplit=1) + [""])[:2]
        keyword = keyword.upper()
        variables = {**(base_env or {}), **args, **spec.env}
        try:
            if keyword == "FROM":  # a new stage: only the last one is the image
                words = [w for w in shlex.split(rest) if not w.startswith("--")]
                if outer is None:  # the ARGs before the first FROM are every FROM line's to use
                    outer = dict(args)
                image = _expand(words[0], {**(base_env or {}), **outer}) if words else None
                image = stages.get(image.lower(), image) if image else None
                if len(words) >= 3 and words[1].upper() == "AS":
                    stages[words[2].lower()] = image
                spec, args = DockerfileSpec(base_image=image), {}
            elif keyword == "ARG":
                for token in shlex.split(rest):
                    name, has_value, value = token.partition("=")
                    if has_value:
                        args[name] = _expand(value, variables)
            elif keyword == "ENV":
                for key, value in _env_pairs(rest):
                    spec.env[key] = _expand(value, variables)
            elif keyword == "WORKDIR":
                path = _expand(rest, variables)
                spec.workdir = posixpath.normpath(posixpath.join(spec.workdir or "/", path))
            elif keyword in ("COPY", "ADD"):
                if re.search(r"(^|\s)--from[=\s]", rest):  # another stage's or image's files: needs a build
                    spec.unsupported.append(f"line {number}: {_short(line)}")
                elif (step := _copy_step(number, keyword, rest, variables, spec.workdir or "/", bodies)) is None:
                    spec.ignored.append(f"line {number}: {_short(line)}")
                else:
                    spec.copies.append(step)
            elif keyword not in _SILENT:
                spec.ignored.append(f"line {number}: {_short(line)}")
        except (ValueError, IndexError) as exc:
            raise TaskDefinitionError(f"Dockerfile line {number}: {line!r}: {exc}") from exc
    return spec


def _copy_step(
    number: int, keyword: str, rest: str, variables: dict[str, str], workdir: str, bodies: dict[str, str]
) -> CopyStep | None:
    """Parse a COPY/ADD line (not ``--from``); None when it cannot be honoured (URLs, archives)."""
    flags = re.match(r"((?:--\S+\s+)*)(.*)", rest, re.S)
    assert flags is not None  # the pattern matches every string
    body = flags.group(2).strip()
    heredoc = _HEREDOC.match(body)
    if heredoc is not None:  # COPY <<EOF /dest: a file written from the Dockerfile's own text
        if keyword != "COPY" or heredoc.group(2) not in bodies:
            return None
        dest = _expand(body[heredoc.end() :].strip(), variables)
        if not dest or len(shlex.split(dest)) != 1:
            return None
        text = bodies[heredoc.group(2)]
        content = text if heredoc.group(1) else _expand(text, variables)  # a quoted delimiter: no expansion
        return CopyStep(number, (), posixpath.normpath(posixpath.join(workdir, dest)), dest.endswith("/"), content)
    tokens = json.loads(body) if body.startswith("[") else shlex.split(body)
    tokens = [_expand(token, variables) for token in tokens]
    if len(tokens) < 2:
        raise ValueError(f"{keyword} needs a source and a destination")
    *sources, dest = tokens
    if keyword == "ADD" and any("://" in s or _ARCHIVE.search(s) for s in sources):
        return None  # ADD's URL fetching and archive extraction are not emulated
    is_dir = dest.endswith("/") or len(sources) > 1
    dest = posixpath.normpath(posixpath.join(workdir, dest))
    return CopyStep(number, tuple(sources), dest, is_dir)


def unsupported_instructions(dockerfile: Path) -> list[str]:
    """What in the task's environment the local backend cannot honour without a build (empty: nothing).

    ``COPY --from`` lines, and a ``docker-compose.yaml`` beside the Dockerfile
    (its other services). An unreadable Dockerfile is the start's to report.
    """
    found = []
    if (dockerfile.parent / "docker-compose.yaml").exists():
        found.append(_compose_refusal(dockerfile.parent))
    try:
        found += parse_dockerfile(dockerfile.read_text(encoding="utf-8")).unsupported
    except (OSError, UnicodeDecodeError, SandboxBuildFailedError):
        pass
    return found


def _compose_refusal(environment_dir: Path) -> str:
    """What the task's ``docker-compose.yaml`` asks for that one local sandbox cannot give, as it says it."""
    from harbor_async.backends.docker.overlay import task_services

    services = task_services(environment_dir)
    others = sorted(str(name) for name in services if name != "main")
    if others:
        return f"docker-compose.yaml (services besides the main one: {', '.join(others)})"
    main = services.get("main")
    keys = sorted(str(key) for key in main) if isinstance(main, dict) else []
    said = f"its settings of the main service: {', '.join(keys)}" if keys else "a Compose file"
    return f"docker-compose.yaml ({said}; a local sandbox runs the Dockerfile alone)"


def _short(line: str, limit: int = 70) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."
