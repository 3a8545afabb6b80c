"""What this machine and environment can run: the checks behind ``harbor-async doctor``.

Each check looks at the real thing (a program on ``PATH``, a sandbox started
with ``bwrap``, the Docker daemon answering ``docker info``, an installed
distribution's version, a model server's ``/models``) and returns a
:class:`Check`: what was found and, when something is missing, how to get it.
:data:`FEATURES` says which checks each backend or feature needs, so that
:func:`diagnose` can tell whether what the user asked for can run.

The supported and tested version ranges live here too (:data:`SUPPORTED`,
:data:`TESTED`), with :func:`require_supported` for code that depends on a
package's internals and must refuse versions it was not tested with.

Credentials are only tested for presence; their values are never read into
a :class:`Check` or printed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from harbor_async.backends import resolve_backend
from harbor_async.backends.local.dockerfile import parse_dockerfile
from harbor_async.core.errors import HarborAsyncError
from harbor_async.models.serve import chat_answers
from harbor_async.tasks.suite import load_suite

if TYPE_CHECKING:
    from harbor.models.task.task import Task

__all__ = [
    "FEATURES",
    "SUPPORTED",
    "TESTED",
    "Check",
    "Diagnosis",
    "UnsupportedVersionError",
    "diagnose",
    "require_supported",
]

def _declared_ranges() -> dict[str, str]:
    """The ranges harbor-async's installed metadata declares (pyproject.toml's, extras included)."""
    from packaging.requirements import Requirement

    ranges: dict[str, str] = {}
    for line in importlib.metadata.requires("harbor-async") or ():
        requirement = Requirement(line)
        if requirement.name != "harbor-async":  # the bench extra names the trl one
            bounds = sorted(map(str, requirement.specifier), key=lambda bound: not bound.startswith(">"))
            ranges.setdefault(requirement.name.lower().replace("_", "-"), ",".join(bounds))  # lower bound first
    ranges["python"] = importlib.metadata.metadata("harbor-async")["Requires-Python"]
    return ranges


#: Supported ranges: what the installed package declares (pyproject.toml's), and
#: what ``doctor`` checks, plus narrower ranges of single features:
#: ``trl-internals``, code that reaches into TRL's private methods
#: (``benchmarks/reference.py``, ``shim.HarborGRPOTrainer``): only the releases CI tested; ``trl-env-reward``: TRL
#: reads an env's ``get_reward`` as a reward source from 1.8 on (1.7 would list
#: it as a tool).
SUPPORTED: dict[str, str] = {
    **_declared_ranges(),
    "trl-internals": ">=1.7,<1.17",
    "trl-env-reward": ">=1.8,<2",
}

#: The releases CI runs at the ranges' ends (.ci/range: lowest and highest that resolve).
TESTED: dict[str, tuple[str, ...]] = {
    "harbor": ("0.25.0", "0.26.0"),
    "trl": ("1.7.0", "1.16.0"),
}

#: Distribution name -> the pip requirement that installs it (the fix text).
_INSTALL: dict[str, str] = {
    "trl": "harbor-async[trl]",
    "datasets": "harbor-async[trl]",
    "openai": "harbor-async[eval]",
    "jinja2": "harbor-async[eval]",
    "matplotlib": "harbor-async[eval]",
    "ray": "harbor-async[ray]",
    "e2b": "harbor[e2b]",
    "modal": "harbor[modal]",
    "daytona": "harbor[daytona]",
    "runloop-api-client": "harbor[runloop]",
}

#: Cloud backends: the client distribution and the credentials (any one group of
#: environment variables, or a config file) that Harbor's environment reads.
_CLOUD: dict[str, tuple[str, tuple[tuple[str, ...], ...], str | None]] = {
    "e2b": ("e2b", (("E2B_API_KEY",),), None),
    "modal": ("modal", (("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"),), "~/.modal.toml"),
    "daytona": ("daytona", (("DAYTONA_API_KEY",), ("DAYTONA_JWT_TOKEN",)), None),
    "runloop": ("runloop-api-client", (("RUNLOOP_API_KEY",),), None),
}

_DOCKER_TIMEOUT = 20.0
_SANDBOX_TIMEOUT = 20.0


class UnsupportedVersionError(HarborAsyncError, RuntimeError):
    """An installed package is outside the range the code that needs it was tested with."""

    def __init__(self, dist: str, version: str, supported: str, feature: str) -> None:
        self.dist, self.version, self.supported, self.feature = dist, version, supported, feature
        super().__init__(
            f"{feature} needs {dist}{supported} (tested: {', '.join(TESTED.get(dist, ())) or 'see README'}); "
            f"installed: {dist} {version}. Install a release in that range, e.g. pip install '{dist}{supported}'."
        )


@dataclass(frozen=True)
class Check:
    """One fact about the machine or environment.

    Attributes:
        name: What was checked (``bubblewrap``, ``docker daemon``, ``trl``...).
        ok: Whether it is there and usable.
        found: What was found (a version, a path, an error): never a secret.
        fix: How to get it, when ``ok`` is false.
    """

    name: str
    ok: bool
    found: str
    fix: str = ""


@dataclass
class Diagnosis:
    """The checks of every feature looked at, and which of them the user asked for."""

    requested: list[str]
    results: dict[str, list[Check]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every check of every requested feature passed."""
        return all(check.ok for name in self.requested for check in self.results.get(name, []))

    def missing(self) -> list[tuple[str, Check]]:
        """(feature, check) for each failed check of a requested feature."""
        return [(name, c) for name in self.requested for c in self.results.get(name, []) if not c.ok]

    def to_json(self) -> str:
        """The diagnosis as JSON (``doctor --json``)."""
        return json.dumps(
            {
                "ok": self.ok,
                "requested": self.requested,
                "features": {name: [asdict(c) for c in checks] for name, checks in self.results.items()},
            },
            indent=2,
        )


# ── packages ────────────────────────────────────────────────────────────────


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def in_range(version: str, spec: str) -> bool:
    """Whether an installed ``version`` satisfies ``spec``; a pre-release counts (a build from a project's main
    branch is what its user has installed), an unreadable version does not."""
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def require_supported(dist: str, feature: str, range_name: str | None = None) -> str:
    """Return the installed version of ``dist``; raise if it is outside its supported range.

    Args:
        dist: The distribution (``trl``).
        feature: What needs it, for the message (``benchmarks/reference.py``).
        range_name: The key in :data:`SUPPORTED` (default: ``dist``).

    Raises:
        UnsupportedVersionError: Not installed, or outside the range.
    """
    spec = SUPPORTED[range_name or dist]
    version = installed_version(dist)
    if version is None or not in_range(version, spec):
        raise UnsupportedVersionError(dist, version or "not installed", spec, feature)
    return version


def check_python() -> Check:
    """The interpreter against the supported range."""
    version = ".".join(map(str, sys.version_info[:3]))
    ok = in_range(version, SUPPORTED["python"])
    return Check("python", ok, f"{version} ({sys.executable})", "" if ok else f"use Python {SUPPORTED['python']}")


def check_package(dist: str, spec: str | None = None) -> Check:
    """An installed distribution against its supported range (or only present, without one)."""
    spec = spec if spec is not None else SUPPORTED.get(dist, "")
    version = installed_version(dist)
    install = _INSTALL.get(dist, f"{dist}{spec}")
    if version is None:
        return Check(dist, False, "not installed", f"pip install '{install}'  (or: uv add '{install}')")
    if spec and not in_range(version, spec):
        return Check(dist, False, f"{version}, supported {spec}", f"pip install '{dist}{spec}'")
    return Check(dist, True, version + (f" (supported {spec})" if spec else ""))


# ── the local backend ───────────────────────────────────────────────────────


def check_program(name: str, package: str) -> Check:
    """A program on ``PATH`` (``package`` names the Debian package that has it)."""
    path = shutil.which(name)
    if path is None:
        return Check(name, False, "not on PATH", f"install the '{package}' package (as root: apt-get install {package})")
    return Check(name, True, path)


def check_user_namespaces() -> Check:
    """Start a throw-away sandbox the way the local backend does (namespaces, and a user one when not root)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Check("namespaces", False, "not tested: bwrap is missing", "install bubblewrap first")
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    if os.geteuid() != 0:
        argv += ["--unshare-user", "--uid", "0", "--gid", "0"]
    try:
        done = subprocess.run([*argv, "--", "true"], capture_output=True, text=True, timeout=_SANDBOX_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("namespaces", False, f"bwrap did not run: {exc}", _USERNS_FIX)
    if done.returncode != 0:
        return Check("namespaces", False, (done.stderr.strip() or f"bwrap exited {done.returncode}")[:300], _USERNS_FIX)
    kind = "as root" if os.geteuid() == 0 else "unprivileged, with a user namespace"
    return Check("namespaces", True, f"a bwrap sandbox starts ({kind})")


_USERNS_FIX = (
    "allow user namespaces: sysctl -w user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1 "
    "(Ubuntu 24.04+: kernel.apparmor_restrict_unprivileged_userns=0); in a container, run it with "
    "--security-opt seccomp=unconfined or as root with CAP_SYS_ADMIN"
)


def check_cgroups(root: Path = Path("/sys/fs/cgroup")) -> Check:
    """The cgroup version and its controllers (per-sandbox memory, CPU and process limits need them)."""
    wanted = ("memory", "cpu", "pids")
    v2 = root / "cgroup.controllers"
    if v2.is_file():
        controllers = v2.read_text().split()
        version, writable = "v2", os.access(root, os.W_OK)
    else:
        try:
            lines = Path("/proc/cgroups").read_text().splitlines()[1:]
        except OSError:
            return Check("cgroups", False, "no cgroup filesystem", "mount cgroup2 on /sys/fs/cgroup")
        controllers = [f[0] for f in (line.split() for line in lines) if len(f) == 4 and f[3] == "1"]
        version, writable = "v1", os.access(root / "memory", os.W_OK)
    missing = [c for c in wanted if c not in controllers]
    found = f"{version}, controllers: {' '.join(sorted(controllers)) or 'none'}" + ("" if writable else ", not writable")
    found += f"; a timed-out exec is ended {_exec_kill(root, version)}"
    if missing or not writable:
        fix = f"enable the {'/'.join(missing)} controllers" if missing else "run as root, or delegate a cgroup subtree"
        return Check("cgroups", False, found, fix + " (needed only for per-sandbox resource limits)")
    return Check("cgroups", True, found)


def _exec_kill(root: Path, version: str) -> str:
    """How the local backend ends a timed-out exec here (see ``backends/local/limits.py``)."""
    release = tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])
    hierarchy = root if version == "v2" else root / "unified"
    if release >= (5, 14) and (hierarchy / "cgroup.controllers").is_file() and os.access(hierarchy, os.W_OK):
        return f"by its own cgroup's cgroup.kill ({hierarchy})"
    return "by walking its process tree (no writable cgroup2 hierarchy with cgroup.kill: Linux 5.14+, root)"


# ── Docker ─────────────────────────────────────────────────────────────────


def _docker(args: Sequence[str]) -> tuple[bool, str]:
    docker = shutil.which("docker")
    if docker is None:
        return False, "docker CLI not on PATH"
    try:
        done = subprocess.run([docker, *args], capture_output=True, text=True, timeout=_DOCKER_TIMEOUT)
    except subprocess.TimeoutExpired:
        return False, f"no answer in {_DOCKER_TIMEOUT:.0f}s"
    text = (done.stdout.strip() if done.returncode == 0 else done.stderr.strip()) or f"exit {done.returncode}"
    return done.returncode == 0, text.splitlines()[-1][:300] if text else ""


def check_docker_daemon() -> Check:
    """``docker info`` answers (honours ``DOCKER_HOST`` and the current context)."""
    ok, text = _docker(["info", "--format", "{{.ServerVersion}}"])
    where = os.environ.get("DOCKER_HOST") or "the default socket"
    if ok:
        return Check("docker daemon", True, f"server {text} at {where}")
    return Check(
        "docker daemon",
        False,
        f"{where}: {text}",
        "install Docker Engine and start it (as root: apt-get install docker.io && systemctl start docker, "
        "or .ci/docker-setup), and add your user to the 'docker' group; or point DOCKER_HOST at a daemon",
    )


def check_docker_root() -> Check:
    """Whether root in a container is host root: the daemon's user-namespace remapping or rootless mode.

    harbor-async does not reconfigure the daemon; this says which it is (see docs/backends.md).
    """
    ok, text = _docker(["info", "--format", "{{json .SecurityOptions}}"])
    if not ok:
        return Check("container root", False, text, "start the Docker daemon")
    try:
        options = [str(o) for o in json.loads(text) or []]
    except ValueError:
        options = []
    if any("name=rootless" in o for o in options):
        return Check("container root", True, "rootless daemon: root in a container is your own user on the host")
    if any("name=userns" in o for o in options):
        return Check("container root", True, "user-namespace remapping: root in a container is an unprivileged host uid")
    return Check(
        "container root",
        True,
        "root in a container is host root (no userns-remap, not rootless): a container escape is a host root; "
        "dockerd --userns-remap=default or rootless Docker makes it an unprivileged uid",
    )


def check_docker_compose() -> Check:
    """The Compose plugin (Harbor's docker backend runs ``docker compose``)."""
    ok, text = _docker(["compose", "version", "--short"])
    if ok:
        return Check("docker compose", True, text)
    return Check("docker compose", False, text, "install the Compose plugin (apt-get install docker-compose-plugin)")


def base_images(tasks: Sequence[Task]) -> list[str]:
    """The images a docker run of ``tasks`` starts from: ``docker_image``, else the Dockerfile's ``FROM``."""

    images = set()
    for task in tasks:
        image = task.config.environment.docker_image
        dockerfile = task.paths.environment_dir / "Dockerfile"
        if not image and dockerfile.is_file():
            image = parse_dockerfile(dockerfile.read_text(encoding="utf-8")).base_image
        if image and image != "scratch":  # scratch is no image to have
            images.add(image)
    return sorted(images)


def check_docker_container(image: str) -> Check:
    """Start and stop one container from ``image`` (no pull, no network): what every docker start does."""
    name = f"container from {image}"
    ok, text = _docker(["image", "inspect", "--format", "{{.Id}}", image])
    if not ok:
        return Check(
            name, False, f"image {image} is missing: {text}",
            f"docker pull {image}, or build it (without a registry, .ci/docker-setup builds debian:bookworm-slim offline)",
        )  # fmt: skip
    container = f"harbor-async-doctor-{os.getpid()}"
    ok, text = _docker(["run", "--rm", "--name", container, "--pull", "never", "--network", "none", "--entrypoint", "true", image])
    if not ok:
        _docker(["rm", "-f", container])  # a run past the timeout leaves its container
        return Check(name, False, f"docker run failed: {text}", "see the daemon's log; `docker run --rm IMAGE true` must work")
    return Check(name, True, "a container started and stopped")


# ── a backend's environment, built the way a start builds it ───────────────


def check_backend_environment(backend: str, task: Task, backend_kwargs: Mapping[str, Any] | None = None) -> Check:
    """Build ``backend``'s Harbor environment for ``task``, with the options a run passes.

    The class is loaded, the options checked against what the installed Harbor
    accepts, and the environment constructed as every start constructs it
    (:meth:`~harbor_async.backends.BackendSpec.create_environment`); nothing is
    started, so cloud backends create no sandbox.
    """
    import tempfile
    import uuid

    from harbor.models.trial.paths import TrialPaths

    options = dict(backend_kwargs or {})
    name = f"{backend} environment"
    try:
        spec = resolve_backend(backend)
        spec.check_options(options)
        with tempfile.TemporaryDirectory(prefix="harbor-async-doctor-") as folder:
            paths = TrialPaths(trial_dir=Path(folder))
            paths.mkdir()
            environment = spec.create_environment(
                task, paths, session_id=f"doctor-{uuid.uuid4().hex[:10]}", run_label="doctor",
                backend_kwargs=options, options={},
            )  # fmt: skip
    except Exception as exc:  # whatever Harbor or the backend refuses is the finding
        found = " ".join(str(exc).split())[:500] or type(exc).__name__
        return Check(name, False, f"cannot be built: {found}", "fix the backend options (--ek) or install what it names")
    checked = spec.options()
    note = (
        f"options checked against {'its schema' if checked.source == 'schema' else 'its constructor'}"
        if checked.checked
        else "options go unchecked (the class declares no options schema)"
    )
    given = ", ".join(sorted(options)) or "none"
    return Check(name, True, f"{type(environment).__name__} built (options: {given}; {note})")


# ── cloud backends, Ray, a model server ────────────────────────────────────


def check_credentials(backend: str) -> Check:
    """Whether the backend's credentials are set (presence only: values are never read out)."""
    _, groups, config = _CLOUD[backend]
    for group in groups:
        if all(os.environ.get(name) for name in group):
            return Check(f"{backend} credentials", True, " and ".join(group) + " set (values not shown)")
    if config and Path(config).expanduser().is_file():
        return Check(f"{backend} credentials", True, f"{config} present")
    wanted = " or ".join(" and ".join(g) for g in groups) + (f" (or {config})" if config else "")
    return Check(f"{backend} credentials", False, "not set", f"set {wanted} in the environment")


def check_model_server(base_url: str, api_key_env: str = "OPENAI_API_KEY") -> Check:
    """GET ``{base_url}/models`` on an OpenAI-compatible server (vLLM, SGLang, ...)."""
    url = base_url.rstrip("/") + "/models"
    request = urllib.request.Request(url)
    key = os.environ.get(api_key_env)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - the user's URL
            body = json.loads(response.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return Check(
            "model server",
            False,
            f"{url}: {reason}",
            "start the server (e.g. `vllm serve MODEL` from vLLM's own environment) or fix --base-url",
        )
    models = [m.get("id", "?") for m in body.get("data", []) if isinstance(m, dict)]
    return Check("model server", True, f"{url}: {len(models)} model(s): {', '.join(models[:5])}")


def check_model_chat(base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY") -> Check:
    """A one-token chat request for ``model``: what ``eval`` asks of a model the list does not name."""
    import anyio

    refused = anyio.run(lambda: chat_answers(base_url, model, api_key=os.environ.get(api_key_env)))
    if refused is None:
        return Check(f"model {model}", True, "answers a chat request")
    return Check(f"model {model}", False, f"a chat request: {refused}", "check the model name (-m) and the key")


# ── features ───────────────────────────────────────────────────────────────


def _core() -> list[Check]:
    return [check_python(), check_package("harbor-async", ""), check_package("harbor")]


def _local() -> list[Check]:
    return [
        check_program("bwrap", "bubblewrap"),
        check_program("setpriv", "util-linux"),
        check_user_namespaces(),
    ]


def check_docker_storage() -> Check:
    """Who bounds a docker task's ``storage_mb``: the daemon's quota, or harbor-async's watch (docs/backends.md)."""
    ok, text = _docker(["info", "--format", "{{.Driver}}"])
    if not ok:
        return Check("docker storage_mb", False, text, "start the Docker daemon")
    from harbor_async.backends.docker.storage import POLL_SECONDS, daemon_quota

    enforced, how = daemon_quota()
    if enforced:
        return Check("docker storage_mb", True, f"enforced by the daemon ({text}): {how}")
    return Check(
        "docker storage_mb",
        True,
        f"bounded by harbor-async: each container's writable layer is measured every {POLL_SECONDS:g} s and a "
        f"container past it is killed, the agent's failure ({text}: {how}); a daemon on xfs with pquota enforces it itself",
    )


def check_docker_host_network() -> Check:
    """Whether docker sandboxes are kept off this host's addresses (docs/backends.md, host network)."""
    from harbor_async.backends.docker.host_network import daemon_forwards, describe

    kept_off, text = describe(daemon_forwards())
    fix = "" if kept_off else "drop the bridges' traffic to this host in its firewall, or accept it"
    return Check("docker host network", kept_off, text, fix)


def _docker_checks() -> list[Check]:
    return [
        check_program("docker", "docker.io"), check_docker_daemon(), check_docker_root(), check_docker_compose(),
        check_docker_storage(), check_docker_host_network(),
    ]  # fmt: skip


#: Backends whose environment ``diagnose`` builds when asked for (a docker one also starts a container).
BACKENDS = ("local", "simulated", "docker", "docker-fast", *_CLOUD)


#: How each cloud backend's rate-limit and quota answers reach the start window (harbor_async.backends.throttles).
_THROTTLES = {
    "runloop": "typed: its client's RateLimitError and any APIStatusError carry the HTTP status (429, or a 403 that "
    "names a quota); Retry-After from the response",
    "e2b": "typed: RateLimitException (its 429; a text naming a quota or a concurrency limit: a quota); no "
    "Retry-After (its errors keep no headers)",
    "daytona": "typed: DaytonaRateLimitError and any DaytonaError with a status (429, or a 403 that names a quota); "
    "Retry-After from the headers it keeps",
    "modal": "typed by class: ResourceExhaustedError (gRPC's RESOURCE_EXHAUSTED; its text decides rate limit or "
    "quota); no Retry-After",
}


def check_throttles(backend: str) -> Check:
    """Whether the backend's rate-limit and quota answers are typed for the adaptive start window (informational)."""
    return Check(f"{backend} throttle answers", True, _THROTTLES.get(backend, "untyped"))


def _cloud(backend: str) -> Callable[[], list[Check]]:
    return lambda: [check_package(_CLOUD[backend][0], ""), check_credentials(backend), check_throttles(backend)]


def _packages(*dists: str) -> Callable[[], list[Check]]:
    return lambda: [check_package(d) for d in dists]


#: Feature or backend name -> its checks. ``core`` is always requested.
FEATURES: dict[str, Callable[[], list[Check]]] = {
    "core": _core,
    "simulated": lambda: [],  # in-process: nothing beyond the core
    "local": _local,
    "limits": lambda: [check_cgroups()],
    "docker": _docker_checks,
    "docker-fast": _docker_checks,
    **{name: _cloud(name) for name in _CLOUD},
    "trl": _packages("trl", "datasets", "transformers", "torch"),  # the last two: whatever TRL accepts
    "eval": _packages("openai", "jinja2", "matplotlib"),
    "ray": _packages("ray"),
}


def diagnose(
    requested: Iterable[str] = ("local",),
    base_url: str | None = None,
    everything: bool = True,
    backend_kwargs: Mapping[str, Any] | None = None,
    suite: Path | None = None,
    models: Sequence[str] = (),
) -> Diagnosis:
    """Run the checks of every feature (or only the requested ones) and say which were asked for.

    A requested backend is also proven: its environment is built as a run
    builds it (with ``backend_kwargs``, for the suite's first task), and for
    docker one container is started and stopped from each image the suite needs.

    Args:
        requested: Backends and features the user wants to run (``core`` is
            added); the diagnosis is ``ok`` when all of their checks pass.
        base_url: An OpenAI-compatible server to reach (requested when given).
        everything: Also look at the other features, for the report.
        backend_kwargs: The options the run will pass (``--ek``).
        suite: The suite the run will use (default: the bundled one).

    Raises:
        KeyError: An unknown feature name.
    """
    wanted = ["core", *dict.fromkeys(r for r in requested if r != "core")]
    for name in wanted:
        if name not in FEATURES:
            raise KeyError(name)
    diagnosis = Diagnosis(requested=wanted + (["model-server"] if base_url else []))
    for name in FEATURES if everything else wanted:
        diagnosis.results[name] = FEATURES[name]()
    backends = [name for name in wanted if name in BACKENDS]
    if backends:
        tasks = load_suite(suite).tasks
        for name in backends:
            proof = [check_backend_environment(name, tasks[0], backend_kwargs)]
            daemon = [c for c in diagnosis.results[name] if c.name == "docker daemon"]
            if name in ("docker", "docker-fast") and all(c.ok for c in daemon):  # a dead daemon is said once
                proof += [check_docker_container(image) for image in base_images(tasks)]
            diagnosis.results[name] = [*diagnosis.results[name], *proof]
    if base_url:
        diagnosis.results["model-server"] = [check_model_server(base_url), *(check_model_chat(base_url, m) for m in models)]
    return diagnosis
