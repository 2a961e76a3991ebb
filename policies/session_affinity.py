"""Sticky sessions by consistent hashing: a session stays on its replica while the fleet changes.

Each replica owns `virtual_nodes` points on a 64-bit ring; a session goes to the first healthy
replica clockwise from its own point, and its fallbacks are the next distinct replicas on the ring.
A replica joining or leaving moves only the sessions whose arc it takes or gives up. Requests with
no session key fall back to least load.
"""

from __future__ import annotations

import bisect

import xxhash
from pydantic import BaseModel, ConfigDict, Field

from policies.least_load import by_load
from policies.view import ReplicaView, RouteRequest


class SessionAffinityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # The request header carrying the session key; the OpenAI `user` field is used when it is absent.
    header: str = Field("x-session-id", min_length=1)
    virtual_nodes: int = Field(64, ge=1, le=4096)


class SessionAffinity:
    name = "session_affinity"

    def __init__(self, config: SessionAffinityConfig | None = None) -> None:
        self.config = config or SessionAffinityConfig()
        self._ring_ids: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._turn = 0

    def choose(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[str]:
        if request.session is None:
            self._turn += 1
            return [r.id for r in by_load(replicas, self._turn)]
        ids = tuple(sorted(r.id for r in replicas))
        if ids != self._ring_ids:
            self._build_ring(ids)
        up = {r.id for r in replicas if r.healthy}
        start = bisect.bisect(self._points, xxhash.xxh3_64_intdigest(request.session.encode()))
        order: list[str] = []
        n = len(self._owners)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner in up and owner not in order:
                order.append(owner)
                if len(order) == len(up):
                    break
        return order

    def _build_ring(self, ids: tuple[str, ...]) -> None:
        points = sorted(
            (xxhash.xxh3_64_intdigest(f"{rid}#{v}".encode()), rid)
            for rid in ids
            for v in range(self.config.virtual_nodes)
        )
        self._ring_ids = ids
        self._points = [p for p, _ in points]
        self._owners = [rid for _, rid in points]
