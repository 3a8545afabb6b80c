"""A local backend that says it can switch network policies while running, and records each switch.

Harbor's docker backend switches policies with its egress-control sidecar,
whose images come from Docker Hub (out of reach of the test machines); this
recorder stands beside it to check *when* the engine asks for each phase's
policy. It enforces nothing itself (a local sandbox has no network anyway).
"""

from __future__ import annotations

from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import NetworkPolicy

from harbor_async.backends.local import LocalEnvironment

#: (sandbox session, policy mode) of every switch, in order.
SWITCHES: list[tuple[str, str]] = []


class RecordingNetworkEnvironment(LocalEnvironment):
    """The local backend, claiming dynamic network policies (allowlists included) and recording each switch."""

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        found = super().capabilities
        return found.model_copy(
            update={"dynamic_network_policy": True, "network_allowlist": True, "network_allowlist_hostnames": True}
        )

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        SWITCHES.append((self.session_id, network_policy.network_mode.value))
