"""``--strict-verify``'s kill script (helpers/end_agent_processes.sh) in a real PID namespace.

A zombie is dead: no signal reaches it, and it stays listed until its parent
(by then the namespace's init) reaps it. An init that is slow to reap (Docker's
tini on a loaded machine) or never reaps (an image whose PID 1 is a plain
``sleep``) used to make the script count zombies as survivors for all its
rounds and fail the verify.
"""

from __future__ import annotations

import subprocess
import time
from importlib import resources

SCRIPT = str(resources.files("harbor_async") / "helpers" / "end_agent_processes.sh")


def _inside(init: int, command: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["nsenter", "-t", str(init), "-p", "-m", "sh", "-c", command, *args], capture_output=True, text=True, timeout=60
    )


def _processes(init: int) -> dict[int, tuple[str, int]]:
    """pid -> (state, ppid) inside the namespace."""
    listing = _inside(init, 'for s in /proc/[0-9]*/stat; do read -r l < "$s" && echo "$l"; done').stdout
    found = {}
    for line in listing.splitlines():
        pid, rest = line.split(" ", 1)
        state, ppid = rest.rsplit(")", 1)[1].split()[:2]
        found[int(pid)] = (state, int(ppid))
    return found


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_zombies_under_an_init_that_never_reaps_do_not_fail_the_kill():
    # PID 1 of a new PID namespace is a plain sleep: it never reaps what is reparented to it.
    unshare = subprocess.Popen(["unshare", "--fork", "--kill-child", "--pid", "--mount-proc", "sleep", "600"])
    try:
        _wait_for(lambda: subprocess.run(["pgrep", "-P", str(unshare.pid)], capture_output=True).stdout.strip(), "PID 1")
        init = int(subprocess.run(["pgrep", "-P", str(unshare.pid)], capture_output=True, text=True).stdout.split()[0])
        # The container's main command: the oldest child of PID 1, kept.
        _inside(init, "sleep 600 >/dev/null 2>&1 &")
        _wait_for(lambda: any(ppid == 1 for _, ppid in _processes(init).values()), "the main command")
        # An agent's process with a zombie child it never reaps (it exec'd into sleep).
        _inside(init, 'sh -c "true & exec sleep 601" >/dev/null 2>&1 &')
        _wait_for(lambda: any(state == "Z" for state, _ in _processes(init).values()), "the agent's zombie")
        ended = _inside(init, '. "$0"', SCRIPT)  # run by the shell nsenter starts, as an exec runs it
        left = _processes(init)
    finally:
        unshare.kill()
        unshare.wait()
    assert ended.returncode == 0, ended.stderr
    # What is left: PID 1, the main command, and the dead (the killed agent process, now a zombie too).
    alive = {pid for pid, (state, _) in left.items() if state not in ("Z", "X")}
    main = min(pid for pid, (state, ppid) in left.items() if ppid == 1 and state not in ("Z", "X"))
    assert alive - {main, 1} <= {pid for pid, (_, ppid) in left.items() if ppid == 0}  # only the listing's own shell
    assert sum(state == "Z" for state, _ in left.values()) >= 2
