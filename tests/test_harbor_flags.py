"""Every flag of the installed Harbor's ``harbor run``: taken by ``harbor-async run``, or refused up front with the reason; and documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from harbor_async.cli import app
from harbor_async.cli.harbor_flags import REFUSED, refusal
from tests.cli_helpers import harbor_async

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _spellings(command) -> list[tuple[str, ...]]:
    return [tuple(p.opts + p.secondary_opts) for p in command.params if getattr(p, "param_type_name", "") == "option"]


def _harbor_run_flags() -> list[tuple[str, ...]]:
    import harbor.cli.main as harbor_main

    return _spellings(typer.main.get_command(harbor_main.app).commands["run"])


def _our_run_flags() -> set[str]:
    return {s for spellings in _spellings(typer.main.get_command(app).commands["run"]) for s in spellings}


@pytest.mark.range
def test_every_harbor_run_flag_is_taken_or_refused_with_a_reason() -> None:
    ours, refused = _our_run_flags(), {s for spellings in REFUSED for s in spellings}
    assert not ours & refused  # a flag is one or the other
    missing = [spellings for spellings in _harbor_run_flags() if not set(spellings) & (ours | refused) and spellings != ("--help", "-h")]
    assert missing == []
    for spellings in _harbor_run_flags():  # a flag we take, we take in every spelling Harbor has (-k and --n-attempts)
        taken = set(spellings) & ours
        assert not taken or taken == set(spellings) or set(spellings) - taken <= refused, spellings


@pytest.mark.range
def test_the_docs_map_every_harbor_run_flag() -> None:
    text = DOCS.read_text()
    table = text[text.index("## Every flag of `harbor run`") :]
    cells = set(re.findall(r"`(-[-\w]+)", table))
    undocumented = [spellings for spellings in _harbor_run_flags() if spellings[0] not in cells and spellings != ("--help", "-h")]
    assert undocumented == []


@pytest.mark.slow
def test_a_flag_we_cannot_honour_is_one_line_with_its_reason_before_anything_starts(tmp_path: Path) -> None:
    done = harbor_async("run", "-e", "simulated", "--upload", "-o", str(tmp_path / "jobs"))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "--upload" in line and "harbor upload JOB_DIR" in line
    assert not (tmp_path / "jobs").exists()
    assert refusal(["-p", "x", "--stream"]).startswith("--stream (a `harbor run` flag)")
    assert refusal(["--", "--upload"]) is None and refusal(["-k", "2"]) is None
    assert refusal(["-c", "job.yaml"]) is None and refusal(["--print-config"]) is None  # Harbor's job configs are read
