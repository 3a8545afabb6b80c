"""Honest about images: the local backend runs the host's userland, whatever ``FROM`` says.

A task built for ``python:3.12-slim`` or ``ubuntu:24.04`` runs here on the
host's ``/usr``. When the image is not the host's distribution and release
(compared with the host's ``os-release``), the warning says so, naming the
image; :func:`task_image_mismatch` lets ``harbor-async tasks -e local`` mark
the tasks this affects.
"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

#: Images named after a distribution, and the ``os-release`` ID each is.
_DISTRO_IMAGES = {
    "debian": "debian", "ubuntu": "ubuntu", "fedora": "fedora", "alpine": "alpine",
    "centos": "centos", "rockylinux": "rocky", "almalinux": "almalinux", "archlinux": "arch",
    "opensuse/leap": "opensuse-leap", "amazonlinux": "amzn",
}  # fmt: skip


@functools.cache
def host_os_release() -> dict[str, str]:
    """The host's ``os-release`` fields (``ID``, ``VERSION_ID``, ``VERSION_CODENAME`` ...)."""
    for name in ("/etc/os-release", "/usr/lib/os-release"):
        try:
            text = Path(name).read_text()
        except OSError:
            continue
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                fields[key.strip()] = " ".join(shlex.split(value)) if value.strip() else ""
        return fields
    return {}


def final_image(dockerfile_text: str) -> str | None:
    """The image of a Dockerfile's final ``FROM`` (``None`` when there is none)."""
    image = None
    for line in dockerfile_text.splitlines():
        match = re.match(r"\s*FROM\s+(?:--platform=\S+\s+)?(\S+)", line, re.I)
        if match:
            image = match.group(1)
    return image


def _matches_host(image: str, host: dict[str, str]) -> bool:
    name, _, tag = image.partition("@")[0].rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
    if not name:
        name, tag = image, ""
    for prefix in ("docker.io/library/", "docker.io/", "library/"):
        name = name.removeprefix(prefix)
    distro = _DISTRO_IMAGES.get(name)
    if distro is None or distro != host.get("ID"):
        return False
    release = {host.get("VERSION_ID", ""), host.get("VERSION_CODENAME", "")} - {""}
    # "bookworm-slim", "12.5", "22.04": the release is the tag's first part
    first = re.split(r"[-_]", tag)[0] if tag else ""
    return bool(first) and any(first == r or first.startswith(r + ".") for r in release)


def image_mismatch(dockerfile_text: str, docker_image: str | None = None) -> str | None:
    """A warning when the task's image is not the host userland that stands in for it, else ``None``."""
    image = final_image(dockerfile_text) if dockerfile_text else docker_image
    if not image or image.lower() == "scratch":
        return None
    host = host_os_release()
    if _matches_host(image, host):
        return None
    here = host.get("PRETTY_NAME") or f"{host.get('ID', '?')} {host.get('VERSION_ID', '')}".strip()
    return (
        f"FROM {image} is not emulated: the local backend runs this host's userland ({here}), "
        "so the image's distribution, release and installed packages are not what the task gets"
    )


def task_image_mismatch(task_dir: Path, docker_image: str | None = None) -> str | None:
    """:func:`image_mismatch` for a task folder (its ``environment/Dockerfile``), for ``harbor-async tasks``."""
    dockerfile = task_dir / "environment" / "Dockerfile"
    try:
        text = dockerfile.read_text()
    except OSError:
        text = ""
    return image_mismatch(text, docker_image)
