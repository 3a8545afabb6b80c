"""The built wheel, installed into a fresh virtual environment, runs the main job and a shim round.

No source tree on ``sys.path`` (the commands run from a temporary folder with
the venv's own interpreter) and no ``.ci/setup``: what a user gets from
``pip install harbor-async``. See tests/wheel_env.py for how it is built.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.wheel_env import REPO, wheel_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.one_worker]  # one worker builds the venv


@pytest.fixture(scope="module")
def venv():
    return wheel_env()


def _run(venv, argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=venv.env(**env), capture_output=True, text=True, timeout=600)


def test_wheel_holds_the_product_and_its_package_data_only(venv):
    names = set(zipfile.ZipFile(venv.wheel).namelist())
    tops = {name.split("/")[0] for name in names}
    assert tops == {"harbor_async", "shim", f"{venv.wheel.name.split('-')[0]}-{venv.wheel.name.split('-')[1]}.dist-info"}
    # Every tracked file of the two packages is in the wheel (package data included: the suite).
    tracked = subprocess.run(
        ["git", "ls-files", "harbor_async", "shim"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tracked and not sorted(set(tracked) - names)
    assert "harbor_async/suites/example/tasks/csv-column-sum/environment/sales.csv" in names
    assert {"harbor_async/py.typed", "shim/py.typed"} <= names  # type checkers read the hints (PEP 561)
    metadata = zipfile.ZipFile(venv.wheel).read(f"{venv.wheel.name.split('-')[0]}-0.1.0.dist-info/METADATA").decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    # Library-style: no exact pins of what training environments bring their own of.
    assert not [r for r in requires if "==" in r.split(";")[0]], requires
    assert any(r.startswith("Requires-Dist: trl<2,>=1.7") for r in requires), requires
    assert {"trl", "eval", "ray", "bench"} <= {
        line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")
    }


def test_main_job_runs_from_the_wheel(venv, tmp_path: Path):
    records = tmp_path / "episodes.jsonl"
    done = _run(venv, [str(venv.cli), "run", "--backend", "local", "-n", "4", "--json", str(records)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(rows) == 10
    assert [r["reward"] for r in rows] == [1.0] * 10, rows
    assert "10 episodes: mean reward 1.000 over the 10 judged; failures: none" in done.stdout


def test_shim_round_from_the_wheel(venv, tmp_path: Path):
    script = tmp_path / "smoke.py"
    shutil.copy(REPO / "tests" / "wheel_shim_smoke.py", script)
    done = _run(venv, [str(venv.python), str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    site = str(venv.root)
    assert seen["harbor_async"].startswith(site) and seen["shim"].startswith(site)
    assert not [p for p in seen["sys_path"] if p and Path(p).resolve() == REPO.resolve()]
    assert seen["prompt"].startswith("# Total sales")
    assert "sales.csv" in seen["listing"]
    assert seen["rewards"] == [1.0, 0.0]


# ── the newest releases the ranges allow, on docker ─────────────────────────


@pytest.fixture(scope="module")
def newest():
    """The wheel with its trl extra, resolved from its ranges alone, newest first (a new user's install today)."""
    return wheel_env("trl", "highest")


@pytest.mark.docker
def test_newest_install_runs_the_main_job_on_docker(newest, docker_daemon, tmp_path: Path):
    records = tmp_path / "episodes.jsonl"
    done = _run(newest, [str(newest.cli), "run", "-e", "docker", "-n", "4", "--json", str(records), "-o", str(tmp_path / "jobs")], tmp_path)
    versions = {d: newest.version(d) for d in ("harbor", "trl", "transformers", "openai")}
    assert done.returncode == 0, (versions, done.stderr[-3000:])
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["reward"] for r in rows] == [1.0] * 10, (versions, rows)
    assert "failures: none" in done.stdout


@pytest.mark.docker
def test_newest_install_runs_a_shim_round_on_docker(newest, docker_daemon, tmp_path: Path):
    script = tmp_path / "smoke.py"
    shutil.copy(REPO / "tests" / "wheel_shim_smoke.py", script)
    done = _run(newest, [str(newest.python), str(script), "docker"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["harbor_async"].startswith(str(newest.root))
    assert seen["prompt"].startswith("# Total sales") and "sales.csv" in seen["listing"]
    assert seen["rewards"] == [1.0, 0.0]


def test_bench_says_it_needs_a_source_checkout(venv, tmp_path: Path):
    done = _run(venv, [str(venv.cli), "bench", "throughput"], tmp_path)
    assert done.returncode == 2
    assert "needs a source checkout" in " ".join(done.stderr.split())
    # ...and nothing named `benchmarks` was installed to collide with the user's own.
    probe = _run(venv, [str(venv.python), "-c", "import importlib.util; print(importlib.util.find_spec('benchmarks'))"], tmp_path)
    assert probe.stdout.strip() == "None"


#: Per extra: what must import with only that extra installed (and nothing it does not bring).
EXTRA_IMPORTS = {
    "eval": ("import openai, jinja2, matplotlib, harbor_async", "trl"),
    "ray": ("import ray, harbor_async", "trl"),
    "trl": ("import trl, datasets, shim; from trl import GRPOTrainer; from trl.experimental.harbor import HarborSpec", "ray"),
}


@pytest.mark.parametrize("extra", sorted(EXTRA_IMPORTS))
def test_each_extra_installs_and_imports_on_its_own(extra: str, tmp_path: Path):
    env = wheel_env(extra)
    imports, absent = EXTRA_IMPORTS[extra]
    done = _run(env, [str(env.python), "-c", imports], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = _run(env, [str(env.python), "-c", f"import importlib.util as u; print(u.find_spec({absent!r}))"], tmp_path)
    assert probe.stdout.strip() == "None"
    ready = _run(env, [str(env.cli), "doctor", "--only", "-b", "local", "-f", extra], tmp_path)
    assert ready.returncode == 0, ready.stdout[-3000:]
