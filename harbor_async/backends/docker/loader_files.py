"""The dynamic loader's files of a stopped container, put back to its image's before its main command starts again.

A strict verify restarts the main container (:meth:`~.ConfinedDockerEnvironment.end_agent_processes`):
every process of the agent's ends. But the main command then starts again in the
container's files, and the loader reads the container's ``/etc/ld.so.preload``
and ``/etc/ld.so.cache``, which the agent may have written: a library it named
there, loaded into the restarted main command, forked a daemon that ran beside
the tests (``tests/attacks/init_daemon.c``). So the container is stopped, and
while nothing runs in it:

- its ``/etc/ld.so.preload``, if any, is copied out (at most
  :data:`MAX_PRELOAD` bytes) and written back as ``ld.so.preload`` +
  :data:`HIDDEN_SUFFIX`, and the list itself is emptied (``docker cp`` can
  replace a file, not remove one; an empty list preloads nothing);
- its ``/etc/ld.so.cache`` is the image's again (read once per image from a
  container created, never started, from it; an image without one gets an
  empty file, which the loader ignores).

Everything goes through the daemon (``docker cp``), which resolves the paths
within the container's root as the loader does; nothing runs in the container.
"""

from __future__ import annotations

import asyncio
import io
import tarfile

from harbor_async.verification.isolation import CACHE, HIDDEN_SUFFIX, PRELOAD

#: The most of an agent's preload list kept aside (a list of library paths is short).
MAX_PRELOAD = 64 * 1024
#: Each image's ``/etc/ld.so.cache`` (None: the image has none), by image id.
_IMAGE_CACHES: dict[str, bytes | None] = {}
_MAX_CACHE = 16 * 1024 * 1024


class LoaderResetError(RuntimeError):
    """The daemon could not read or write a stopped container's loader files (the host's failure)."""


async def _docker(*args: str, stdin: bytes | None = None) -> bytes:
    process = await asyncio.create_subprocess_exec(
        "docker", *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await process.communicate(stdin)
    if process.returncode != 0:
        raise LoaderResetError(f"docker {args[0]} failed: {err.decode(errors='replace').strip()[-300:]}")
    return out


class _TooLarge:
    """A file past the limit: read no further (its content is not kept)."""


TOO_LARGE = _TooLarge()


async def _read_file(container: str, path: str, limit: int) -> tarfile.TarInfo | tuple[tarfile.TarInfo, bytes] | _TooLarge | None:
    """``path`` of ``container`` as one tar member (None: no such file): a regular file with its bytes,
    :data:`TOO_LARGE` past ``limit`` (the stream is cut there: the host never holds more), else the member alone."""
    process = await asyncio.create_subprocess_exec(
        "docker", "cp", f"{container}:{path}", "-",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    out = bytearray()
    while chunk := await process.stdout.read(1 << 16):
        out += chunk
        if len(out) > limit + 4096:  # a tar header and padding beside the content
            process.kill()
            await process.wait()
            return TOO_LARGE
    err = await process.stderr.read(4096)
    if await process.wait() != 0:
        text = err.decode(errors="replace")
        if "Could not find the file" in text or "No such container:path" in text:
            return None
        raise LoaderResetError(f"docker cp {path} failed: {text.strip()[-300:]}")
    try:
        with tarfile.open(fileobj=io.BytesIO(bytes(out))) as archive:
            member = archive.next()
            if member is None:
                return None
            if not member.isfile():
                return member
            data = archive.extractfile(member)
            return member, (data.read() if data is not None else b"")
    except tarfile.TarError as exc:
        raise LoaderResetError(f"docker cp {path}: unreadable archive: {exc}") from exc


async def image_cache(image: str) -> bytes | None:
    """``/etc/ld.so.cache`` of ``image`` (an id), from a container created and never started; cached per image."""
    if image not in _IMAGE_CACHES:
        created = (await _docker("create", image)).decode().strip()
        try:
            found = await _read_file(created, "/etc/ld.so.cache", _MAX_CACHE)
        finally:
            await _docker("rm", "-f", created)
        _IMAGE_CACHES[image] = found[1] if isinstance(found, tuple) else None  # past 16 MiB: none (ignored)
    return _IMAGE_CACHES[image]


def _regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.uid, member.gid = len(data), 0o644, 0, 0
    return member, data


async def reset_loader_files(container: str) -> list[str]:
    """In the stopped ``container``: the preload list moved aside and emptied, the cache the image's. Returns what changed.

    Raises:
        LoaderResetError: the daemon failed (reading, creating or copying).
    """
    image = (await _docker("inspect", "--format", "{{.Image}}", container)).decode().strip()
    entries: list[tuple[tarfile.TarInfo, bytes]] = []
    changed = []
    preload = await _read_file(container, f"/etc/{PRELOAD}", MAX_PRELOAD)
    # A folder (or anything but a file or a link) preloads nothing: left as it is.
    if isinstance(preload, tuple) and preload[1].strip() or preload is TOO_LARGE:
        if isinstance(preload, tuple):
            entries.append(_regular(PRELOAD + HIDDEN_SUFFIX, preload[1]))
        entries.append(_regular(PRELOAD, b""))
        changed.append(f"/etc/{PRELOAD}")
    elif isinstance(preload, tarfile.TarInfo) and preload.issym():  # kept as what it is, never followed here
        link = tarfile.TarInfo(PRELOAD + HIDDEN_SUFFIX)
        link.type, link.linkname = tarfile.SYMTYPE, preload.linkname
        entries += [(link, b""), _regular(PRELOAD, b"")]
        changed.append(f"/etc/{PRELOAD}")
    cache = await _read_file(container, f"/etc/{CACHE}", _MAX_CACHE)
    # Missing, or a folder: the loader searches its default folders only, nothing of the agent's.
    if isinstance(cache, tuple) or cache is TOO_LARGE or isinstance(cache, tarfile.TarInfo) and cache.issym():
        pristine = await image_cache(image)
        if not (isinstance(cache, tuple) and cache[1] == pristine):
            if isinstance(cache, tuple):
                entries.append(_regular(CACHE + HIDDEN_SUFFIX, cache[1]))
            elif isinstance(cache, tarfile.TarInfo):
                link = tarfile.TarInfo(CACHE + HIDDEN_SUFFIX)
                link.type, link.linkname = tarfile.SYMTYPE, cache.linkname
                entries.append((link, b""))
            entries.append(_regular(CACHE, pristine or b""))
            changed.append(f"/etc/{CACHE}")
    if entries:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for member, data in entries:
                archive.addfile(member, io.BytesIO(data) if member.isfile() else None)
        await _docker("cp", "-", f"{container}:/etc", stdin=buffer.getvalue())
    return changed
