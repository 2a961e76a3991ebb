"""Round robin over the healthy replicas: the baseline that ignores caches and load."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from policies.view import ReplicaView, RouteRequest, healthy, rotate


class RoundRobinConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RoundRobin:
    name = "round_robin"

    def __init__(self, config: RoundRobinConfig | None = None) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[str]:
        order = rotate(healthy(replicas), self._turn)
        self._turn += 1
        return [r.id for r in order]
