"""The overhead benchmark past one machine: live simulated sandboxes held at a 20 ms p99 round trip, on
one Ray node and on two (issue 48, "past one machine, measured").

Usage: python -m benchmarks.cluster_overhead [--out benchmarks/results/cluster-overhead.json]

A ``ray.cluster_utils.Cluster`` of two nodes on this machine (one CPU each).
On each node used, an actor runs the overhead benchmark's capacity step
(:func:`benchmarks.overhead.measure_capacity`) in its own process: its own
loop thread, a probe called through it, and N live simulated sandboxes each
making about one exec a second, every sandbox leased from the cluster's one
budget actor (``--budget ray``). Sizes ramp up per node until a node's probe
misses the bound at its p99. One node, then two nodes at once (the same size
on each, so the total is twice it): what the second node adds. Both nodes are
this machine's two cores, so the second node cannot add a core's worth; the
figure says what one more loop thread (and process) holds beside the first,
and what the shared budget actor costs. Writes one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from benchmarks.provenance import begin, stamp

REPO = Path(__file__).resolve().parents[1]
ONE_NODE_SIZES = (2000, 4000, 8000, 12000, 16000, 20000)
PER_NODE_SIZES = (1000, 2000, 3000, 4000, 6000, 8000)
BOUND_US = 20_000.0


def _node_worker_class():
    import ray

    @ray.remote(num_cpus=0)
    class NodeWorker:
        """One node's engine process: the capacity step at one size, on its own loop thread."""

        def capacity(self, address: str, size: int, cap: int) -> dict:
            from benchmarks.overhead import _start_probe, measure_capacity
            from harbor_async.cluster import ray_budget
            from harbor_async.engine.loop import LoopThread
            from harbor_async.tasks.suite import load_suite

            loop = LoopThread(name="bench-node")
            try:
                tasks = load_suite(None).tasks
                probe = _start_probe(loop, tasks[0])
                budget = ray_budget.factory(address=address, max_live=cap, name="bench-cluster-overhead")
                (step,) = measure_capacity(loop, probe, tasks, [size], bound_us=BOUND_US, engine_kwargs={"budget": budget})
            finally:
                loop.close(timeout=600)
            return asdict(step)

    return NodeWorker


def ramp(workers: list, address: str, sizes: tuple[int, ...], cap: int) -> list[dict]:
    """Each size on every worker at once, until one worker's probe misses the bound."""
    import ray

    rows = []
    for size in sizes:
        steps = ray.get([worker.capacity.remote(address, size, cap) for worker in workers])
        held = all(step["under_bound"] for step in steps)
        rows.append({"per_node": size, "total": size * len(workers), "held": held,
                     "probe_p99_us": [step["probe_p99_us"] for step in steps],
                     "loop_busy": [step["loop_busy"] for step in steps]})  # fmt: skip
        if not held:
            break
    return rows


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cluster-overhead.json")
    parser.add_argument("--one-node-sizes", type=_sizes, default=ONE_NODE_SIZES, help="comma-separated live counts")
    parser.add_argument("--per-node-sizes", type=_sizes, default=PER_NODE_SIZES, help="comma-separated, per node")
    args = parser.parse_args()
    begin()
    import ray
    from ray.cluster_utils import Cluster

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node0": 1}})
    cluster.add_node(num_cpus=1, resources={"node1": 1})
    ray.init(address=cluster.address, namespace="harbor-async", log_to_driver=False, runtime_env={"env_vars": env})
    try:
        cluster.wait_for_nodes()
        worker = _node_worker_class()
        first = worker.options(resources={"node0": 0.01}).remote()
        second = worker.options(resources={"node1": 0.01}).remote()
        cap = 2 * max(max(args.one_node_sizes), max(args.per_node_sizes))
        one = ramp([first], cluster.address, args.one_node_sizes, cap)
        two = ramp([first, second], cluster.address, args.per_node_sizes, cap)

        def held(rows: list[dict]) -> int:
            return max((row["total"] for row in rows if row["held"]), default=0)

        result = {
            "ray": ray.__version__, "bound_us": BOUND_US, "cpus": os.cpu_count(),
            "one_node": one, "two_nodes": two,
            "held_one_node": held(one), "held_two_nodes": held(two),
            "second_node_adds": held(two) - held(one),
        }  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(stamp("cluster-overhead", result), indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("held", "second"))}))


if __name__ == "__main__":
    main()
