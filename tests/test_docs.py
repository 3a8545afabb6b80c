"""The documentation names only commands and flags that exist, and keeps the README short.

Every ``harbor-async COMMAND ...`` in ``README.md`` and ``docs/`` (code blocks and
inline code) must be a command of the CLI, and every flag after it one of that
command's options; a flag written alone in backticks must be an option of some
command (or of a tool the docs name, listed below).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main

from harbor_async.cli import app
from harbor_async.cli.harbor_flags import REFUSED

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250


def _commands() -> dict[str, set[str]]:
    """Every command by its words (``run``, ``bench throughput``) with its options."""
    found: dict[str, set[str]] = {}

    def walk(prefix: str, command) -> None:
        options = {"--help"}
        for param in command.params:
            options.update(param.opts)
            options.update(param.secondary_opts)
        found[prefix] = options
        for name, sub in getattr(command, "commands", {}).items():
            walk(f"{prefix} {name}".strip(), sub)

    walk("", typer.main.get_command(app))
    return found


COMMANDS = _commands()
INVOCATION = re.compile(r"harbor-async((?:\s+[a-z][a-z-]*)+)((?:\s+[^`\n|#]*)?)")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
#: Flags of other tools the docs name (pytest, uv, pip, docker, vllm, torchrun, bwrap, ...).
OTHER_TOOLS = {
    "--no-config", "--all-extras", "--locked", "--rmi", "--volumes", "--pull", "--network", "--entrypoint",
    "--nproc_per_node", "--nproc-per-node", "--enable-auto-tool-choice", "--tool-call-parser", "--lora-modules",
    "--enable-lora", "--served-model-name", "--port", "--host", "--remove-orphans", "--unshare-user", "--uid",
    "--gid", "--proc", "--ro-bind", "--reuid", "--regid", "--clear-groups", "--no-deps", "--frozen",
    "--max-model-len", "--dtype", "--head", "--address", "--block", "--num-cpus", "--force-reinstall",
    "--resolution", "--debug", "--iptables",  # uv's; harbor run's (the mapping table)
} | {flag for spellings in REFUSED for flag in spellings}  # harbor run's flags we refuse (docs/cli.md's table of them)


def _code(text: str):
    """``(line number, code)``: lines of code blocks, and inline code spans elsewhere."""
    in_block = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            yield number, line
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span


def _invocations(text: str):
    """``(line, command, flags)`` for each ``harbor-async ...`` in code; the command is its longest known prefix."""
    for number, code in _code(text):
        for match in INVOCATION.finditer(code):
            words = match.group(1).split()
            rest = match.group(2) or ""
            while len(words) > 1 and " ".join(words) not in COMMANDS:
                rest = words.pop() + " " + rest
            yield number, " ".join(words), FLAG.findall(re.sub(r"\"[^\"]*\"|'[^']*'", "", rest))  # not in quoted values


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_named_command_and_flag_exists(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    wrong = []
    for number, command, flags in _invocations(text):
        if command not in COMMANDS:
            wrong.append(f"{page.name}:{number}: no command `harbor-async {command}`")
            continue
        wrong += [f"{page.name}:{number}: `harbor-async {command}` has no {f}" for f in flags if f not in COMMANDS[command]]
    every = set().union(*COMMANDS.values())
    for number, line in enumerate(text.splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            token = span.split()[0].split("=")[0] if span.startswith("-") else None
            if token and FLAG.fullmatch(token) and token not in every and token not in OTHER_TOOLS:
                wrong.append(f"{page.name}:{number}: no command has the flag {token}")
    assert wrong == []


def test_the_walker_finds_what_is_wrong() -> None:
    found = list(_invocations("`harbor-async run -p x --no-such-flag` or `harbor-async nope`, harbor-async keeps"))
    assert found == [(1, "run", ["-p", "--no-such-flag"]), (1, "nope", [])]
    assert list(_invocations("`harbor-async bench throughput -e local`")) == [(1, "bench throughput", ["-e"])]
    assert "--no-such-flag" not in COMMANDS["run"] and "-p" in COMMANDS["run"]


def test_the_readme_is_short_and_links_every_page() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n") <= README_MAX_LINES
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, page.name


def test_the_version_table_states_pyprojects_ranges() -> None:
    """docs/install.md's table of supported versions says what pyproject.toml promises, package by package."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {"python": project["requires-python"]}
    for line in [*project["dependencies"], *(d for ds in project["optional-dependencies"].values() for d in ds)]:
        requirement = Requirement(line)
        if requirement.specifier and requirement.name != "harbor-async":
            declared[requirement.name.lower()] = str(requirement.specifier)
    table = (REPO / "docs" / "install.md").read_text(encoding="utf-8").split("| package | range |", 1)[1]
    checked = 0
    for row in table.split("\n\n", 1)[0].splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = [n.strip().lower() for n in cells[0].split(",")]
        ranges = [r.strip() for r in re.sub(r"\([^)]*\)", "", cells[1]).split(", ")]
        if names == ["torch"]:
            continue  # no dependency of ours: "what your TRL requires"
        assert len(names) == len(ranges), row
        for name, stated in zip(names, ranges, strict=True):
            assert name in declared, f"{name} is in the table but not in pyproject.toml"
            assert sorted(stated.split(",")) == sorted(declared[name].split(",")), f"{name}: {stated} vs {declared[name]}"
            checked += 1
    assert checked >= 10


def test_the_architecture_page_names_every_module() -> None:
    """The module map of docs/architecture.md lists every module and folder of the two packages."""
    import re

    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    mapped = page[: page.index("```\n", page.index("```\nharbor_async/") + 4)]
    for package in ("harbor_async", "shim"):
        for entry in sorted((root / package).iterdir()):
            name = entry.name if entry.is_dir() else entry.stem
            if name.startswith("__pycache__") or (entry.is_file() and entry.suffix != ".py"):
                continue
            shown = f"{name}/" if entry.is_dir() else f"{name}.py"
            assert re.search(rf"(?<![\w/]){re.escape(shown)}", mapped), f"{package}/{shown} is missing from docs/architecture.md's module map"
