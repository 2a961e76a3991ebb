"""Power of two choices: the less loaded of two random replicas, near least-load at O(1) state reads."""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict

from policies.least_load import by_load
from policies.view import ReplicaView, RouteRequest, healthy


class PowerOfTwoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, config: PowerOfTwoConfig | None = None) -> None:
        self._rng = random.Random((config or PowerOfTwoConfig()).seed)

    def choose(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[str]:
        candidates = healthy(replicas)
        if len(candidates) <= 2:
            pair = candidates[:]
            self._rng.shuffle(pair)
        else:
            pair = self._rng.sample(candidates, 2)
        pair.sort(key=lambda r: r.load)
        first = [r.id for r in pair]
        rest = [r.id for r in by_load(candidates, 0) if r.id not in first]
        return first + rest
