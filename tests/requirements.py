"""What some tests need from the machine, as markers: skipped on a developer's machine without it, run under ``CI=true``.

Under CI a missing requirement is a failure, never a skip (``.ci/setup``
installs bubblewrap): an attack test that skipped would be an attack that passed.
"""

from __future__ import annotations

import os
import shutil

import pytest

#: ``CI=true`` (or 1, yes, on), as CI sets it.
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")

#: The local backend's tests: bubblewrap on PATH (under CI they run, and fail without it).
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None and not IN_CI, reason="needs bubblewrap (installed by .ci/setup)"
)
