"""A shim round from an installed wheel: reset, a tool call, the batched reward (run by tests/test_wheel.py).

Run with the wheel's venv python from a folder outside the source tree, with the
backend as the argument (default ``local``); prints one JSON line with what it saw.
"""

import json
import sys

import harbor_async
import shim
from harbor_async.suites import example_suite_path
from shim import HarborSpec

tasks = example_suite_path() / "tasks"
backend = sys.argv[1] if len(sys.argv) > 1 else "local"
spec = HarborSpec(example_suite_path(), environment_type=backend)
envs = [spec.environment_factory() for _ in range(2)]
try:
    prompts = [envs[0].reset(task_dir=str(tasks / "csv-column-sum")), envs[1].reset(task_dir=str(tasks / "csv-column-sum"))]
    listing = envs[0].bash("ls /workdir")
    envs[0].bash("printf 915.16 > /workdir/answer.txt")  # the gold answer
    envs[1].bash("printf 1.00 > /workdir/answer.txt")  # a wrong one
    rewards = spec.reward_funcs(environments=envs, prompts=[None, None], completions=[None, None])
finally:
    spec.close()
    for env in envs:
        env.close()
print(
    json.dumps(
        {
            "harbor_async": harbor_async.__file__,
            "shim": shim.__file__,
            "sys_path": sys.path,
            "prompt": prompts[0],
            "listing": listing,
            "rewards": rewards,
        }
    )
)
