"""Task sets other than the bundled suite, generated at benchmark time (nothing downloaded).

The bundled suite's tasks are small: a CSV copied into an image built on
``debian:bookworm-slim``. A ratio that only holds on them says little, so the
step benchmarks also run on a generated set of another shape:

- ``wide``: every task's image carries its own 8 MB data file and a layer of
  its own (a distinct image per task, like the bundled suite, but heavier to
  build, store and start), and its tests folder holds several files to upload
  at every verify. The answer is a checksum the verifier recomputes.

Each task has a ``gold_answer`` in its metadata, as the bundled suite's tasks
do, so the GRPO-step replay's scripted rollouts can solve it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: The generated task sets, by name.
TASK_SETS = ("wide",)

_TEST_SH = """#!/bin/sh
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
expected=$(cat /tests/expected.txt)
answer=""
[ -f /workdir/answer.txt ] && answer=$(tr -d '[:space:]' < /workdir/answer.txt)
[ "$answer" = "$expected" ] && echo 1 > /logs/verifier/reward.txt
echo "expected=$expected got=$answer"
exit 0
"""


def _write(path: Path, data: bytes | str) -> None:
    """Write ``data`` unless ``path`` holds it already: an earlier release's file is replaced, an equal one kept."""
    content = data.encode() if isinstance(data, str) else data
    if not path.is_file() or path.read_bytes() != content:
        path.write_bytes(content)


def _wide_task(root: Path, index: int) -> None:
    task = root / f"wide-{index:02d}"
    (task / "environment").mkdir(parents=True, exist_ok=True)
    (task / "tests").mkdir(exist_ok=True)
    # Distinct bytes per task: each image has a layer no other task shares.
    block = hashlib.sha256(f"wide-{index}".encode()).digest() * 32  # 1 KiB
    data = block * (8 * 1024)  # 8 MiB
    _write(task / "environment" / "data.bin", data)
    _write(
        task / "environment" / "Dockerfile",
        # COPY, not RUN: a RUN step needs a build network, which a daemon without
        # a bridge (--bridge=none, as in CI's) cannot give; the layers stay distinct.
        "FROM debian:bookworm-slim\nWORKDIR /workdir\n"
        "COPY task-name /etc/task-name\n"
        "COPY data.bin /workdir/\n"
    )
    _write(task / "environment" / "task-name", f"wide-{index}\n")
    answer = hashlib.sha256(data).hexdigest()[:16]
    _write(task / "tests" / "test.sh", _TEST_SH)
    _write(task / "tests" / "expected.txt", answer + "\n")
    for extra in range(4):  # several files to upload with every verify
        _write(task / "tests" / f"fixture-{extra}.txt", f"fixture {extra} of task {index}\n" * 200)
    _write(
        task / "instruction.md",
        "Write the first 16 hex digits of the SHA-256 of /workdir/data.bin to /workdir/answer.txt.\n"
    )
    _write(
        task / "task.toml",
        'schema_version = "1.4"\n\n[metadata]\n'
        f'gold_answer = "{answer}"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\ntimeout_sec = 120.0\n'
    )


def generate(name: str, root: Path, tasks: int = 8) -> Path:
    """Write the task set ``name`` (``tasks`` tasks) under ``root``; return the suite folder (idempotent; stale files are rewritten)."""
    if name not in TASK_SETS:
        raise ValueError(f"unknown task set {name!r}; use one of {TASK_SETS}")
    suite = root / name
    for index in range(tasks):
        _wide_task(suite, index)
    return suite
