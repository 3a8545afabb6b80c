"""Under ``CI=true`` a test that needs bubblewrap runs (and fails without it): it is never skipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_bubblewrap_gate_is_the_one_that_never_skips_under_ci() -> None:
    own = ("requirements.py", Path(__file__).name)
    gates = [p.name for p in TESTS.glob("*.py") if 'which("bwrap") is None' in p.read_text() and p.name not in own]
    assert gates == [], f"use tests.requirements.needs_bwrap instead of a gate of their own: {gates}"


def test_the_gate_skips_only_outside_ci_when_bubblewrap_is_missing(tmp_path: Path) -> None:
    probe = "import tests.requirements as r; print(r.needs_bwrap.args[0])"
    for ci, skips in (("true", "False"), ("", "True")):
        found = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, cwd=TESTS.parent, timeout=60,
            env={"PATH": str(tmp_path), "CI": ci},  # no bwrap on this PATH
        )  # fmt: skip
        assert found.stdout.strip() == skips, (ci, found.stdout, found.stderr)
