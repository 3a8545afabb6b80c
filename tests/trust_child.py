"""A process for the exit tests: live sandboxes on the shared loop thread, then an exit.

    python tests/trust_child.py wedged    # a blocking call wedges the loop, then the process exits
    python tests/trust_child.py signals   # local sandboxes live; prints READY and waits for signals

Prints ``READY <run labels>`` once the sandboxes run (the labels scope a test's reap to this child).
"""

from __future__ import annotations

import sys
import time

import shim
from harbor_async.engine import loop
from harbor_async.suites import example_suite_path
from shim import engines

CSV_SUM = str(example_suite_path() / "tasks" / "csv-column-sum")


def main(mode: str) -> None:
    envs = [shim.HarborBashEnv("local") for _ in range(3)]
    for env in envs:
        env.reset(task_dir=CSV_SUM)
    for env in envs:
        assert env.bash("echo up") == "up\n"
    labels = ",".join(engine.run_label for engine in engines.open_engines())
    if mode == "wedged":
        # A backend's synchronous SDK call on the loop: the loop is stuck for a long time.
        loop.get_loop().submit(time.sleep, 3600)
        time.sleep(0.2)
        print("READY", labels, flush=True)
        sys.exit(0)  # atexit must still end within its budget
    print("READY", labels, flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
