"""The loader's files of a sandbox are put back to the host's before a new init starts over it (no bwrap needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harbor_async.backends.local.hostfs import openat2_available
from harbor_async.backends.local.loader_files import HOST_CACHE, reset_loader_files
from harbor_async.verification.isolation import HIDDEN_SUFFIX

pytestmark = pytest.mark.skipif(not openat2_available(), reason="openat2 (Linux 5.6+) is required by the local backend")


def reset(root: Path) -> list[str]:
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        return reset_loader_files(fd, None)
    finally:
        os.close(fd)


def test_the_agents_preload_list_is_moved_aside_and_its_cache_replaced_by_the_hosts(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "ld.so.preload").write_text("/app/forge.so\n")
    (etc / "ld.so.cache").write_bytes(b"the agent's cache")
    assert reset(tmp_path) == ["/etc/ld.so.preload", "/etc/ld.so.cache"]
    assert not (etc / "ld.so.preload").exists()
    assert (etc / f"ld.so.preload{HIDDEN_SUFFIX}").read_text() == "/app/forge.so\n"  # nothing lost
    assert (etc / f"ld.so.cache{HIDDEN_SUFFIX}").read_bytes() == b"the agent's cache"
    if os.path.isfile(HOST_CACHE):
        assert (etc / "ld.so.cache").read_bytes() == Path(HOST_CACHE).read_bytes()
    assert reset(tmp_path) == []  # the host's files already: nothing to do


def test_a_link_is_resolved_as_the_loader_would_within_the_root_and_nothing_outside_is_touched(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "ld.so.preload").write_text("host file\n")
    root = tmp_path / "root"
    (root / "elsewhere").mkdir(parents=True)
    (root / "elsewhere" / "ld.so.preload").write_text("/app/forge.so\n")
    (root / "etc").symlink_to("/elsewhere")  # absolute: the sandbox's own /elsewhere, never the host's
    reset(root)
    assert not (root / "elsewhere" / "ld.so.preload").exists()
    assert (outside / "ld.so.preload").read_text() == "host file\n"
    # a preload entry that is itself a link (to a host path) is moved as a link, never followed
    (root / "elsewhere" / "ld.so.preload").symlink_to(outside / "ld.so.preload")
    reset(root)
    assert (root / "elsewhere" / f"ld.so.preload{HIDDEN_SUFFIX}").is_symlink()
    assert (outside / "ld.so.preload").read_text() == "host file\n"


def test_a_sandbox_without_etc_or_with_a_link_out_of_its_root_is_left_alone(tmp_path: Path) -> None:
    assert reset(tmp_path) == []
    (tmp_path / "etc").symlink_to("/proc/self/root/etc")  # a magic link: refused by the in-root resolution
    assert reset(tmp_path) == []
