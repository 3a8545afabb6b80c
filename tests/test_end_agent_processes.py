"""``--strict-verify``'s kill script (helpers/end_agent_processes.sh) in a real PID namespace.

A zombie is dead: no signal reaches it, and it stays listed until its parent
(by then the namespace's init) reaps it. An init that is slow to reap (Docker's
tini on a loaded machine) or never reaps (an image whose PID 1 is a plain
``sleep``) used to make the script count zombies as survivors for all its
rounds and fail the verify.
"""

from __future__ import annotations

import subprocess
import sys
import time
from importlib import resources

import pytest

SCRIPT = str(resources.files("harbor_async.verification") / "helpers" / "end_agent_processes.sh")


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


@pytest.fixture
def namespace():
    """A new PID namespace whose PID 1 is a plain sleep (it never reaps what is reparented to it), with a
    main command (the oldest child of PID 1, which the script keeps); yields PID 1's host pid."""
    unshare = subprocess.Popen(["unshare", "--fork", "--kill-child", "--pid", "--mount-proc", "sleep", "600"])
    try:
        _wait_for(lambda: subprocess.run(["pgrep", "-P", str(unshare.pid)], capture_output=True).stdout.strip(), "PID 1")
        init = int(subprocess.run(["pgrep", "-P", str(unshare.pid)], capture_output=True, text=True).stdout.split()[0])
        _inside(init, "sleep 600 >/dev/null 2>&1 &")
        _wait_for(lambda: any(ppid == 1 for _, ppid in _processes(init).values()), "the main command")
        yield init
    finally:
        unshare.kill()
        unshare.wait()


def _threads(init: int, pid: int) -> list[str]:
    return _inside(init, f"ls /proc/{pid}/task 2>/dev/null").stdout.split()


def test_zombies_under_an_init_that_never_reaps_do_not_fail_the_kill(namespace):
    init = namespace
    # An agent's process with a zombie child it never reaps (it exec'd into sleep).
    _inside(init, 'sh -c "true & exec sleep 601" >/dev/null 2>&1 &')
    _wait_for(lambda: any(state == "Z" for state, _ in _processes(init).values()), "the agent's zombie")
    ended = _inside(init, '. "$0"', SCRIPT)  # run by the shell nsenter starts, as an exec runs it
    left = _processes(init)
    assert ended.returncode == 0, ended.stderr
    # What is left: PID 1, the main command, and the dead (the killed agent process, now a zombie too).
    alive = {pid for pid, (state, _) in left.items() if state not in ("Z", "X")}
    main = min(pid for pid, (state, ppid) in left.items() if ppid == 1 and state not in ("Z", "X"))
    assert alive - {main, 1} <= {pid for pid, (_, ppid) in left.items() if ppid == 0}  # only the listing's own shell
    assert sum(state == "Z" for state, _ in left.values()) >= 2


#: A process whose main thread exits alone (its leader then lists as Z) while another thread runs on.
_LEADER_GONE = """
import ctypes, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_leader_that_exited_alone_is_no_zombie_its_threads_are_killed(namespace):
    init = namespace
    _inside(init, f'"{sys.executable}" -I -c "$0" >/dev/null 2>&1 &', _LEADER_GONE)
    agent = None

    def listed_as_zombie_with_a_live_thread() -> bool:
        nonlocal agent
        for pid, (state, _) in _processes(init).items():
            if state == "Z" and len(_threads(init, pid)) > 1:
                agent = pid
                return True
        return False

    _wait_for(listed_as_zombie_with_a_live_thread, "a Z leader with a running thread")
    ended = _inside(init, '. "$0"', SCRIPT)
    assert ended.returncode == 0, ended.stderr
    _wait_for(lambda: len(_threads(init, agent)) <= 1, "its threads to end")  # killed, not skipped as dead


@pytest.mark.slow
def test_a_process_slow_to_die_is_waited_for_not_reported_as_a_survivor(namespace):
    """A killed process is listed until the kernel has run its exit; freeing 3 GiB of touched memory outlasts
    many rounds of the script (20 rounds used to take a few milliseconds and fail the verify on a loaded machine)."""
    init = namespace
    hog = f"{sys.executable} -c \"b = b'x' * (3 << 30); open('/tmp/hog-ready', 'w').close(); import time; time.sleep(600)\""
    pid = int(_inside(init, f"rm -f /tmp/hog-ready; {hog} >/dev/null 2>&1 & echo $!").stdout)
    _wait_for(lambda: _inside(init, "test -f /tmp/hog-ready").returncode == 0, "the memory hog")
    assert _processes(init)[pid][0] not in ("Z", "X")
    started = time.monotonic()
    ended = _inside(init, '. "$0"', SCRIPT)
    assert ended.returncode == 0, ended.stderr
    assert time.monotonic() - started < 15  # bounded: 10 s of rounds at most
    # The hog is dead (a zombie: this namespace's init never reaps), not merely reparented to PID 1.
    assert _processes(init).get(pid, ("gone", 0))[0] in ("gone", "Z", "X")
