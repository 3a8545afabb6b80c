"""Job folders for the report tests, written as producers write them: JobFolder + EpisodeRecord.

Not tests themselves (besides a check that the builders write what they say):
the report and browser tests import these builders.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from harbor_async.core.errors import FailureClass
from harbor_async.core.records import EpisodeRecord, PhaseSpan
from harbor_async.jobs.folder import EPISODES_NAME, JobFolder

#: Text a hostile transcript carries: shown as text, it must run nothing.
#: Lines of the long tool output (``long_output``).
LONG_LINES = 300
EVIL = '<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2"><b>not bold</b>'


def transcript(
    rng: random.Random, task: str, turns: int, *, evil: bool = False, words: int = 40, long_output: bool = False
) -> list[dict]:
    """An OpenAI chat transcript of ``turns`` messages: system, user, then tool calls and their outputs.

    ``long_output``: the first tool output is :data:`LONG_LINES` lines long (the page folds it).
    """
    messages: list[dict] = [
        {"role": "system", "content": "You are a careful shell agent. Use the bash tool."},
        {"role": "user", "content": f"Solve the task {task}: read the files in /app and write the answer to /app/answer.txt."},
    ]
    n = 2
    while len(messages) < turns:
        call_id = f"call_{n}"
        command = f"cat /app/data_{n}.csv | head -n {rng.randint(2, 50)}"
        messages.append({
            "role": "assistant",
            "content": " ".join(rng.choice(["Let", "me", "look", "at", "the", "file", "first", "then", "count", "rows"]) for _ in range(words // 4)),
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}],
        })  # fmt: skip
        if len(messages) >= turns:
            break
        output = "\n".join(f"{rng.randint(0, 999)},{rng.choice(['alpha', 'beta', 'gamma'])},{rng.random():.4f}" for _ in range(words // 4))
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        n += 1
    if long_output:
        messages[3]["content"] = "\n".join(f"line {n + 1} of a long output" for n in range(LONG_LINES))
    if evil:
        messages[-1] = {"role": "tool", "tool_call_id": "call_evil", "content": EVIL}
    messages[-1]["content"] = f"{messages[-1].get('content') or ''}\n[last message of {task}]"
    return messages[:turns]


def episode(
    rng: random.Random,
    task: str,
    attempt: int,
    *,
    model: str | None = "test-model",
    checkpoint: str | None = None,
    p_solve: float = 0.6,
    turns: int = 8,
    evil: bool = False,
    words: int = 40,
    long_output: bool = False,
) -> EpisodeRecord:
    """One eval episode with phases, rewards, verifier output and transcript; its outcome drawn by ``rng``."""
    record = EpisodeRecord(
        task=task,
        task_path=f"tasks/{task}",
        attempt=attempt,
        agent="chat",
        model=model,
        checkpoint=checkpoint,
        sandbox=f"ha-test-{rng.randrange(16**8):08x}",
        start_attempts=1,
        started_at="2026-12-01T01:00:00+00:00",
        transcript=transcript(rng, task, turns, evil=evil, words=words, long_output=long_output),
        usage={"prompt_tokens": rng.randint(500, 5000), "completion_tokens": rng.randint(50, 800)},
        finish_reason="stop",
    )
    start, agent, verify, stop = (rng.uniform(0.05, 0.5), rng.uniform(1, 20), rng.uniform(0.2, 2), rng.uniform(0.02, 0.2))
    record.phases = [
        PhaseSpan("start", 0.0, start),
        PhaseSpan("agent", start, start + agent),
        PhaseSpan("verify", start + agent, start + agent + verify),
        PhaseSpan("stop", start + agent + verify, start + agent + verify + stop),
    ]
    record.seconds = {p.phase: p.seconds for p in record.phases}
    draw = rng.random()
    if draw < 0.04:
        record.set_error(FailureClass.INFRASTRUCTURE, "sandbox start failed: no space left on device", "start")
        record.phases = record.phases[:1]
        record.transcript = None
    elif draw < 0.08:
        record.set_error(FailureClass.AGENT, "agent exceeded 20 turns", "agent")
        record.reward, record.rewards = 0.0, {"reward": 0.0}
    elif draw < 0.11:
        record.set_error(FailureClass.VERIFIER, "test.sh exited 2 without writing a reward", "verify")
        record.reward = 0.0
    else:
        solved = rng.random() < p_solve
        record.reward = 1.0 if solved else 0.0
        record.rewards = {"reward": record.reward, "tests_passed": 3 if solved else rng.randint(0, 2)}
        record.verifier_output = f"test_answer ... {'ok' if solved else 'FAILED'}\n3 tests, {record.rewards['tests_passed']} passed"
    if evil:
        record.verifier_output = EVIL
        record.error = EVIL if record.error else None
    return record


def make_job(
    jobs_dir: Path,
    name: str = "eval-job",
    *,
    tasks: int = 12,
    attempts: int = 3,
    models: list[tuple[str, str | None]] | None = None,
    turns: int = 8,
    evil_task: str | None = None,
    seed: int = 0,
) -> Path:
    """An eval (or, with several ``models``, sweep) job folder; returns its path.

    With ``models`` as ``(model, checkpoint)`` pairs, later checkpoints solve
    more often, so the sweep has a trend. ``evil_task`` gets a transcript and
    verifier output full of HTML and script; the second task a long tool output.
    """
    rng = random.Random(seed)
    models = models or [("test-model", None)]
    job = JobFolder.create(jobs_dir, name, {"command": "eval", "models": [m for m, _ in models], "k": attempts})
    names = [f"task-{i:03d}-{rng.choice(['csv', 'json', 'log'])}" for i in range(tasks)]
    if evil_task:
        names[0] = evil_task
    for level, (model, checkpoint) in enumerate(models):
        for task in names:
            for attempt in range(attempts):
                p = 0.3 + 0.5 * level / max(1, len(models) - 1)
                job.append(episode(
                    rng, task, attempt, model=model, checkpoint=checkpoint, p_solve=p, turns=turns,
                    evil=task == evil_task, long_output=task == names[1],
                ))  # fmt: skip
    job.close()
    return job.path


def make_big_job(jobs_dir: Path, *, episodes: int = 10_000, turns: int = 20, attempts: int = 5, seed: int = 1) -> Path:
    """A job of ``episodes`` episodes of ``turns`` messages each (real-looking tool calls and outputs).

    Written as ``JobFolder.append`` writes, one JSON line a record, in one
    buffered pass: 10,000 fsyncs would only slow the test down.
    """
    rng = random.Random(seed)
    job = JobFolder.create(jobs_dir, "big-job", {"command": "eval", "k": attempts})
    with open(job.path / EPISODES_NAME, "w", encoding="utf-8") as fh:
        for n in range(episodes):
            record = episode(rng, f"task-{n // attempts:05d}", n % attempts, turns=turns, words=60)
            if record.transcript is None:  # an infrastructure failure: give it a transcript anyway
                record.transcript = transcript(rng, record.task, turns, words=60)
            fh.write(json.dumps(record.to_dict(), ensure_ascii=False) + "\n")
    return job.path


def test_builders_write_readable_job_folders(tmp_path: Path) -> None:
    path = make_job(tmp_path, tasks=4, attempts=2, models=[("ckpt-1", "step-1"), ("ckpt-2", "step-2")], evil_task="evil")
    records = JobFolder.open(path).records()
    assert len(records) == 4 * 2 * 2
    assert {r.checkpoint for r in records} == {"step-1", "step-2"}
    evil = [r for r in records if r.task == "evil" and r.transcript]
    assert evil and EVIL in evil[0].transcript[-1]["content"]
    assert all(r.transcript is None or len(r.transcript) == 8 for r in records)
