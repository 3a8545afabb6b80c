"""A sandbox's lifecycle on the real local backend, under asyncio and trio."""

from __future__ import annotations

import subprocess

import anyio
import pytest

from harbor_async.core.errors import Phase, SandboxClosedError, SandboxTimeout
from harbor_async.engine.engine import Engine
from harbor_async.engine.sandbox import SandboxState

pytestmark = [pytest.mark.anyio, pytest.mark.range, pytest.mark.uvloop_pass]


@pytest.fixture
def task(example_tasks):
    return next(t for t in example_tasks if t.name == "csv-column-sum")


async def test_exec_output_exit_code_and_truncation(task):
    async with Engine(max_output=50) as engine:
        async with engine.sandbox(task, "local") as sandbox:
            ok = await sandbox.exec("echo out; echo err >&2")
            assert (ok.stdout, ok.stderr, ok.output, ok.exit_code) == ("out\n", "err\n", "out\nerr\n", 0)
            failed = await sandbox.exec("exit 3")
            assert failed.exit_code == 3 and failed.output == ""
            long = await sandbox.exec("seq 1 1000")
            assert long.truncated and long.output.startswith("1\n2\n3\n")
            assert long.output.endswith("\n... [truncated]") and len(long.output) == 50 + len("\n... [truncated]")
            assert len(long.stdout) > 3000  # the raw stream is whole
            whole = await sandbox.exec("seq 1 1000", max_output=None)
            assert not whole.truncated and whole.output == long.stdout


async def test_upload_download_and_trial_dir(task, tmp_path):
    source = tmp_path / "in"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "data.txt").write_text("payload\n")
    (tmp_path / "single.txt").write_text("one file\n")
    async with Engine() as engine:
        async with engine.sandbox(task, "local") as sandbox:
            trial_dir = sandbox.trial_dir
            assert trial_dir is not None and trial_dir.is_dir()
            await sandbox.upload(source, "/workdir/uploaded")
            await sandbox.upload(tmp_path / "single.txt", "/workdir/single.txt")
            seen = await sandbox.exec("cat /workdir/uploaded/sub/data.txt /workdir/single.txt")
            assert seen.output == "payload\none file\n"
            await sandbox.exec("mkdir -p /workdir/out && echo result > /workdir/out/r.txt")
            await sandbox.download("/workdir/out", tmp_path / "back", directory=True)
            await sandbox.download("/workdir/single.txt", tmp_path / "single-back.txt")
        assert (tmp_path / "back" / "r.txt").read_text() == "result\n"
        assert (tmp_path / "single-back.txt").read_text() == "one file\n"
        assert sandbox.state is SandboxState.STOPPED
        assert not trial_dir.exists()  # Harbor's trial folder goes with the sandbox


@pytest.mark.slow
async def test_exec_timeout_kills_the_process_tree(task):
    marker = "harbor-async-timeout-marker-4711"
    async with Engine() as engine:
        async with engine.sandbox(task, "local") as sandbox:
            with pytest.raises(SandboxTimeout) as info:
                await sandbox.exec(f"sh -c 'sleep 300; echo {marker}' & sleep 300", timeout=0.5)
            assert info.value.phase is Phase.EXEC
            await anyio.sleep(0.2)
            left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
            assert left == ""
            # The sandbox is still usable after a timed-out command.
            assert (await sandbox.exec("echo alive")).output == "alive\n"


async def test_a_stopped_sandbox_refuses_work(task):
    async with Engine() as engine:
        async with engine.sandbox(task, "local") as sandbox:
            pass
        with pytest.raises(SandboxClosedError):
            await sandbox.exec("true")
        assert engine.live_sandboxes() == []
        await sandbox.stop()  # idempotent


def test_a_wrapped_errors_detail_names_its_root_cause():
    """Harbor's ``AddTestsDirError`` says only which step failed; the record must say why (a failed ``docker cp``)."""
    from harbor.verifier.verifier import AddTestsDirError

    from harbor_async.engine.sandbox import CAUSE_CHARS, _describe

    def wrapped(cause: str) -> AddTestsDirError:
        try:
            try:
                raise RuntimeError(cause)
            except RuntimeError as exc:
                raise AddTestsDirError("Failed to add tests directory to environment.") from exc
        except AddTestsDirError as exc:
            return exc

    detail = _describe(wrapped("cp error: Error response from daemon: container 1f2e is not running"))
    assert detail.startswith("AddTestsDirError: Failed to add tests directory to environment.")
    assert "(from RuntimeError: cp error: Error response from daemon: container 1f2e is not running)" in detail
    long = _describe(wrapped("head " + "x" * 10_000 + " tail"))
    assert "head" in long and "tail" in long and len(long) < 200 + CAUSE_CHARS  # both ends kept, bounded
    assert _describe(RuntimeError("alone")) == "RuntimeError: alone"  # no cause: nothing added
