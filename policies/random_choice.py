"""Uniformly random order over the healthy replicas, from a seeded generator (reproducible runs)."""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict

from policies.view import ReplicaView, RouteRequest, healthy


class RandomConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0


class RandomChoice:
    name = "random"

    def __init__(self, config: RandomConfig | None = None) -> None:
        self._rng = random.Random((config or RandomConfig()).seed)

    def choose(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[str]:
        order = [r.id for r in healthy(replicas)]
        self._rng.shuffle(order)
        return order
