"""The cache-threshold router: the common peer design (SGLang's cache-aware router), kept as the
baseline prefix_aware is measured against (docs/design.md §7).

Three rules, the first that applies decides:

1. Imbalance: when the busiest and the idlest replica differ by more than `balance_abs_threshold`
   outstanding requests and the busiest holds more than `balance_rel_threshold` times the idlest's,
   the least loaded replica wins and the cache is ignored until the fleet is level again.
2. Cache: when the best match covers more than `cache_threshold` of the prompt, the best-matching
   replica wins, however long its queue.
3. Otherwise the replica with the smallest cache (fewest cached blocks) wins: a new prefix goes
   where it evicts the least, so the fleet's caches fill evenly.

It never weighs a queue against a hit (rule 2 takes a hit at any queue short of rule 1's trip
wire): that is the difference from prefix_aware's estimated TTFT, and what the comparison shows.
Ties (equal match, equal cache) go to the less loaded replica, then rotate with the call count so
that an idle fleet with empty caches is spread evenly instead of always starting at the first.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from policies.view import ReplicaView, RouteRequest, healthy, rotate


class CacheThresholdConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # A best match covering more of the prompt than this sends the request to the best match.
    cache_threshold: float = Field(0.3, ge=0.0, le=1.0)
    # The fleet is imbalanced when busiest - idlest > balance_abs_threshold outstanding requests
    # and busiest > balance_rel_threshold x idlest; both must hold.
    balance_abs_threshold: int = Field(64, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1.0)


SortKey = Callable[[ReplicaView], tuple[int, ...]]


class CacheThreshold:
    name = "cache_threshold"

    def __init__(self, config: CacheThresholdConfig | None = None) -> None:
        self.config = config or CacheThresholdConfig()
        self._turn = 0

    def imbalanced(self, replicas: list[ReplicaView]) -> bool:
        busiest = max(r.load for r in replicas)
        idlest = min(r.load for r in replicas)
        return (
            busiest - idlest > self.config.balance_abs_threshold
            and busiest > self.config.balance_rel_threshold * idlest
        )

    @staticmethod
    def match_ratio(request: RouteRequest, replicas: list[ReplicaView]) -> float:
        """Matched tokens of the best match over the prompt's tokens (0 for an empty prompt)."""
        if request.prompt_tokens <= 0:
            return 0.0
        return min(max(r.cached_tokens for r in replicas), request.prompt_tokens) / request.prompt_tokens

    def rule(self, request: RouteRequest, replicas: list[ReplicaView]) -> SortKey:
        """The order the applicable rule ranks replicas by, best first; load breaks ties in each."""
        if self.imbalanced(replicas):
            return lambda r: (r.load,)
        if self.match_ratio(request, replicas) > self.config.cache_threshold:
            return lambda r: (-min(r.cached_tokens, request.prompt_tokens), r.load)
        return lambda r: (r.cached_blocks, r.load)

    def choose(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[str]:
        # The rotation fixes the order among full ties: the sort below is stable.
        candidates = rotate(healthy(replicas), self._turn)
        self._turn += 1
        if not candidates:
            return []
        return [r.id for r in sorted(candidates, key=self.rule(request, candidates))]
