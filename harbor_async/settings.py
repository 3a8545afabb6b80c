"""The job settings an evaluation is run with, stored in its job folder so that a resume repeats them.

Shared by the driver (:mod:`harbor_async.evaluation`) and the cluster's
workers (:mod:`harbor_async.cluster.eval_items`), which rebuild the episode's
engine limits, agent loop and harness from them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from harbor_async.policy import Limits, Timeouts
from harbor_async.scoring import DEFAULT_SUCCESS_THRESHOLD
from harbor_async.serve import DEFAULT_READY_TIMEOUT


@dataclass
class EvalSettings:
    """Everything an evaluation needs, stored as the job's ``config.json`` (so a resume repeats it)."""

    models: list[str]
    suite: str | None = None
    agent: str = "bash"
    backend: str = "local"
    attempts: int = 1
    concurrency: int = 8
    num_tasks: int | None = None
    indices: list[int] | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    base_url: str | None = None
    serve_cmd: str | None = None
    api_key_name: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    max_concurrent_requests: int = 32
    request_timeout: float = 600.0
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    episode_timeout: float | None = None
    ready_timeout: float = DEFAULT_READY_TIMEOUT
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    vllm_args: list[str] = field(default_factory=list)
    ray: bool = False
    ray_address: str | None = None
    budget: str = "local"
    max_live: int | None = None
    creates_per_second: float | None = None
    command: str = "eval"

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalSettings:
        """Read :meth:`to_dict`'s output (unknown keys ignored)."""
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


    def engine_kwargs(self) -> dict[str, Any]:
        """The ``Engine`` arguments of this evaluation's episodes (the driver's, or a cluster node's).

        The episodes' one concurrency limit is the driver's (``concurrency``)
        or the worker's; the engine gets no lower one. The Ray budget, when
        asked for, leases one slot per sandbox from the cluster's actor.
        """
        budget = None
        if self.budget == "ray":
            from harbor_async.cluster.ray_budget import factory

            budget = factory(address=self.ray_address, max_live=self.max_live, creates_per_second=self.creates_per_second)
        return {
            "limits": Limits(live_sandboxes=None),
            "timeouts": Timeouts(episode=self.episode_timeout),
            "backend_kwargs": dict(self.backend_kwargs),
            "budget": budget,
        }
