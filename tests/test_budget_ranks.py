"""Rank awareness without Ray, and the shim's budget options."""

from __future__ import annotations

import anyio
import pytest

from harbor_async.backends.simulated import SimulatedEnvironment
from harbor_async.cluster.ranks import World, current_world, divide_limits
from harbor_async.cluster.ray_budget import RayBudgetFactory
from harbor_async.core.policy import Limits
from harbor_async.engine.engine import Engine
from shim.options import EngineOptions


def test_the_world_comes_from_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert current_world() == World(0, 1)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    assert current_world() == World(3, 8)


def test_limits_are_divided_by_the_world_size() -> None:
    limits = Limits(live_sandboxes=64, creates_per_second=4.0, concurrent_execs=3)
    assert divide_limits(limits, 8) == Limits(live_sandboxes=8, creates_per_second=0.5, concurrent_execs=1)
    assert divide_limits(limits, 1) == limits
    assert divide_limits(Limits(live_sandboxes=None), 4).live_sandboxes is None  # unlimited stays unlimited
    assert divide_limits(Limits(live_sandboxes=3), 8).live_sandboxes == 1  # never zero


def test_per_rank_limits_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert EngineOptions(max_live_sandboxes=64).engine_kwargs()["limits"].live_sandboxes == 64
    assert EngineOptions(max_live_sandboxes=64, per_rank_limits=True).engine_kwargs()["limits"].live_sandboxes == 16


@pytest.mark.anyio
async def test_a_rank_engine_keeps_to_its_share(monkeypatch: pytest.MonkeyPatch, example_tasks) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    kwargs = EngineOptions(max_live_sandboxes=6, per_rank_limits=True).engine_kwargs()
    backend = "simulated"
    async with Engine(**kwargs, backend_kwargs={"start_latency": 0.05, "stop_latency": 0.01}) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(12):

                async def one(i: int = i) -> None:
                    async with engine.sandbox(example_tasks[i % len(example_tasks)], backend):
                        await anyio.sleep(0.05)

                tg.start_soon(one)
    assert SimulatedEnvironment.peak_live == 3  # 6 for the world of 2, 3 for this rank


def test_budget_options() -> None:
    with pytest.raises(ValueError, match="budget must be"):
        EngineOptions(budget="redis")
    with pytest.raises(ValueError, match="cluster_max_live"):
        EngineOptions(budget="ray", cluster_max_live=0)
    assert "budget" not in EngineOptions().engine_kwargs()  # without Ray configured nothing changes
    options = EngineOptions(budget="ray", ray_address="127.0.0.1:1", cluster_max_live=20, max_live_sandboxes=4)
    factory = options.engine_kwargs()["budget"]
    assert isinstance(factory, RayBudgetFactory)
    assert (factory.address, factory.max_live, factory.batch) == ("127.0.0.1:1", 20, 4)
    hash(options)  # still one shared engine per option set


def test_cli_budget_options() -> None:
    import typer

    from harbor_async.cli.cluster import budget_from_options

    assert budget_from_options("local") is None  # the default: process-local, as before
    with pytest.raises(typer.Exit):
        budget_from_options("local", max_live=4)  # a cluster cap without the cluster budget
    with pytest.raises(typer.Exit):
        budget_from_options("redis")
    factory = budget_from_options("ray", "127.0.0.1:6379", 20, 5.0)
    assert isinstance(factory, RayBudgetFactory)
    assert (factory.address, factory.max_live, factory.creates_per_second, factory.batch) == (
        "127.0.0.1:6379",
        20,
        5.0,
        None,  # run/eval: one lease per sandbox
    )


def test_an_unset_rank_batch_is_its_share_of_the_cluster_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    kwargs = EngineOptions(budget="ray", cluster_max_live=10).engine_kwargs()
    assert kwargs["budget"].batch == 2 and kwargs["limits"].live_sandboxes == 2  # 4 ranks x 2 <= 10
    kwargs = EngineOptions(budget="ray", cluster_max_live=10, max_live_sandboxes=3).engine_kwargs()
    assert kwargs["budget"].batch == 3  # given: kept (the ranks' rendezvous refuses 4 x 3 > 10)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert EngineOptions(budget="ray", cluster_max_live=10).engine_kwargs()["budget"].batch is None
