"""The local backend's ready sandboxes (harbor_async.backends.local.pool) and the throughput floor.

A start takes a never-used sandbox made ahead while an engine is open (the
default; ``HARBOR_ASYNC_LOCAL_POOL=0`` turns it off); nothing one sandbox wrote
reaches the next, and closing the engine (also by cancellation) removes every
piece of its run not taken, whatever other engines hold.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path

import anyio
import pytest

from harbor_async.backends.local.pool import POOL
from harbor_async.engine.engine import Engine
from harbor_async.tasks.suite import load_suite
from tests.requirements import needs_bwrap

pytestmark = [needs_bwrap]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _task():
    return load_suite(None).tasks[0]


def _mine(root: Path) -> list:
    """The ready pieces under the sandbox root ``root`` (other tests' engines, a shim's open until exit, may
    hold the pool for their runs too)."""
    return [piece for piece in POOL.ready() if piece.folder.parent == root]


async def _wait_ready(root: Path, count: int = 1, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(_mine(root)) < count:
        assert time.monotonic() < deadline, "the pool made no sandbox ahead"
        await anyio.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.anyio
async def test_a_pooled_sandbox_never_sees_what_an_earlier_one_wrote(tmp_path: Path) -> None:
    plant = "echo planted > /etc/planted; echo planted > /tmp/planted; echo x >> /etc/passwd; mkdir -p /workdir/mine"
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "sb")}) as engine:
        async with engine.sandbox(_task(), "local") as first:
            assert (await first.exec(plant)).exit_code == 0
            first_root = first.environment.root
        await _wait_ready(tmp_path / "sb")
        taken = POOL.taken
        async with engine.sandbox(_task(), "local") as second:
            assert POOL.taken == taken + 1  # this one came from the pool
            result = await second.exec(
                "ls /etc/planted /tmp/planted /workdir/mine 2>&1; grep -c '^x$' /etc/passwd; cat /etc/hostname"
            )
            assert second.environment.root == first_root.parent / second.environment.root.name
            assert second.environment.root != first_root
        assert result.stdout.count("No such file") == 3, result.stdout
        assert "\n0\n" in result.stdout and result.stdout.endswith("sandbox\n")


@pytest.mark.anyio
async def test_closing_the_engine_removes_every_pooled_piece_even_when_cancelled(tmp_path: Path) -> None:
    base = tmp_path / "sb"
    with anyio.move_on_after(60) as scope:
        async with Engine(backend_kwargs={"sandbox_root": str(base)}) as engine:
            async with engine.sandbox(_task(), "local") as sandbox:
                await sandbox.exec("true")
            await _wait_ready(base, 2)
            pieces = _mine(base)
            label = engine.run_label
            folders = [p.folder for p in pieces]
            mounts = [p.mount for p in pieces if p.mount is not None]
            cgroups = [f for p in pieces if p.confinement.cgroups is not None for f in p.confinement.cgroups.folders]
            keepers = [p.keeper.process.pid for p in pieces if p.keeper is not None]
            assert all(folder.is_dir() for folder in folders) and all(_alive(pid) for pid in keepers)
            assert all(Path(m).is_dir() for m in mounts) and all(c.is_dir() for c in cgroups)
            async with engine.sandbox(_task(), "local") as sandbox:
                scope.cancel()  # the engine closes by cancellation, a sandbox running
                await sandbox.exec("sleep 30")
    assert scope.cancelled_caught
    assert _mine(base) == [] and not POOL.holds(label)
    assert not [f for f in folders if f.exists()]
    assert not [m for m in mounts if os.path.lexists(m)]
    assert not [c for c in cgroups if c.exists()]
    assert not [pid for pid in keepers if _alive(pid)]
    assert not list(base.iterdir())  # no sandbox folder left either


@pytest.mark.anyio
async def test_the_pool_is_on_by_default_and_off_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HARBOR_ASYNC_LOCAL_POOL", raising=False)
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "on")}) as engine:
        async with engine.sandbox(_task(), "local") as sandbox:
            assert POOL.holds(engine.run_label)
        await _wait_ready(tmp_path / "on")
    monkeypatch.setenv("HARBOR_ASYNC_LOCAL_POOL", "0")
    taken = POOL.taken
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "off")}) as engine:
        async with engine.sandbox(_task(), "local") as sandbox:
            assert (await sandbox.exec("echo ok")).output.strip() == "ok"
        assert not POOL.holds(engine.run_label) and _mine(tmp_path / "off") == []  # no hold: nothing made ahead
        async with engine.sandbox(_task(), "local") as sandbox:
            await sandbox.exec("true")
    assert POOL.taken == taken


@pytest.mark.slow
@pytest.mark.anyio
async def test_closing_one_run_removes_its_pieces_and_leaves_another_runs(tmp_path: Path) -> None:
    """The pieces of a closed engine's run go with it, also while another engine (a shim's, open until
    exit) holds the pool; none is made for it afterwards."""
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "kept")}) as kept:
        async with kept.sandbox(_task(), "local") as sandbox:
            await sandbox.exec("true")
        async with Engine(backend_kwargs={"sandbox_root": str(tmp_path / "closed")}) as closed:
            async with closed.sandbox(_task(), "local") as sandbox:
                await sandbox.exec("true")
            await _wait_ready(tmp_path / "closed")
            mine = _mine(tmp_path / "closed")
            keepers = [p.keeper.process.pid for p in mine if p.keeper is not None]
            assert mine and all(_alive(pid) for pid in keepers)
        assert POOL.holds(kept.run_label) and not POOL.holds(closed.run_label)
        POOL.ready(settle=10.0)
        await _wait_ready(tmp_path / "kept")  # the open run keeps (and gets) its pieces
        assert _mine(tmp_path / "closed") == []
        assert not [p.folder for p in mine if p.folder.exists()] and not [pid for pid in keepers if _alive(pid)]
        POOL.ready(settle=10.0)
        # nothing more is made for the closed run: the thread wants no piece of it (it makes only what it wants)
        assert [key for key in POOL.wanted() if key[1] == closed.run_label] == []
        assert _mine(tmp_path / "closed") == [] and not list((tmp_path / "closed").iterdir())
    assert _mine(tmp_path / "kept") == [] and not POOL.holds(kept.run_label) and not list((tmp_path / "kept").iterdir())


def test_without_an_engine_nothing_is_made_ahead(tmp_path: Path) -> None:
    assert POOL.take((str(tmp_path), "x", None, True), None) is None  # type: ignore[arg-type]
    assert _mine(tmp_path) == [] and not POOL.holds("x")


@pytest.mark.slow
@pytest.mark.anyio
async def test_throughput_measures_the_bwrap_floor_in_the_same_run() -> None:
    from rich.console import Console

    from benchmarks.report import throughput_table
    from benchmarks.throughput import FLOOR_ARGS, run_throughput
    from harbor_async.report.bench import BenchmarkSection, _throughput

    result = await run_throughput(episodes=2, concurrency=1, backend="local", sample_memory=False, floor_samples=3)
    assert result.failures == 0
    assert result.bwrap_floor_argv == [shutil.which("bwrap"), *FLOOR_ARGS]
    assert result.bwrap_floor_p50_ms is not None and result.bwrap_floor_p50_ms > 0
    start_ms = result.phases["start"]["p50"] * 1e3
    assert result.start_over_floor == round(start_ms / result.bwrap_floor_p50_ms, 2)
    printed = io.StringIO()
    Console(file=printed, width=400).print(throughput_table([result]))
    assert "start/bwrap" in printed.getvalue() and f"{result.start_over_floor:.2f}x" in printed.getvalue()
    assert result.bwrap_floor_concurrent_p50_ms is None  # one at a time: the floor above is the one
    busy = await run_throughput(episodes=4, concurrency=2, backend="local", sample_memory=False, floor_samples=3)
    assert busy.failures == 0 and busy.bwrap_floor_concurrent_p50_ms is not None and busy.bwrap_floor_concurrent_p50_ms > 0
    assert busy.start_over_concurrent_floor == round(busy.phases["start"]["p50"] * 1e3 / busy.bwrap_floor_concurrent_p50_ms, 2)
    section = BenchmarkSection("throughput-local", "throughput", [])
    _throughput(section, {"runs": [result.to_dict()]})
    assert "start p50 / bwrap" in section.tables[0].columns
    _throughput(section, {"runs": [busy.to_dict()]})
    assert f"{busy.start_over_concurrent_floor:g}" in section.tables[-1].rows[0]
    simulated = await run_throughput(episodes=1, concurrency=1, backend="simulated", sample_memory=False)
    assert simulated.bwrap_floor_p50_ms is None and simulated.start_over_floor is None  # the floor is local's


@pytest.mark.slow
@pytest.mark.anyio
async def test_no_piece_is_made_while_a_start_builds_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Pieces are made with time starts leave over: while one builds its own, the pool's thread waits."""
    from harbor_async.backends.local.pool import discard_piece

    asked: list = []
    take = POOL.take
    monkeypatch.setattr(POOL, "take", lambda key, tools: asked.append((key, tools)) or take(key, tools))
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path)}) as engine:
        async with engine.sandbox(_task(), "local") as sandbox:
            await sandbox.exec("true")
        key, tools = asked[0]
        await _wait_ready(tmp_path)
        POOL.ready(settle=10.0)
        with POOL.building_own():
            taken = []
            while (piece := take(key, tools)) is not None:  # each miss asks the thread for more
                taken.append(piece)
            for piece in taken:
                await anyio.to_thread.run_sync(discard_piece, piece)
            POOL.ready(settle=10.0)
            assert POOL.wanted() == [] and _mine(tmp_path) == []  # asked, and none wanted or made meanwhile
        await _wait_ready(tmp_path)  # made once no start builds its own


@pytest.mark.anyio
async def test_a_tasks_part_is_read_ahead_from_its_second_start(tmp_path: Path) -> None:
    """A task that runs once applies its own lines; one that starts again has its part read once per run, then
    written; a later run reads it again (its files may have changed)."""
    from harbor_async.backends.local import template

    def parts(label: str) -> tuple[list, list]:
        return [k for k in template._tasks if k[0] == label], [k for k in template._seen if k[0] == label]

    task = _task()
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path)}) as engine:
        label = engine.run_label
        async with engine.sandbox(task, "local") as sandbox:
            assert (await sandbox.exec("pwd")).exit_code == 0
        read, seen = parts(label)
        assert read == [] and len(seen) == 1
        for _ in range(2):
            async with engine.sandbox(task, "local") as sandbox:
                listed = await sandbox.exec("pwd; ls -A")
        read, seen = parts(label)
        assert len(read) == 1 and template._tasks[read[0]]  # the WORKDIR at least
    assert parts(label) == ([], [])  # forgotten with the run
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path)}) as engine:
        async with engine.sandbox(task, "local") as sandbox:
            first = await sandbox.exec("pwd; ls -A")
    assert first.output == listed.output  # the same tree either way


def test_a_release_after_the_exit_close_is_a_no_op() -> None:
    """At exit the pool's own close runs before the loop's engines release their holds: they must not fail."""
    from harbor_async.backends.local.pool import RootPool

    pool = RootPool()
    first, second = pool.hold("run-a"), pool.hold("run-b")
    pool.close()
    assert not pool.holds("run-a") and not pool.holds("run-b")
    first()
    second()
    assert not pool.holds("run-a") and not pool.holds("run-b")


def test_a_kind_that_could_not_be_made_is_tried_again_after_a_while(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failed piece turns the pool off for its kind (starts build their own, and say why), not for the run."""
    from harbor_async.backends.local import pool as pool_module
    from harbor_async.backends.local.keeper import find_tools
    from harbor_async.backends.local.limits import ResourceLimits

    tried: list[Path] = []
    real = pool_module.build_piece
    monkeypatch.setattr(pool_module, "build_piece", lambda folder, *rest: tried.append(folder) or real(folder, *rest))
    blocked = tmp_path / "base"
    blocked.write_text("a file where the sandbox folders go: every piece fails")
    pool = pool_module.RootPool()
    release = pool.hold("run-f")
    key = (str(blocked), "run-f", ResourceLimits(), False, ())  # no host binds (--mounts)
    try:
        assert pool.take(key, find_tools()) is None
        deadline = time.monotonic() + 20
        while not pool._failed:
            assert time.monotonic() < deadline, "the pool never tried"
            time.sleep(0.02)
        pool.ready(settle=10.0)
        attempts = len(tried)
        assert pool.take(key, find_tools()) is None  # within the wait: not tried again
        assert pool.wanted() == [] and pool.ready(settle=10.0) == [] and len(tried) == attempts
        monkeypatch.setattr(pool_module, "RETRY_FAILED_AFTER", 0.0)
        assert pool.take(key, find_tools()) is None  # past it: tried again
        deadline = time.monotonic() + 20
        while len(tried) == attempts:
            assert time.monotonic() < deadline, "the pool did not try the kind again"
            time.sleep(0.02)
    finally:
        release()
    assert not [p for p in tmp_path.iterdir() if p != blocked]


@pytest.mark.anyio
async def test_the_pool_holds_the_run_label_the_sandboxes_get(tmp_path: Path) -> None:
    """A ``run_label`` backend option names the sandboxes' run: the pool keeps pieces for that label."""
    async with Engine(backend_kwargs={"sandbox_root": str(tmp_path), "run_label": "my-run"}) as engine:
        async with engine.sandbox(_task(), "local") as sandbox:
            await sandbox.exec("true")
            assert POOL.holds("my-run") and not POOL.holds(engine.run_label)
        await _wait_ready(tmp_path)
        taken = POOL.taken
        async with engine.sandbox(_task(), "local") as sandbox:
            assert POOL.taken == taken + 1
    assert not POOL.holds("my-run") and _mine(tmp_path) == []


def _no_thread_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Python 3.12 does from the start of its exit on: every ``Thread.start`` raises."""
    import threading

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)


def test_a_keeper_asked_for_at_interpreter_exit_is_refused_and_the_thread_starts_when_it_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C during a sandbox's start: the start asks for its keeper while Python exits. Once the thread could
    not start, a later ask (the pool's piece) used to be queued for a thread that never ran, and the exit waited
    60 s on it; now each such ask fails at once, and the thread starts on the first ask that may start it."""
    from harbor_async.backends.local.keeper import KeeperThread

    keepers = KeeperThread()
    with monkeypatch.context() as patched:
        _no_thread_may_start(patched)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="interpreter shutdown"):
                keepers.submit(lambda: "forked").result(timeout=5)
    assert keepers.submit(lambda: "forked").result(timeout=5) == "forked"


def test_the_pool_asked_for_more_at_interpreter_exit_fails_no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from harbor_async.backends.local.pool import RootPool

    pool = RootPool()
    key = ("/nowhere", "ha1x000000", None, (), ())
    release = pool.hold(key[1])
    with monkeypatch.context() as patched:
        _no_thread_may_start(patched)
        assert pool.take(key, tools=object()) is None  # a miss asks for more: no thread, no error
    assert pool.missed == 1 and pool._thread is None
    release()
