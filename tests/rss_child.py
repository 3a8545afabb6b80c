"""Memory of a long run: simulated steps of 4 envs; prints what grew, as JSON.

After a warm-up, it measures over ``STEPS`` steps: the RSS growth in bytes
(the median of the last samples: this machine is shared and noisy), the growth
of open descriptors and threads (leaks the RSS hardly sees), and, as a lead
for whoever reads a failure, the types of Python object whose live count grew.
"""

from __future__ import annotations

import collections
import gc
import json
import statistics

import psutil

import shim
from harbor_async.suites import example_suite_path
from shim.rewards import _outcome_reward_func

CSV_SUM = str(example_suite_path() / "tasks" / "csv-column-sum")
WARM_UP = 500
STEPS = 3000


def step(envs: list[shim.HarborBashEnv]) -> None:
    for env in envs:
        env.reset(task_dir=CSV_SUM)
    for env in envs:
        env.bash("ls")
    _outcome_reward_func(environments=envs)


def live_objects() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def main() -> None:
    envs = [shim.HarborBashEnv("simulated") for _ in range(4)]
    process = psutil.Process()
    for _ in range(WARM_UP):
        step(envs)
    before = live_objects()
    base, fds, threads = process.memory_info().rss, process.num_fds(), process.num_threads()
    samples = []
    for i in range(STEPS):
        step(envs)
        if i % 250 == 249:
            samples.append(process.memory_info().rss)
    grown = live_objects() - before
    print(json.dumps({
        "steps": STEPS,
        "rss_growth": statistics.median(samples[-3:]) - base,
        "fd_growth": process.num_fds() - fds,
        "thread_growth": process.num_threads() - threads,
        "objects_grown": dict(grown.most_common(10)),
    }))
    for env in envs:
        env.close()


if __name__ == "__main__":
    main()
