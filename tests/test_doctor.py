"""``harbor-async doctor``: real checks of this machine, with one thing taken away at a time.

A missing bubblewrap is a ``PATH`` without it, a missing Docker daemon is
``DOCKER_HOST`` at a socket nobody listens on, a missing extra is the wheel's
fresh venv (core only; tests/wheel_env.py). The doctor's code is never patched.
"""

from __future__ import annotations

import http.server
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from harbor_async.cli.machine_checks import (
    SUPPORTED,
    UnsupportedVersionError,
    require_supported,
)
from tests.cli_helpers import make_suite
from tests.conftest import DOCKER_BASE_IMAGE
from tests.wheel_env import REPO, wheel_env


def doctor(*args: str, python: str = sys.executable, cwd: Path = REPO, env: dict | None = None):
    done = subprocess.run(
        [python, "-m", "harbor_async", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env if env is not None else dict(os.environ),
        timeout=120,
    )
    assert done.stdout.strip(), done.stderr
    return done.returncode, json.loads(done.stdout), done.stdout + done.stderr


def checks(report: dict, feature: str) -> dict[str, dict]:
    return {c["name"]: c for c in report["features"][feature]}


@pytest.mark.slow
@pytest.mark.range
def test_passes_on_this_machine_for_the_local_backend_and_every_extra():
    rc, report, _ = doctor("-b", "local", "-f", "trl", "-f", "eval", "-f", "ray")
    assert rc == 0, report
    assert report["ok"] and report["requested"] == ["core", "local", "trl", "eval", "ray"]
    local = checks(report, "local")
    assert set(local) == {"bwrap", "setpriv", "namespaces", "local environment"}
    assert all(c["ok"] for c in local.values())
    assert local["local environment"]["found"].startswith("LocalEnvironment built")
    assert "sandbox starts" in local["namespaces"]["found"]
    core = checks(report, "core")
    assert core["python"]["ok"] and core["harbor"]["found"].startswith(importlib.metadata.version("harbor") + " ")
    assert checks(report, "trl")["trl"]["found"].startswith(importlib.metadata.version("trl") + " ")
    # Everything else was looked at too (not asked for: it does not decide the exit code).
    assert {"docker", "limits", "e2b", "modal", "daytona", "runloop"} <= set(report["features"])


@pytest.mark.slow
@pytest.mark.range
@pytest.mark.docker
def test_passes_for_docker_when_the_daemon_runs(docker_daemon):
    rc, report, _ = doctor("-b", "docker", "--only")
    assert rc == 0, report
    docker = checks(report, "docker")
    assert docker["docker daemon"]["ok"] and docker["docker compose"]["ok"]
    # Which root a container's root is, read off the daemon (this machine's has no remapping).
    security = subprocess.run(["docker", "info", "--format", "{{json .SecurityOptions}}"], capture_output=True, text=True)
    remapped = "name=userns" in security.stdout or "name=rootless" in security.stdout
    assert ("is host root" in docker["container root"]["found"]) is not remapped
    # Proven, not assumed: the environment a run builds, and a container from the suite's base image.
    assert docker["docker environment"]["found"].startswith("FastStartDockerEnvironment built")
    assert docker[f"container from {DOCKER_BASE_IMAGE}"] == {
        "name": f"container from {DOCKER_BASE_IMAGE}", "ok": True, "found": "a container started and stopped", "fix": "",
    }  # fmt: skip
    assert set(report["features"]) == {"core", "docker"}


@pytest.mark.slow
@pytest.mark.range
@pytest.mark.docker
def test_docker_is_not_ready_when_the_suite_image_is_missing(docker_daemon, tmp_path: Path):
    suite = make_suite(tmp_path / "suite", ["needs-an-image"])
    dockerfile = suite / "tasks" / "needs-an-image" / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace(f"FROM {DOCKER_BASE_IMAGE}", "FROM harbor-async-test/absent:never"))
    rc, report, _ = doctor("-b", "docker", "--only", "-p", str(suite))
    assert rc == 1 and not report["ok"]
    missing = checks(report, "docker")["container from harbor-async-test/absent:never"]
    assert not missing["ok"] and missing["found"].startswith("image harbor-async-test/absent:never is missing")
    assert missing["fix"].startswith("docker pull harbor-async-test/absent:never")
    assert checks(report, "docker")["docker environment"]["ok"]  # the environment builds; its image is what is missing


@pytest.mark.slow
@pytest.mark.range
def test_docker_is_not_ready_when_harbor_refuses_the_options():
    rc, report, text = doctor("-b", "docker", "--only", "--ek", "no_such_key=1")
    assert rc == 1
    built = checks(report, "docker")["docker environment"]
    assert not built["ok"] and "backend 'docker' has no option 'no_such_key'" in built["found"]
    rc, report, _ = doctor("-b", "local", "--only", "--ek", "memroy_mb=64")
    assert rc == 1 and "did you mean 'memory_mb'?" in checks(report, "local")["local environment"]["found"]


@pytest.mark.slow
def test_reports_a_missing_bubblewrap(tmp_path: Path):
    # A PATH with the util-linux tools but no bwrap.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("setpriv",):
        os.symlink(shutil.which(name), bin_dir / name)
    rc, report, text = doctor("-b", "local", "--only", env={**os.environ, "PATH": str(bin_dir)})
    assert rc == 1
    assert not report["ok"]
    local = checks(report, "local")
    assert local["bwrap"] == {
        "name": "bwrap",
        "ok": False,
        "found": "not on PATH",
        "fix": "install the 'bubblewrap' package (as root: apt-get install bubblewrap)",
    }
    assert local["setpriv"]["ok"]
    assert not local["namespaces"]["ok"]
    # The human-readable form says the same.
    done = subprocess.run(
        [sys.executable, "-m", "harbor_async", "doctor", "-b", "local", "--only"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PATH": str(bin_dir), "COLUMNS": "200"}, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "not ready: local needs bwrap: install the 'bubblewrap' package" in done.stdout


@pytest.mark.slow
@pytest.mark.range
def test_reports_a_missing_docker_daemon():
    # A short folder: a socket's path must fit AF_UNIX's 108 bytes (a pytest -n worker's tmp_path may not).
    dead = Path(tempfile.mkdtemp(prefix="hd", dir=os.environ.get("HARBOR_ASYNC_TESTS_TMP"))) / "dead.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(dead))
    listener.close()  # the socket file stays; nobody listens on it
    rc, report, _ = doctor("-b", "docker", "--only", env={**os.environ, "DOCKER_HOST": f"unix://{dead}"})
    assert rc == 1
    docker = checks(report, "docker")
    assert docker["docker"]["ok"]  # the CLI is there...
    assert not docker["docker daemon"]["ok"]  # ...the daemon is not
    assert str(dead) in docker["docker daemon"]["found"]
    assert "start it" in docker["docker daemon"]["fix"]
    # The dead daemon is said once: no container check piles up behind it.
    assert not [name for name in docker if name.startswith("container from")]
    # Asking for the local backend only: the dead daemon does not matter.
    rc, report, _ = doctor("-b", "local", env={**os.environ, "DOCKER_HOST": f"unix://{dead}"})
    assert rc == 0 and not checks(report, "docker")["docker daemon"]["ok"]


@pytest.mark.slow
def test_reports_a_missing_extra_in_a_core_only_install(tmp_path: Path):
    venv = wheel_env()
    rc, report, _ = doctor("-b", "local", "-f", "trl", "-f", "ray", "--only", python=str(venv.python), cwd=tmp_path, env=venv.env())
    assert rc == 1
    trl = checks(report, "trl")
    assert trl["trl"] == {
        "name": "trl",
        "ok": False,
        "found": "not installed",
        "fix": "pip install 'harbor-async[trl]'  (or: uv add 'harbor-async[trl]')",
    }
    assert checks(report, "ray")["ray"]["fix"].startswith("pip install 'harbor-async[ray]'")
    assert all(c["ok"] for c in report["features"]["local"] + report["features"]["core"])
    # Without the extras asked for, the same install is ready for the local backend.
    rc, _, _ = doctor("-b", "local", "--only", python=str(venv.python), cwd=tmp_path, env=venv.env())
    assert rc == 0
    # Code that depends on TRL internals refuses clearly there.
    done = subprocess.run(
        [str(venv.python), "-c", "from harbor_async.cli.machine_checks import require_supported; require_supported('trl', 'shim.reference', 'trl-internals')"],
        capture_output=True, text=True, cwd=tmp_path, env=venv.env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "UnsupportedVersionError: shim.reference needs trl>=1.7,<1.17 (tested: 1.7.0, 1.16.0)" in done.stderr


@pytest.mark.slow
def test_credentials_are_checked_never_printed():
    secret = "sk-doctor-test-9f8e7d"
    rc, report, text = doctor("-b", "e2b", "--only", env={**os.environ, "E2B_API_KEY": secret})
    assert checks(report, "e2b")["e2b credentials"]["ok"]
    assert checks(report, "e2b")["e2b throttle answers"]["found"].startswith("typed: RateLimitException")  # for the window
    assert secret not in text
    assert rc == (0 if checks(report, "e2b")["e2b"]["ok"] else 1)  # the client package decides the rest
    rc, report, _ = doctor("-b", "e2b", "--only", env={k: v for k, v in os.environ.items() if k != "E2B_API_KEY"})
    assert rc == 1 and checks(report, "e2b")["e2b credentials"]["fix"] == "set E2B_API_KEY in the environment"


class _Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"data": [{"id": "tiny-model"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_model_server_reachable_or_not():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        rc, report, _ = doctor("-b", "local", "--only", "--base-url", url)
        assert rc == 0 and "model-server" in report["requested"]
        assert checks(report, "model-server")["model server"]["found"].endswith("1 model(s): tiny-model")
    finally:
        server.shutdown()
        server.server_close()
    rc, report, _ = doctor("-b", "local", "--only", "--base-url", url)  # closed now
    assert rc == 1 and not checks(report, "model-server")["model server"]["ok"]


def test_supported_ranges_are_pyproject_ranges():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    declared = {Requirement(line).name.lower().replace("_", "-"): Requirement(line).specifier for line in lines}
    declared.pop("harbor-async")  # the bench extra names the trl one
    assert {name: SpecifierSet(SUPPORTED[name]) for name in declared} == declared
    assert SUPPORTED["python"] == project["requires-python"]


@pytest.mark.range
def test_require_supported_names_the_tested_range():
    assert require_supported("harbor", "the local backend") == importlib.metadata.version("harbor")
    with pytest.raises(UnsupportedVersionError) as caught:
        require_supported("no-such-dist-anywhere", "a feature", "trl")
    assert caught.value.supported == SUPPORTED["trl"] and caught.value.version == "not installed"


def test_an_installed_pre_release_in_the_range_counts_and_one_past_it_does_not():
    """The doctor, require_supported and HarborGRPOTrainer's gate read a version with one rule."""
    from harbor_async.cli.machine_checks import in_range

    assert in_range("5.0.0rc1", ">=4.56,<6") and in_range("1.16.0.dev0", ">=1.7,<1.17")
    assert not in_range("1.17.0.dev0", ">=1.7,<1.17") and not in_range("1.6.0", ">=1.7,<1.17")
    assert not in_range("not-a-version", ">=1") and in_range("3.12.1", SUPPORTED["python"])


@pytest.mark.slow
def test_a_model_is_checked_with_a_chat_request_when_named():
    from tests.scripted_server import ScriptedServer

    with ScriptedServer(models="empty") as server:  # lists nothing, serves "solver"
        rc, report, _ = doctor("-b", "local", "--only", "--base-url", server.base_url, "-m", "solver")
        assert rc == 0, report
        assert checks(report, "model-server")["model solver"] == {
            "name": "model solver", "ok": True, "found": "answers a chat request", "fix": "",
        }  # fmt: skip
        rc, report, _ = doctor("-b", "local", "--only", "--base-url", server.base_url, "-m", "no-such-model")
        assert rc == 1 and "HTTP 404" in checks(report, "model-server")["model no-such-model"]["found"]
