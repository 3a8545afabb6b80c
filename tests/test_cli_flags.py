"""Harbor's dialect: every flag of `run`, `tasks`, `bench` and `sandboxes`, each doing what `harbor run`'s does."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harbor_async.jobs.scoring import pass_at_k
from tests.cli_helpers import REPO, harbor_async, make_suite, records
from tests.requirements import needs_bwrap


def run_job(tmp_path, *args: str, name: str = "j", code: int = 0):
    result = harbor_async("run", "-o", str(tmp_path / "jobs"), "--job-name", name, *args)
    assert result.returncode == code, result.stdout + result.stderr
    job = tmp_path / "jobs" / name
    return result, records(job), json.loads((job / "summary.json").read_text())


@pytest.mark.slow
def test_version():
    from importlib.metadata import version

    result = harbor_async("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"harbor-async {version('harbor-async')}"


@pytest.mark.slow
def test_path_env_agent_and_concurrency(tmp_path):
    suite = make_suite(tmp_path / "suite", ["t1", "t2", "t3"])
    _, found, summary = run_job(tmp_path, "-p", str(suite), "-e", "local", "-a", "none", "-n", "3")
    assert sorted(r["task"] for r in found) == ["t1", "t2", "t3"]
    assert all(r["agent"] == "none" and r["reward"] == 0.0 and r["error_class"] is None for r in found)
    assert sorted(r["task_path"] for r in found) == ["t1", "t2", "t3"]  # the path in the suite, as eval records it
    assert summary["mean_reward"] == 0.0


@pytest.mark.slow
def test_n_concurrent_bounds_the_live_sandboxes(tmp_path):
    # 4 episodes whose start takes 0.5 s, 2 at once: two waves of starts.
    _, found, _ = run_job(tmp_path, "-e", "simulated", "--ek", "start_latency=0.5", "-l", "4", "-n", "2")
    starts = sorted(r["started_at"] for r in found)
    assert len(starts) == 4 and starts[1] < starts[2]
    first_wave = [r for r in found if r["started_at"] in starts[:2]]
    late = [r for r in found if r["started_at"] in starts[2:]]
    assert min(x["started_at"] for x in late) > max(x["started_at"] for x in first_wave)


@pytest.mark.slow
def test_n_attempts_gives_k_episodes_per_task_and_pass_at_k(tmp_path):
    result, found, summary = run_job(
        tmp_path, "-e", "simulated", "-l", "3", "-k", "4", "--ek", "verify_failure_rate=0.5", "--ek", "seed=7"
    )
    assert len(found) == 12
    by_task: dict[str, list[dict]] = {}
    for r in found:
        by_task.setdefault(r["task_path"], []).append(r)
    assert all(sorted(r["attempt"] for r in rs) == [0, 1, 2, 3] for rs in by_task.values())
    assert {r["error_class"] for r in found} == {None, "verifier"}  # the seeded faults hit some
    expected = {
        k: sum(pass_at_k(4, sum(r["reward"] == 1.0 for r in rs), k) for rs in by_task.values()) / 3 for k in (1, 2, 4)
    }
    assert {k: summary["pass_at_k"][str(k)]["value"] for k in (1, 2, 4)} == expected
    assert "pass@1" in result.stdout and "pass@4" in result.stdout


@pytest.mark.slow
def test_include_exclude_globs_then_n_tasks(tmp_path):
    result = harbor_async("tasks", "-i", "csv-*", "-x", "*-sum")
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"│\s+\d+\s+│\s+(\S+)", result.stdout)
    assert listed == ["csv-group-by", "csv-max-price"]
    _, found, _ = run_job(tmp_path, "-e", "simulated", "-i", "csv-*", "-i", "word-*", "-x", "*-sum", "-l", "2")
    assert [r["task"] for r in sorted(found, key=lambda r: r["task"])] == ["csv-group-by", "csv-max-price"]
    nothing = harbor_async("run", "-e", "simulated", "-i", "nope-*", "-o", str(tmp_path / "none"))
    assert nothing.returncode == 2 and "matches -i 'nope-*'" in nothing.stderr


@pytest.mark.slow
def test_include_matches_the_folder_name_as_harbor_does_not_a_package_name(tmp_path):
    suite = make_suite(tmp_path / "suite", ["alpha", "beta"])
    toml = suite / "tasks" / "alpha" / "task.toml"
    toml.write_text(toml.read_text().replace('schema_version = "1.4"', 'schema_version = "1.4"\n\n[task]\nname = "org/renamed"', 1))
    assert "org/renamed" in toml.read_text()  # the test means something only with a package name
    listed = harbor_async("tasks", "-p", str(suite), "-i", "alph*")
    assert listed.returncode == 0 and "org/renamed" in listed.stdout, listed.stdout + listed.stderr
    none = harbor_async("tasks", "-p", str(suite), "-i", "org/*")  # Harbor's local tasks are matched by folder
    assert none.returncode == 2 and "matches -i 'org/*'" in none.stderr, none.stdout + none.stderr


@pytest.mark.slow
def test_ek_drives_the_simulated_backend(tmp_path):
    _, found, summary = run_job(tmp_path, "-e", "simulated", "-l", "2", "--ek", "verify_failure_rate=1", name="verify")
    assert all(r["error_class"] == "verifier" and r["reward"] == 0.0 for r in found)
    assert summary["completed"] == 2 and summary["failures"] == {"verifier": 2}
    _, found, _ = run_job(
        tmp_path, "-e", "simulated", "-l", "2", "--ek", "start_permanent_failure_rate=1", name="start", code=1
    )
    assert all(r["error_class"] == "infrastructure" and r["error_phase"] == "start" for r in found)
    assert all(r["error_type"] == "StartError" and "SandboxBuildFailedError" in r["error"] for r in found)
    _, found, _ = run_job(tmp_path, "-e", "simulated", "-l", "2", "--ek", "start_latency=0.4", "--ek", "reward=0.25", name="slow")
    assert all(r["phases"][0]["end"] >= 0.4 and r["reward"] == 0.25 for r in found)
    config = json.loads((tmp_path / "jobs" / "slow" / "harbor-async.json").read_text())
    assert config["environment_kwargs"] == {"start_latency": 0.4, "reward": 0.25}


@pytest.mark.slow
def test_timeout_multipliers_scale_the_phase_budgets(tmp_path):
    # The verifier budget is 600 s; x 0.001 is 0.6 s, under the simulated verifier's 2 s.
    _, found, _ = run_job(
        tmp_path, "-e", "simulated", "-l", "1", "--ek", "verify_latency=2", "--verifier-timeout-multiplier", "0.001",
        name="verifier",
    )  # fmt: skip
    assert found[0]["error_class"] == "verifier" and found[0]["error_type"] == "VerifierFailure"
    # The start budget (600 s) x 0.001, from the general multiplier.
    _, found, _ = run_job(
        tmp_path, "-e", "simulated", "-l", "1", "--ek", "start_latency=2", "--timeout-multiplier", "0.001",
        name="start", code=1,
    )  # fmt: skip
    assert found[0]["error_class"] == "infrastructure" and found[0]["error_phase"] == "start"
    # The per-phase multiplier overrides the general one: the start gets 600 s x 1.
    _, found, _ = run_job(
        tmp_path, "-e", "simulated", "-l", "1", "--ek", "start_latency=1", "--timeout-multiplier", "0.001",
        "--environment-build-timeout-multiplier", "1", name="override",
    )  # fmt: skip
    assert found[0]["error_class"] is None and found[0]["reward"] == 1.0
    # The agent budget (1800 s) x 0.0001 is 0.18 s, under the oracle's 1 s exec.
    _, found, _ = run_job(
        tmp_path, "-e", "simulated", "-l", "1", "--ek", "exec_latency=1", "--agent-timeout-multiplier", "0.0001",
        name="agent",
    )  # fmt: skip
    assert found[0]["error_class"] == "agent" and found[0]["error_phase"] == "agent"
    _, found, _ = run_job(
        tmp_path, "-e", "simulated", "-l", "1", "--ek", "start_latency=1", "--episode-timeout", "0.3",
        name="episode", code=1,
    )  # fmt: skip
    assert found[0]["error_phase"] == "start"


@pytest.mark.slow
def test_jobs_dir_job_name_and_json_export(tmp_path):
    result = harbor_async("run", "-e", "simulated", "-l", "2", cwd=tmp_path)  # the default: ./jobs/<timestamp>
    assert result.returncode == 0, result.stderr
    (job,) = (tmp_path / "jobs").iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d__\d\d-\d\d-\d\d", job.name)
    files = {p.name for p in job.iterdir()}
    assert {"harbor-async.json", "episodes.jsonl", "summary.json", "config.json", "result.json"} <= files  # ours, Harbor's
    assert len(files) == 5 + 2  # and a trial folder per episode (Harbor's layout)
    export = tmp_path / "out" / "all.jsonl"
    _, found, _ = run_job(tmp_path, "-e", "simulated", "-l", "2", "--json", str(export), name="named")
    assert [json.loads(line) for line in export.read_text().splitlines()] == sorted(found, key=lambda r: r["task"])
    again = harbor_async("run", "-e", "simulated", "-o", str(tmp_path / "jobs"), "--job-name", "named")
    assert again.returncode == 2 and "--resume" in again.stderr


@pytest.mark.slow
def test_unwritable_jobs_folder_or_export_fails_before_any_sandbox_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    sandboxes = tmp_path / "local-root"
    trials = tmp_path / "tmp"
    trials.mkdir()
    env = {"HARBOR_ASYNC_LOCAL_ROOT": str(sandboxes), "TMPDIR": str(trials)}
    for args, what in (
        (["-o", str(blocker / "jobs")], "cannot write the job folder"),
        (["-o", str(tmp_path / "jobs"), "--json", str(blocker / "x.jsonl")], "cannot write --json"),
    ):
        result = harbor_async("run", *args, env=env)
        assert result.returncode == 2, result.stderr
        assert what in result.stderr and "Traceback" not in result.stderr
        assert not sandboxes.exists() and not list(trials.iterdir()), "a sandbox was started"


@pytest.mark.slow
def test_resume_refuses_job_defining_flags_that_differ(tmp_path):
    run_job(tmp_path, "-e", "simulated", "-l", "1")
    result = harbor_async("run", "--resume", str(tmp_path / "jobs" / "j"), "-e", "local", "-k", "2")
    assert result.returncode == 2
    assert "started with --env='simulated', the resume was given --env='local'" in result.stderr
    same = harbor_async("run", "--resume", str(tmp_path / "jobs" / "j"), "-e", "simulated", "-k", "1")
    assert same.returncode == 0, same.stderr  # the stored values, given again: accepted
    plan = harbor_async("run", "--resume", str(tmp_path / "jobs" / "j"), "-l", "1")
    assert plan.returncode == 2 and "drop --n-tasks" in plan.stderr
    options = harbor_async("run", "--resume", str(tmp_path / "jobs" / "j"), "--ek", "start_latency=1")
    assert options.returncode == 2 and "started with --ek={}" in options.stderr, options.stderr
    missing = harbor_async("run", "--resume", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "not a job folder" in missing.stderr


@pytest.mark.slow
def test_dataset_goes_to_the_hub(tmp_path):
    registry = tmp_path / "registry.json"  # an empty local registry: Harbor's default one is on the network
    registry.write_text("[]")
    result = harbor_async(
        "run", "-d", "no-such-org/no-such-suite", "--registry-path", str(registry), "-o", str(tmp_path), env={"HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode == 2
    assert "'no-such-org/no-such-suite'" in result.stderr and "Hugging Face" in result.stderr
    # Harbor's registry does not know it: the old spelling, deprecated
    assert "deprecated: -d no-such-org/no-such-suite is read as the Hugging Face dataset" in result.stderr


@pytest.mark.slow
def test_older_spellings_still_work_but_are_hidden(tmp_path):
    result = harbor_async(
        "run", "--backend", "simulated", "--concurrency", "2", "--num-tasks", "2", "-o", str(tmp_path), "--job-name", "old"
    )
    assert result.returncode == 0, result.stderr
    assert len(records(tmp_path / "old")) == 2
    shown = harbor_async("run", "--help", env={"COLUMNS": "300"}).stdout
    assert "--n-concurrent" in shown and "--ek" in shown and "--include-task-name" in shown
    assert "--backend" not in shown and "--concurrency" not in shown and "--num-tasks" not in shown
    listed = harbor_async("sandboxes", "list", "-b", "local")
    assert listed.returncode == 0, listed.stderr


@pytest.mark.slow
def test_sandboxes_speak_the_dialect():
    listed = harbor_async("sandboxes", "list", "-e", "local", "--json")
    assert listed.returncode == 0, listed.stderr
    assert "--env" in harbor_async("sandboxes", "reap", "--help", env={"COLUMNS": "300"}).stdout


@pytest.mark.slow
def test_bench_is_imported_only_by_its_commands_and_promises_only_what_it_writes(tmp_path):
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, harbor_async.cli; print(sorted({m.split('.')[0] for m in sys.modules} & {'benchmarks', 'shim', 'trl', 'matplotlib'}))"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    for command, promise in (("throughput", "JSON file"), ("overhead", "JSON file"), ("grpo-step", "PNG")):
        help_text = " ".join(harbor_async("bench", command, "--help", env={"COLUMNS": "300"}).stdout.split())
        assert promise in help_text, help_text
        if command != "grpo-step":
            assert "PNG" not in help_text
    result = harbor_async(
        "bench", "throughput", "-e", "simulated", "--latency", "zero", "--episodes", "4", "-n", "1,2",
        "--ek", "start_latency=0.01", "-o", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "throughput-simulated.json").read_text())
    assert [r["concurrency"] for r in data["runs"]] == [1, 2] and data["backend_kwargs"] == {"start_latency": 0.01}
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]


@pytest.mark.slow
def test_indices_pick_tasks_by_position_and_a_repeat_is_another_attempt(tmp_path):
    listed = harbor_async("tasks", "--indices", "2,0")
    assert re.findall(r"│\s+\d+\s+│\s+(\S+)", listed.stdout) == ["csv-group-by", "count-log-files"]
    _, found, summary = run_job(tmp_path, "-e", "simulated", "--indices", "0,0", "-k", "2")
    assert sorted((r["task"], r["attempt"]) for r in found) == [("count-log-files", a) for a in range(4)]
    assert summary["tasks"] == 1 and summary["episodes"] == 4


@pytest.mark.slow
def test_renamed_flags_still_work_and_say_their_new_name(tmp_path):
    """--max-live is now --cluster-max-live (the shim's cluster_max_live); the old spelling works for a release."""
    from harbor_async.cli.cluster import RENAMED_FLAGS
    from harbor_async.cli.common import warn_renamed_flags

    assert warn_renamed_flags(RENAMED_FLAGS, ["run", "--max-live", "3", "--creates-per-second=2"]) == [
        "--max-live", "--creates-per-second",
    ]  # fmt: skip
    assert warn_renamed_flags(RENAMED_FLAGS, ["run", "--cluster-max-live", "3"]) == []
    result = harbor_async("run", "-e", "simulated", "-l", "1", "--max-live", "3", "-o", str(tmp_path))
    assert result.returncode == 2  # a cluster cap without --budget ray: refused, in the new name
    assert "deprecated: --max-live is now --cluster-max-live" in result.stderr
    assert "--cluster-max-live, --cluster-creates-per-second and --ray-address are cluster caps" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [["run"], ["eval"], ["tasks"], ["bench", "verify"], ["sandboxes", "list"]])
def test_h_is_help_as_in_harbor_run(command):
    result = harbor_async(*command, "-h")
    usage = " ".join(result.stdout.split())
    assert result.returncode == 0 and f"harbor_async {' '.join(command)} [OPTIONS]" in usage, result.stdout


@pytest.mark.slow
def test_the_defaults_that_differ_from_harbor_runs_are_said_in_one_line(tmp_path):
    """-e and -n not given: one line names ours and harbor run's (docker, 4); given, nothing is said."""
    suite = make_suite(tmp_path / "suite", ["t1"])
    unsaid, _, _ = run_job(tmp_path, "-p", str(suite), "-a", "none", name="defaults")
    first = unsaid.stderr.splitlines()[0]
    assert first == "defaults: -e local (harbor run's default: -e docker), -n 8 (harbor run's: -n 4); give -e/-n to choose"
    half, _, _ = run_job(tmp_path, "-p", str(suite), "-a", "none", "-e", "local", name="half")
    assert half.stderr.splitlines()[0] == "defaults: -n 8 (harbor run's: -n 4); give -e/-n to choose"
    said, _, _ = run_job(tmp_path, "-p", str(suite), "-a", "none", "-e", "local", "-n", "2", name="said")
    assert "defaults:" not in said.stderr and said.stderr.startswith("job folder")


@pytest.mark.slow
def test_dry_run_checks_and_prints_the_plan_and_starts_nothing(tmp_path):
    suite = make_suite(tmp_path / "suite", ["t1", "t2", "t3"])
    planned = harbor_async("run", "-p", str(suite), "-e", "simulated", "-k", "2", "-x", "t3", "--dry-run", "-o", str(tmp_path / "jobs"))
    assert planned.returncode == 0, planned.stderr
    assert re.search(r"t1\s+│\s+2", planned.stdout) and re.search(r"t2\s+│\s+2", planned.stdout) and "t3" not in planned.stdout
    assert "dry run: 4 episodes of 2 tasks" in " ".join(planned.stderr.split()) and "nothing started" in planned.stderr
    assert not (tmp_path / "jobs").exists()
    # what a run refuses before any sandbox, a dry run refuses too
    refused = harbor_async("run", "-p", str(suite), "-e", "simulated", "--timeout-multiplier", "0", "--dry-run", "-o", str(tmp_path / "jobs"))
    assert refused.returncode == 2 and not (tmp_path / "jobs").exists(), refused.stderr


@pytest.mark.slow
def test_max_retries_reruns_what_was_not_judged_and_never_a_judged_outcome(tmp_path):
    """`-r`: the first starts of each task fail (transient, the engine's own start retry off): rerun at once they are
    judged; `--retry-include` of another outcome reruns nothing; a judged outcome named is refused in one line."""
    suite = make_suite(tmp_path / "suite", ["t1", "t2"])
    flaky = ["-p", str(suite), "-e", "simulated", "--ek", "fail_first_starts=1", "--start-attempts", "1", "-a", "none"]
    plain, found, _ = run_job(tmp_path, *flaky, name="plain", code=1)
    assert {r["error_class"] for r in found} == {"infrastructure"}  # without -r: not judged, left to a resume
    retried, found, summary = run_job(tmp_path, *flaky, "-r", "2", name="retried")
    for task in ("t1", "t2"):  # each failed start is kept in the records, followed by its judged rerun
        assert [r["error_class"] for r in found if r["task"] == task] == ["infrastructure", None], found
    assert "retrying: 2 episodes not judged (retry 1 of 2)" in retried.stderr and "retry 2" not in retried.stderr
    assert summary["not_judged"] == 0
    other, found, _ = run_job(tmp_path, *flaky, "-r", "2", "--retry-include", "EnvironmentStartTimeoutError", name="other", code=1)
    assert "retrying" not in other.stderr and {r["error_class"] for r in found} == {"infrastructure"}
    refused = harbor_async("run", *flaky, "-r", "1", "--retry-include", "RewardFileNotFoundError", "-o", str(tmp_path / "x"))
    assert refused.returncode == 2 and "--retry-include" in refused.stderr and "never rerun" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_harbors_import_path_spellings_name_the_agent_and_the_environment(tmp_path):
    shown = harbor_async(
        "run", "-p", str(make_suite(tmp_path / "suite", ["t1"])), "--print-config",
        "--environment-import-path", "harbor_async.backends.simulated:SimulatedEnvironment",
        "--agent-import-path", "harbor.agents.nop:NopAgent",
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    config = json.loads(shown.stdout)
    assert config["environment"]["import_path"] == "harbor_async.backends.simulated:SimulatedEnvironment"
    assert config["agents"][0]["import_path"] == "harbor.agents.nop:NopAgent"
    both = harbor_async("run", "-a", "oracle", "--agent-import-path", "harbor.agents.nop:NopAgent", "--print-config")
    assert both.returncode == 2 and "not both" in both.stderr


@pytest.mark.slow
def test_force_build_reaches_the_engine_and_harbors_config():
    from harbor_async.jobs.settings import JobSettings

    settings = JobSettings(force_build=True)
    assert settings.engine_kwargs()["force_build"] is True and JobSettings().engine_kwargs()["force_build"] is False
    shown = harbor_async("run", "-e", "simulated", "--force-build", "--print-config")
    assert json.loads(shown.stdout)["environment"]["force_build"] is True


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.usefixtures("docker_daemon")
def test_override_flags_set_every_tasks_resources_as_harbor_run_does(tmp_path):
    """--override-memory-mb and --override-cpus reach the container as the task's own values would (the cgroup's
    limits); --override-gpus 0 runs a task that asked for a GPU; -c's environment.override_* are the same flags."""
    suite = make_suite(tmp_path / "suite", ["t1"])
    task = suite / "tasks" / "t1"
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("[environment]\n", "[environment]\ngpus = 1\n", 1))
    probe = (
        "#!/bin/bash\nm=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null | head -1)\n"
        "q=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu.max 2>/dev/null | head -1 | cut -d' ' -f1)\n"
        '[ "$m" = $((300 * 1024 * 1024)) ] && [ "$q" = 100000 ] && echo 1 > /logs/verifier/reward.txt || '
        'echo "memory $m quota $q" > /logs/verifier/reward.txt\n'
    )
    refused = harbor_async("run", "-p", str(suite), "-e", "local", "-a", "none", "--dry-run")
    assert refused.returncode == 2 and "gpus" in refused.stderr  # as written: a GPU task, refused on local
    planned = harbor_async("run", "-p", str(suite), "-e", "local", "-a", "none", "--override-gpus", "0", "--dry-run")
    assert planned.returncode == 0, planned.stderr  # its GPU overridden away: it runs
    (task / "tests" / "test.sh").write_text(probe)
    _, found, _ = run_job(tmp_path, "-p", str(suite), "-e", "docker", "--override-memory-mb", "300", "--override-cpus", "1", "--override-gpus", "0", name="flags")
    assert [r["reward"] for r in found] == [1.0], found
    config = harbor_async("run", "-p", str(suite), "-e", "docker", "--override-memory-mb", "300", "--override-cpus", "1", "--override-gpus", "0", "--print-config")
    shown = json.loads(config.stdout)["environment"]
    assert (shown["override_memory_mb"], shown["override_cpus"], shown["override_gpus"]) == (300, 1.0, 0)
    (tmp_path / "job.json").write_text(config.stdout)
    _, found, _ = run_job(tmp_path, "-c", str(tmp_path / "job.json"), name="config")
    assert [r["reward"] for r in found] == [1.0], found


@pytest.mark.slow
def test_artifact_collects_a_sandbox_path_from_every_task(tmp_path):
    suite = make_suite(tmp_path / "suite", ["t1", "t2"])
    _, found, _ = run_job(tmp_path, "-p", str(suite), "-e", "local", "--artifact", "/workdir/answer.txt", "--ek", f"sandbox_root={tmp_path / 'sb'}", name="art")
    job = tmp_path / "jobs" / "art"
    for record in found:
        collected = job / record["trial"] / "artifacts"
        assert (collected / "workdir" / "answer.txt").read_text().strip(), record  # the oracle's answer, collected
        manifest = json.loads((collected / "manifest.json").read_text())
        assert any(e["source"] == "/workdir/answer.txt" and e["status"] == "ok" for e in manifest), manifest
    shown = harbor_async("run", "-p", str(suite), "--artifact", "/workdir/answer.txt", "--print-config")
    assert json.loads(shown.stdout)["artifacts"] == ["/workdir/answer.txt"]


@pytest.mark.slow
def test_fixed_starts_turns_the_start_window_off_and_the_records_say_which(tmp_path):
    """Against a simulated provider's create rate: the default window, and none with --fixed-starts.

    Starts refused past their retries end the run with exit 1 (infrastructure): what is checked is the records.
    """
    provider = ("-e", "simulated", "-n", "8", "--ek", "create_rate=2", "--ek", "start_latency=0.2")
    found = {}
    for name, extra in (("adaptive", ()), ("fixed", ("--fixed-starts",))):
        result = harbor_async("run", "-o", str(tmp_path / "jobs"), "--job-name", name, *provider, *extra)
        assert result.returncode in (0, 1), result.stderr
        found[name] = records(tmp_path / "jobs" / name)
    windows = [r["start_window"] for r in found["adaptive"]]
    assert len(windows) == 10 and all(isinstance(w, int) and 1 <= w <= 8 for w in windows), windows
    assert len(found["fixed"]) == 10 and {r["start_window"] for r in found["fixed"]} == {None}
    stored = json.loads((tmp_path / "jobs" / "fixed" / "harbor-async.json").read_text())
    assert stored["adaptive_starts"] is False


@pytest.mark.slow
def test_bench_starts_compares_the_policies_on_a_provider_profile(tmp_path):
    result = harbor_async(
        "bench", "starts", "--profile", "e2b-hobby", "--policy", "fixed-8", "--policy", "adaptive-8",
        "--episodes", "12", "--repeats", "1", "--speedup", "20", "-o", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "starts.json").read_text())
    summary = data["summary"]["e2b-hobby"]
    assert set(summary) == {"fixed-8", "adaptive-8"} and all(row["goodput"] > 0 for row in summary.values())
    assert data["profiles"]["e2b-hobby"]["source"].startswith("E2B") and data["provenance"]["command"]
    assert {r["policy"]: r["start_window"] is None for r in data["runs"]} == {"fixed-8": True, "adaptive-8": False}


@pytest.mark.slow
@needs_bwrap
def test_bench_telemetry_times_the_readings_with_telemetry_on_only(tmp_path):
    result = harbor_async("bench", "telemetry", "-e", "local", "--episodes", "4", "-n", "2", "--repeats", "1", "-o", str(tmp_path))
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "telemetry-local.json").read_text())
    (round_,) = data["rounds"]
    # one reading per stopped sandbox of the run with telemetry on (its warm-up episode too); none with it off
    assert round_["readings"] == 5 and round_["readings_off"] == 0
    assert round_["reading_p50_ms"] > 0 and round_["failures"] == 0
    assert round_["on_eps"] > 0 and round_["off_eps"] > 0 and data["provenance"]["command"]


@pytest.mark.slow
@needs_bwrap
def test_bench_churn_times_the_loop_beside_starts_kills_and_transfers_on_both_loops(tmp_path):
    result = harbor_async("bench", "churn", "--seconds", "1", "--width", "1", "--repeats", "1", "-o", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "churn.json").read_text())
    assert sorted(r["event_loop"].split(".")[0] for r in data["rounds"]) == ["asyncio", "uvloop"]
    for round_ in data["rounds"]:
        assert round_["starts"] > 0 and round_["kills"] > 0 and round_["transfers"] > 0 and round_["churn_errors"] == 0
        assert round_["idle_p99_ms"] > 0 and round_["exec_idle_p99_ms"] > round_["idle_p99_ms"]  # an exec is a process
        assert round_["control_ratio"] > 0 and round_["exec_control_ratio"] > 0
    assert set(data["summary"]) == {r["event_loop"] for r in data["rounds"]}
