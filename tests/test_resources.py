"""Per-sandbox resource telemetry: every record from local and docker says what its sandbox used.

A memory-hungry task (``tail`` holding an 80 MB line) beside a plain one, run
by ``harbor-async run`` on real sandboxes: each record's ``resources`` has CPU
seconds, peak memory, disk written, processes and sandbox-seconds; the hungry
task's peak shows in its record, in ``summary.json``'s job total and in the
report's resource table; ``--no-resource-telemetry`` reads nothing but the
billed seconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from harbor_async.core.records import EpisodeRecord
from harbor_async.core.usage import ResourceUsage
from harbor_async.report.analysis import resource_rows
from tests.cli_helpers import harbor_async, make_suite, records
from tests.requirements import needs_bwrap

HUNGRY_BYTES = 80_000_000
WRITTEN_BYTES = 6_000_000
# tail -n 1 keeps its last line whole: a line of 80 MB of zero bytes is 80 MB of tail's memory.
HOG = f"head -c {HUNGRY_BYTES} /dev/zero | tail -n 1 >/dev/null\nhead -c {WRITTEN_BYTES} /dev/urandom > /workdir/written.bin\n"


def _suite(root: Path) -> Path:
    suite = make_suite(root, ["plain", "hungry"])
    solve = suite / "tasks" / "hungry" / "solution" / "solve.sh"
    lines = solve.read_text().splitlines(keepends=True)
    solve.write_text(lines[0] + HOG + "".join(lines[1:]))
    return suite


def _run(tmp_path: Path, backend: str, *extra: str) -> tuple[dict[str, dict], Path]:
    jobs = tmp_path / "jobs"
    done = harbor_async(
        "run", "-p", str(_suite(tmp_path / "suite") / "tasks"), "-a", "oracle", "-e", backend, "-o", str(jobs),
        "--job-name", "job", "-n", "2", *extra, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    job = jobs / "job"
    billed = json.loads((job / "summary.json").read_text())["sandbox_seconds"]
    assert f"; {billed:.1f} sandbox-seconds" in done.stdout + done.stderr  # the end-of-run line: the job's figure
    found = {r["task"]: r for r in records(job)}
    assert sorted(found) == ["hungry", "plain"] and all(r["reward"] == 1.0 for r in found.values())
    return found, job


def _check_measured(found: dict[str, dict], job: Path, source: str) -> None:
    for record in found.values():
        usage = record["resources"]
        assert usage["source"] == source or usage["source"].startswith(source), usage
        assert usage["sandbox_seconds"] > 0 and usage["cpu_seconds"] > 0, usage
        assert usage["processes_peak"] >= 1 and usage["disk_written_bytes"] >= 0, usage
        # the episode's own seconds hold the sandbox's life (its create call to its stop's end)
        assert usage["sandbox_seconds"] <= record["seconds"]["total"] + 1e-3
    hungry, plain = found["hungry"]["resources"], found["plain"]["resources"]
    assert hungry["memory_peak_bytes"] >= HUNGRY_BYTES > 2 * plain["memory_peak_bytes"], (hungry, plain)
    assert hungry["disk_written_bytes"] >= WRITTEN_BYTES > plain["disk_written_bytes"], (hungry, plain)
    summary = json.loads((job / "summary.json").read_text())
    total = sum(r["resources"]["sandbox_seconds"] for r in found.values())
    assert summary["sandbox_seconds"] == pytest.approx(total, abs=2e-3)

    page = _report(job)
    table = page.split('id="resource-table"', 1)[1].split("</table>", 1)[0]
    rows = {cells[0]: cells for cells in (re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in table.split("<tr")[2:])}
    assert set(rows) == {"all tasks", "hungry", "plain"}
    shown = float(rows["hungry"][4].split()[0])  # peak memory in MiB, as the report prints it
    assert shown == pytest.approx(hungry["memory_peak_bytes"] / 2**20, abs=0.1) and shown >= HUNGRY_BYTES / 2**20
    assert rows["all tasks"][4] == rows["hungry"][4]  # the job's highest peak is the hungry task's


def _report(job: Path) -> str:
    out = job / "report.html"
    done = harbor_async("report", str(job), "-o", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return out.read_text()


@pytest.mark.slow
@needs_bwrap
def test_local_records_carry_what_each_sandbox_used(tmp_path: Path) -> None:
    found, job = _run(tmp_path, "local")
    _check_measured(found, job, "cgroup v")


@pytest.mark.slow
@needs_bwrap
def test_without_telemetry_only_the_billed_seconds_are_counted(tmp_path: Path) -> None:
    found, _ = _run(tmp_path, "local", "--no-resource-telemetry")
    for record in found.values():
        assert set(record["resources"]) == {"sandbox_seconds", "source"} and record["resources"]["source"] is None
        assert record["resources"]["sandbox_seconds"] > 0


@pytest.mark.slow
@pytest.mark.docker
def test_docker_records_carry_what_each_sandbox_used(tmp_path: Path, docker_daemon: str) -> None:
    # strict verify (the default) restarts the container before the verifier: its counters are read before and after
    found, job = _run(tmp_path, "docker")
    _check_measured(found, job, "docker cgroup v")  # the daemon on this machine: its cgroup, not its slow stats call


@pytest.mark.slow
@pytest.mark.docker
def test_a_compose_side_service_counts_beside_the_main_container(tmp_path: Path, docker_daemon: str) -> None:
    """A side service that spends a CPU second and holds 60 MB while the main container idles: both in the record."""
    suite = make_suite(tmp_path / "suite", ["plain", "busy-helper"])
    task = suite / "tasks" / "busy-helper"
    (task / "environment" / "docker-compose.yaml").write_text(
        "services:\n"
        "  helper:\n"
        "    image: debian:bookworm-slim\n"
        "    command: [\"bash\", \"-c\", \"head -c 60000000 /dev/zero | tail -n 1 >/dev/null; "
        "i=0; while [ $$i -lt 300000 ]; do i=$$((i+1)); done; exec sleep infinity\"]\n"
    )
    solve = task / "solution" / "solve.sh"
    lines = solve.read_text().splitlines(keepends=True)
    solve.write_text(lines[0] + "sleep 8\n" + "".join(lines[1:]))  # the agent waits for the helper's work to be done
    done = harbor_async(
        "run", "-p", str(suite / "tasks"), "-a", "oracle", "-e", "docker", "-o", str(tmp_path / "jobs"), "--job-name", "job",
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    found = {r["task"]: r["resources"] for r in records(tmp_path / "jobs" / "job")}
    busy, plain = found["busy-helper"], found["plain"]
    assert busy["source"].endswith(", 2 containers") and ", " not in plain["source"], (busy, plain)
    assert busy["memory_peak_bytes"] >= 60_000_000 > 2 * plain["memory_peak_bytes"], (busy, plain)
    assert busy["cpu_seconds"] > plain["cpu_seconds"] + 0.3, (busy, plain)
    assert busy["processes_peak"] > plain["processes_peak"], (busy, plain)


def test_side_by_side_containers_add_up_even_their_peaks() -> None:
    main = ResourceUsage(cpu_seconds=1.5, memory_peak_bytes=900, disk_written_bytes=10, processes_peak=4, source="docker cgroup v1")
    helper = ResourceUsage(cpu_seconds=0.5, memory_peak_bytes=100, disk_written_bytes=None, processes_peak=2, source="docker cgroup v1")
    both = main.beside(helper)
    assert (both.cpu_seconds, both.memory_peak_bytes, both.disk_written_bytes, both.processes_peak) == (2.0, 1000, 10, 6)
    assert ResourceUsage().beside(ResourceUsage()).cpu_seconds is None


def test_a_restart_adds_cpu_and_keeps_the_higher_peaks() -> None:
    before = ResourceUsage(cpu_seconds=1.5, memory_peak_bytes=900, disk_written_bytes=10, processes_peak=40, source="docker cgroup v1")
    after = ResourceUsage(cpu_seconds=0.25, memory_peak_bytes=100, disk_written_bytes=30, processes_peak=2, source="docker cgroup v1")
    both = before.then(after)
    assert (both.cpu_seconds, both.memory_peak_bytes, both.disk_written_bytes, both.processes_peak) == (1.75, 900, 30, 40)
    assert ResourceUsage().then(ResourceUsage()).cpu_seconds is None  # nothing measured stays unmeasured
    record = both.as_record(2.5)
    assert list(record) == ["sandbox_seconds", "cpu_seconds", "memory_peak_bytes", "disk_written_bytes", "processes_peak", "source"]


def test_report_rows_sum_seconds_and_keep_the_highest_peaks() -> None:
    def record(task: str, seconds: float, peak: int | None) -> EpisodeRecord:
        usage = {"sandbox_seconds": seconds, "cpu_seconds": seconds / 2, "source": "cgroup v1"}
        if peak is not None:
            usage["memory_peak_bytes"] = peak
        return EpisodeRecord(task=task, resources=usage)

    rows = resource_rows([record("a", 1.0, 5), record("a", 2.0, 9), record("b", 4.0, None), EpisodeRecord(task="c")])
    total, a, b = rows
    assert (total["task"], total["measured"], total["sandbox_seconds"], total["memory_peak_bytes"]) == (None, 3, 7.0, 9)
    assert (a["task"], a["measured"], a["cpu_seconds"], a["memory_peak_bytes"]) == ("a", 2, 1.5, 9)
    assert (b["task"], b["memory_peak_bytes"], b["processes_peak"]) == ("b", None, None)
    assert resource_rows([EpisodeRecord(task="c")]) == []


@pytest.mark.slow
@pytest.mark.docker
def test_docker_daemon_stats_where_the_cgroup_cannot_be_read(docker_daemon: str, monkeypatch, tmp_path: Path) -> None:
    """A daemon elsewhere (its cgroups not on this machine): the daemon's own stats, which agree with the cgroup's."""
    from harbor_async.backends.docker import usage

    made = subprocess.run(
        ["docker", "run", "-d", "--network", "none", "debian:bookworm-slim", "sh", "-c",
         f"head -c {HUNGRY_BYTES} /dev/zero | tail -n 1 >/dev/null; head -c {WRITTEN_BYTES} /dev/zero > /big; sleep 600"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    container = made.stdout.strip()
    try:
        deadline = time.monotonic() + 60
        while (local := usage.container_usage(container)).disk_written_bytes < WRITTEN_BYTES:
            time.sleep(0.1)
            assert time.monotonic() < deadline, local
        monkeypatch.setattr(usage, "_CGROUP", tmp_path / "no-cgroups")
        remote = usage.container_usage(container)
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)
    assert local.source.startswith("docker cgroup") and remote.source == "docker daemon"
    assert remote.cpu_seconds == pytest.approx(local.cpu_seconds, rel=0.05, abs=0.02)
    assert remote.disk_written_bytes == local.disk_written_bytes >= WRITTEN_BYTES
    assert local.memory_peak_bytes >= HUNGRY_BYTES and local.processes_peak >= 2
    if local.source.endswith("v1"):  # the daemon reports a peak on cgroup v1 only
        assert remote.memory_peak_bytes == local.memory_peak_bytes
    assert remote.processes_peak is None  # not in the daemon's stats
