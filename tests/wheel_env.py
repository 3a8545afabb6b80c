"""A fresh virtual environment with harbor-async installed from its built wheel (no source tree).

Built once per test session and kind (tests/test_wheel.py and tests/test_doctor.py
share them): ``uv build --wheel``, ``uv venv``, ``uv pip install`` of the wheel,
outside the project's configuration (``--no-config``), either

- ``"locked"``: with the lock's versions as constraints (the install comes from
  uv's cache and matches what the rest of the suite tests), or
- ``"highest"``: resolved from the wheel's ranges alone, newest first, as a user's
  ``pip install "harbor-async[trl]"`` resolves today (torch, which is no
  dependency of ours, at the lock's release without its GPU-only libraries).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class WheelEnv:
    """The built wheel and the environment it is installed in."""

    wheel: Path
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def cli(self) -> Path:
        return self.root / "bin" / "harbor-async"

    def env(self, **extra: str) -> dict[str, str]:
        """The process environment for the venv: nothing of the source tree or of uv's project venv."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.root)
        env.update(extra)
        return env

    def version(self, dist: str) -> str:
        """The version of ``dist`` installed in the venv."""
        done = subprocess.run(
            [str(self.python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
            capture_output=True, text=True, env=self.env(), timeout=60, check=True,
        )  # fmt: skip
        return done.stdout.strip()


def _uv(*args: str, cwd: Path = REPO, timeout: float = 600) -> str:
    uv = shutil.which("uv")
    assert uv is not None, "uv is needed to build and install the wheel"
    done = subprocess.run([uv, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"uv {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


#: What the project's [tool.uv] exclude-dependencies keeps out (GPU-only parts of torch).
GPU_ONLY = ("triton", "nvidia-cusolver", "cuda-bindings", "cuda-pathfinder")


@functools.cache
def _built() -> tuple[Path, Path]:
    """(the wheel, a folder with constraints.txt and excludes.txt): built once per session, removed at exit."""
    base = Path(tempfile.mkdtemp(prefix="harbor-async-wheel-"))
    import atexit

    atexit.register(shutil.rmtree, base, True)
    dist = base / "dist"
    _uv("build", "--wheel", "--out-dir", str(dist))
    wheels = sorted(dist.glob("harbor_async-*.whl"))
    assert len(wheels) == 1, wheels
    (base / "constraints.txt").write_text(
        _uv("export", "--locked", "--all-extras", "--no-hashes", "--no-emit-project", "--format", "requirements-txt")
    )
    (base / "torch.txt").write_text(
        "".join(line + "\n" for line in (base / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    )
    (base / "excludes.txt").write_text("\n".join(GPU_ONLY) + "\n")
    return wheels[0], base


@functools.cache
def wheel_env(extra: str | None = None, resolution: Literal["locked", "highest"] = "locked") -> WheelEnv:
    """A fresh venv with the wheel (plus one extra) installed (once per session, extra and resolution)."""
    wheel, base = _built()
    root = base / f"venv-{extra or 'core'}-{resolution}"
    _uv("venv", "--python", sys.executable, str(root), cwd=base)
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    if resolution == "locked":
        pins = ["-c", str(base / "constraints.txt")]
    else:
        pins = ["--resolution", "highest", "-c", str(base / "torch.txt")]
    _uv(
        "pip", "install", "--no-config", "--python", str(root / "bin" / "python"),
        *pins, "--excludes", str(base / "excludes.txt"), target,
        cwd=base,
    )  # fmt: skip
    return WheelEnv(wheel=wheel, root=root)

