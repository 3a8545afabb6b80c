"""Memory of a long run: 10,000 simulated steps of 4 envs; prints the RSS growth in bytes.

Measured after a warm-up of 1,000 steps, as the median of the last samples
(this machine is shared and noisy).
"""

from __future__ import annotations

import statistics

import psutil

import shim
from harbor_async.suites import example_suite_path
from shim.rewards import _outcome_reward_func

CSV_SUM = str(example_suite_path() / "tasks" / "csv-column-sum")


def step(envs: list[shim.HarborBashEnv]) -> None:
    for env in envs:
        env.reset(task_dir=CSV_SUM)
    for env in envs:
        env.bash("ls")
    _outcome_reward_func(environments=envs)


def main() -> None:
    envs = [shim.HarborBashEnv("simulated") for _ in range(4)]
    process = psutil.Process()
    for _ in range(1000):
        step(envs)
    base = process.memory_info().rss
    samples = []
    for i in range(10_000):
        step(envs)
        if i % 500 == 499:
            samples.append(process.memory_info().rss)
    for env in envs:
        env.close()
    print(statistics.median(samples[-5:]) - base)


if __name__ == "__main__":
    main()
