"""The report in a real browser: Debian's chromium (.ci/browser-setup), driven by Playwright from PyPI.

Playwright launches /usr/bin/chromium itself (no `playwright install`, no
browser download). A missing chromium fails these tests (it never skips them):
run `.ci/browser-setup` as root. Screenshots are kept under test-artifacts/.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_async.core.records import EpisodeRecord
from harbor_async.jobs.folder import JobFolder
from harbor_async.report import write_report
from harbor_async.report.server import ReportServer
from tests.test_report_jobs import EVIL, LONG_LINES, make_big_job, make_job

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # a real browser, started by one worker

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("HARBOR_ASYNC_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
EVIL_TASK = "evil<b>task</b>"
SWEEP = [("ckpt/step-100", "step-100"), ("ckpt/step-200", "step-200"), ("ckpt/step-1000", "step-1000")]


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: run .ci/browser-setup (as root) to install Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield chromium
        chromium.close()


class Page:
    """A browser tab that records console errors and uncaught exceptions."""

    def __init__(self, browser, width: int = 1300, height: int = 900) -> None:
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        # Any request off the file (or off 127.0.0.1 for `view`) is a bug: the report is self-contained.
        self.requests: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))

    def rows(self) -> list[str]:
        return self.page.locator("#task-table tbody tr td.name").all_inner_texts()

    def close(self) -> None:
        self.page.close()


@pytest.fixture
def tab(browser) -> Iterator[Page]:
    page = Page(browser)
    yield page
    page.close()


def _until(check, timeout: float, what: str) -> None:
    """Poll ``check`` from Python (the page's CSP forbids the eval of wait_for_function's polling)."""
    from playwright.sync_api import Error

    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Error:  # the page is reloading: ask again
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _artifact(tmp_path: Path, page: Page, name: str) -> Path:
    """A full-page screenshot kept under the test's tmp dir and copied to test-artifacts/."""
    shot = tmp_path / name
    page.page.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / name)
    return shot


@pytest.fixture(scope="module")
def eval_report(tmp_path_factory) -> tuple[Path, list[EpisodeRecord]]:
    jobs = tmp_path_factory.mktemp("jobs")
    job = make_job(jobs, "eval-job", tasks=14, attempts=3, evil_task=EVIL_TASK, seed=2)
    return write_report(job, job / "report.html"), list(JobFolder(job).latest().values())


def test_report_loads_without_console_errors_and_filters(tab: Page, eval_report, tmp_path: Path) -> None:
    report, records = eval_report
    tab.page.goto(report.as_uri())
    tab.page.wait_for_selector("#task-table tbody tr")
    all_rows = tab.rows()
    assert len(all_rows) == 14 and EVIL_TASK in all_rows  # a task name with HTML shows as text

    tasks = {}
    for r in records:
        tasks.setdefault(r.task, []).append(r)
    failed = sorted(t for t, rs in tasks.items() if any(r.rerun or r.score < 1.0 for r in rs))
    tab.page.check("#f-failed")
    assert sorted(tab.rows()) == failed and 0 < len(failed) < 14

    tab.page.uncheck("#f-failed")
    classes = sorted({r.error_class for r in records if r.error_class})
    assert classes, "the fixture has failures of some class"
    for cls in classes:
        tab.page.select_option("#f-error", cls)
        assert sorted(tab.rows()) == sorted(t for t, rs in tasks.items() if any(r.error_class == cls for r in rs)), cls
    tab.page.select_option("#f-error", "")

    tab.page.fill("#f-glob", "task-00[1-5]-*")
    assert sorted(tab.rows()) == sorted(t for t in tasks if fnmatch.fnmatch(t, "task-00[1-5]-*"))
    tab.page.fill("#f-glob", "csv")  # plain text: anywhere in the name
    assert sorted(tab.rows()) == sorted(t for t in tasks if "csv" in t)
    assert "task=csv" in tab.page.evaluate("location.hash")  # the filter survives a reload
    tab.page.reload()
    tab.page.wait_for_selector("#task-table tbody tr")
    assert tab.page.input_value("#f-glob") == "csv" and sorted(tab.rows()) == sorted(t for t in tasks if "csv" in t)
    tab.page.fill("#f-glob", "")

    tab.page.click('#task-table th[data-key="mean"]')  # sort by mean reward, then descending
    tab.page.click('#task-table th[data-key="mean"]')
    means = [float(x) for x in tab.page.locator("#task-table tbody tr td:nth-child(3)").all_inner_texts()]
    assert means == sorted(means, reverse=True) and len(means) == 14

    _artifact(tmp_path, tab, "report-eval-table.png")
    assert tab.errors == []
    assert all(u.startswith(("file:", "data:")) for u in tab.requests), tab.requests


def test_clicking_an_episode_shows_its_transcript(tab: Page, eval_report, tmp_path: Path) -> None:
    report, records = eval_report
    tab.page.goto(report.as_uri())
    # The first episode with a transcript of the second task.
    target = next(r for r in records if r.task != EVIL_TASK and r.transcript)
    row = tab.page.locator("#task-table tbody tr", has=tab.page.locator("td.name", has_text=target.task))
    row.locator("button.ep", has_text=f"#{target.attempt}").click()
    tab.page.wait_for_selector("#transcript .msg")
    messages = tab.page.locator("#transcript .msg")
    assert messages.count() == len(target.transcript)
    assert target.task in tab.page.inner_text("#ep-title")
    last = messages.nth(len(target.transcript) - 1).inner_text()
    assert f"[last message of {target.task}]" in last
    calls = [c for m in target.transcript for c in m.get("tool_calls") or []]
    assert tab.page.locator("#transcript .toolcall").count() == len(calls)
    rewards = tab.page.inner_text("#ep-rewards")
    for key in target.rewards:
        assert key in rewards
    assert tab.page.locator("#ep-body .timeline .bar").count() == len(target.phases)
    if target.verifier_output:
        assert target.verifier_output.splitlines()[0] in tab.page.inner_text("#ep-body")
    # The long tool output (the fourth message) is folded: its first lines shown, the rest on a click.
    long = messages.nth(3)
    assert f"{LONG_LINES} lines" in long.locator(".fold summary").inner_text()
    assert "line 1 of a long output" in long.locator("pre.head").inner_text()
    full = long.locator("details pre")
    assert not full.is_visible()
    long.locator(".fold summary").click()
    assert full.is_visible() and f"line {LONG_LINES} of a long output" in full.inner_text()
    assert not long.locator("pre.head").is_visible()
    # A call's arguments read as the command itself, not as escaped JSON.
    command = json.loads(calls[0]["function"]["arguments"])["command"]
    shown = tab.page.locator("#transcript .toolcall").first.inner_text()
    assert f"command: {command}" in shown or f"command:\n{command}" in shown, shown
    _artifact(tmp_path, tab, "report-eval-episode.png")
    tab.page.click("#ep-close")
    assert tab.page.locator("#episode").is_hidden()
    row.locator("button.ep", has_text=f"#{target.attempt}").click()  # Escape closes it too
    tab.page.wait_for_selector("#transcript .msg")
    tab.page.keyboard.press("Escape")
    assert tab.page.locator("#episode").is_hidden()
    assert tab.errors == []


def test_script_in_a_transcript_shows_as_text_and_runs_nothing(tab: Page, eval_report) -> None:
    report, records = eval_report
    evil = next(r for r in records if r.task == EVIL_TASK and r.transcript)
    index = records.index(evil)
    tab.page.goto(f"{report.as_uri()}#ep={index}")  # opened from the URL, as a link or a reload would
    tab.page.wait_for_selector("#transcript .msg")
    body = tab.page.inner_text("#ep-body")
    assert EVIL in body  # the verifier output and the last tool output, character for character
    assert EVIL in tab.page.locator("#transcript .msg").last.inner_text()
    assert tab.page.evaluate("window.__pwned") is None
    assert tab.page.locator("#episode script, #episode img, #episode b").count() == 0
    assert tab.page.inner_text("#ep-title").startswith(EVIL_TASK)
    assert tab.errors == []


def test_an_incomplete_sweep_names_its_state_its_base_and_never_shows_an_unjudged_zero(tab: Page, tmp_path: Path) -> None:
    import json

    job = make_job(tmp_path, "sweep", tasks=8, attempts=3, models=[("weak-model", None), ("good-model", None)], seed=3)
    (job / "harbor-async.json").write_text(json.dumps({"command": "eval", "models": ["weak-model", "good-model"]}))
    records = list(JobFolder(job).latest().values())
    (job / "summary.json").write_text(json.dumps({"complete": False, "planned_episodes": 60, "interrupted_by": "SIGINT"}))
    report = write_report(job, job / "report.html")
    tab.page.goto(report.as_uri())
    tab.page.wait_for_selector("#task-table tbody tr")
    header = tab.page.inner_text("#incomplete")
    assert header == f"incomplete: {len(records)} of 60 episodes, {60 - len(records)} missing (interrupted by SIGINT)"
    assert "paired difference from weak-model" in tab.page.inner_text("#differences caption")  # the CLI's base
    unjudged = [r for r in records if r.rerun]
    assert unjudged  # the fixture has some
    tab.page.evaluate("document.querySelectorAll('#task-table button.o-more').forEach(b => b.click())")
    for cls in {r.error_class for r in unjudged}:  # each such episode's button says it has no reward
        titles = tab.page.eval_on_selector_all(f"#task-table button.ep.o-{cls}", "bs => bs.map(b => b.title)")
        assert titles and all(t.endswith("reward -") for t in titles), titles
    # A task whose episodes were all unjudged shows no mean, not 0.000.
    for task in {r.task for r in records}:
        rs = [r for r in records if r.task == task]
        if all(r.rerun for r in rs):
            row = tab.page.locator(f'#task-table tr[data-task="{rs[0].task_path}"]').first
            assert "0.000" not in row.inner_text()
    assert tab.errors == []


def test_sweep_and_benchmark_reports_load(tab: Page, tmp_path: Path) -> None:
    job = make_job(tmp_path, "sweep", tasks=10, attempts=3, models=SWEEP, seed=4)
    report = write_report(job, job / "report.html")
    tab.page.goto(report.as_uri())
    tab.page.wait_for_selector("#task-table tbody tr")
    assert tab.page.locator("#sweep img").count() == 3  # reward, pass@k, paired difference
    assert tab.page.locator("#task-differences tbody tr").count() == 10
    assert len(tab.rows()) == 30  # one row per checkpoint and task
    tab.page.select_option("#f-group", "step-1000")
    assert len(tab.rows()) == 10
    widths = tab.page.evaluate("Array.from(document.images).map(i => i.naturalWidth)")
    assert widths and all(w > 0 for w in widths)  # every chart decodes
    _artifact(tmp_path, tab, "report-sweep.png")
    assert tab.errors == []

    bench = write_report(REPO / "benchmarks" / "results", tmp_path / "bench.html")
    tab.page.goto(bench.as_uri())
    widths = tab.page.evaluate("Array.from(document.images).map(i => i.naturalWidth)")
    assert len(widths) >= 6 and all(w > 0 for w in widths)
    _artifact(tmp_path, tab, "report-benchmarks.png")
    assert tab.errors == []


def test_view_reloads_while_the_job_runs(tab: Page, tmp_path: Path) -> None:
    job_path = make_job(tmp_path, tasks=3, attempts=1)
    server = ReportServer(job_path, port=0)
    url = server.start()
    try:
        tab.page.goto(url + "#task=task")
        tab.page.wait_for_selector("#task-table tbody tr")
        assert len(tab.rows()) == 3
        job = JobFolder.open(job_path)
        job.append(EpisodeRecord(task="task-late", task_path="tasks/task-late", model="test-model", reward=1.0, seconds={"agent": 0.5}))
        job.close()
        # live.js polls every 3 s and reloads; the filter in the hash is kept.
        _until(lambda: len(tab.rows()) == 4, 20, "the page to reload with the new episode")
        assert "task-late" in tab.rows() and tab.page.input_value("#f-glob") == "task"
        assert all(u.startswith(url) for u in tab.requests), tab.requests
        assert tab.errors == []
    finally:
        server.stop()


def test_ten_thousand_episodes_open_and_show_the_last_transcript(tab: Page, tmp_path: Path) -> None:
    # That a big job opens at all (the waits bound a page that never paints) and the transcripts
    # load lazily down to the last one; how fast is not a test's question on a shared machine.
    job = make_big_job(tmp_path, episodes=10_000, turns=20)
    report = write_report(job, job / "report.html")
    tab.page.goto(report.as_uri(), wait_until="commit")
    _until(lambda: tab.page.evaluate("performance.getEntriesByType('paint').some(e => e.name === 'first-contentful-paint')"), 30, "the first paint")
    tab.page.wait_for_selector("#task-table tbody tr", timeout=30_000)
    assert "10000" in tab.page.inner_text("#summary")
    # The last episode (the last blob in the file): its whole transcript.
    tab.page.evaluate("window.harborReport.openEpisode(9999, true)")
    tab.page.wait_for_selector("#transcript .msg")
    assert tab.page.locator("#transcript .msg").count() == 20
    assert "[last message of task-01999]" in tab.page.locator("#transcript .msg").last.inner_text()
    assert tab.errors == []


def test_a_multi_step_episode_shows_its_steps(tab: Page, tmp_path: Path) -> None:
    """Each step that ran: its reward, its rewards, and why the task ended there (a text, even with HTML in it)."""
    job = JobFolder.create(tmp_path / "jobs", "steps", {"command": "run"})
    steps = [
        {"name": "write", "reward": 0.0, "rewards": {"reward": 0.0}, "error": "reward=0.0 below min_reward 1.0: <b>skip</b>"},
    ]
    job.append(EpisodeRecord(task="multi", task_path="multi", agent="oracle", reward=0.0, rewards={"reward": 0.0}, steps=steps))
    job.append(EpisodeRecord(task="single", task_path="single", agent="oracle", reward=1.0, rewards={"reward": 1.0}))
    job.close()
    report = write_report(job.path, job.path / "report.html")
    tab.page.goto(report.as_uri())
    tab.page.wait_for_selector("#task-table tbody tr")
    row = tab.page.locator("#task-table tbody tr", has=tab.page.locator("td.name", has_text="multi"))
    row.locator("button.ep", has_text="#0").click()
    tab.page.wait_for_selector("#ep-steps")
    cells = tab.page.locator("#ep-steps tbody tr td").all_inner_texts()
    assert cells == ["write", "0", '{"reward":0}', "reward=0.0 below min_reward 1.0: <b>skip</b>"]
    assert tab.page.locator("#ep-steps b").count() == 0
    row = tab.page.locator("#task-table tbody tr", has=tab.page.locator("td.name", has_text="single"))
    row.locator("button.ep", has_text="#0").click()
    _until(lambda: "single" in tab.page.inner_text("#ep-title"), 10, "the single-step episode")
    assert tab.page.locator("#ep-steps").count() == 0
    assert tab.errors == []


# ── the failure corpus: every job the project writes when things go wrong ──────────────────────────────────


@pytest.fixture(scope="module")
def failure_corpus(tmp_path_factory) -> dict[str, Path]:
    from tests.report_corpus import make_failure_corpus

    return make_failure_corpus(tmp_path_factory.mktemp("corpus"))


CORPUS = [
    "stopped by the failure budget", "model-server failures only", "interrupted", "zero episodes", "resumed",
    "previous release", "verification disabled",
]  # fmt: skip


@pytest.mark.parametrize("name", CORPUS)
def test_every_job_of_the_failure_corpus_renders_with_its_not_judged_count(
    tab: Page, failure_corpus: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """`report` (the command, as a user runs it) and `view` both render it: no console error, and the count of
    episodes not judged is on the page, never a 0.000 mean for a job nobody was judged in."""
    from tests.cli_helpers import harbor_async

    job = failure_corpus[name]
    records = list(JobFolder(job).latest().values())
    not_judged = sum(1 for r in records if not r.judged)
    html = tmp_path / "report.html"
    done = harbor_async("report", str(job), "-o", str(html))
    assert done.returncode == 0, done.stderr[-3000:]
    server = ReportServer(job, port=0)
    url = server.start()
    try:
        for address in (html.as_uri(), url):
            tab.page.goto(address)
            tab.page.wait_for_selector("#not-judged")
            shown = tab.page.inner_text("#not-judged")
            assert "not judged" in shown and str(not_judged) in shown.split(), (name, shown)
            if records and not_judged == len(records):  # nothing judged: no mean reward anywhere, least of all 0
                assert "0.000" not in tab.page.inner_text("#summary"), tab.page.inner_text("#summary")
            if not records:
                assert "No episode of this job has ended" in tab.page.inner_text("#no-episodes")
        _artifact(tmp_path, tab, f"report-corpus-{name.replace(' ', '-')}.png")
    finally:
        server.stop()
    assert tab.errors == [], tab.errors
