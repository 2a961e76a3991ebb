"""Fewest outstanding requests first; equal loads rotate so that no replica is always first."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from policies.view import ReplicaView, RouteRequest, healthy, rotate


class LeastLoadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


def by_load(replicas: list[ReplicaView], turn: int) -> list[ReplicaView]:
    """Healthy replicas by load; the stable sort after a rotation spreads ties over successive turns."""
    return sorted(rotate(healthy(replicas), turn), key=lambda r: r.load)


class LeastLoad:
    name = "least_load"

    def __init__(self, config: LeastLoadConfig | None = None) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[str]:
        order = by_load(replicas, self._turn)
        self._turn += 1
        return [r.id for r in order]
