"""Prefix-aware routing: send each request where it starts soonest, counting what a move costs the fleet
(docs/design.md §5). The whole model:

    ttft(r) = (Q(r) + P - C(r)) / mu(r) + decode_penalty_s * running(r)
    cost(r) = ttft(r) + (recompute_penalty + waiting_weight * W) * (C* - C(r)) / mu(r)

Q(r): prompt tokens queued ahead on r (its report, plus what the gateway sent it that has not yet
produced a first token); P: this prompt's tokens; C(r): the tokens of it r holds (the index's match);
mu(r): r's prefill rate, learned from observed TTFTs; C*: the most any replica holds; W: the requests
waiting for a first token across the fleet. The request goes to the least cost.

ttft is the request's own wait. The second term is what the fleet pays later for a move: a replica
that lacks a prefix another one holds recomputes it, and the history then lives in two caches
(recompute_penalty, 1: one recompute's worth), and the recompute's prefill time is taken from the
requests waiting behind it, one more recompute's worth for each request waiting in the fleet
(waiting_weight, 1): the fleet balances, so extra work on one replica pushes the next arrivals onto
the others and delays every queue. On an idle fleet a conversation's turn leaves the replica holding
its history only when that replica is slower by more than twice the recompute; as queues build, the
weight grows with them and sessions stay where their history is. A new prefix (C* = 0) simply goes
where it starts soonest, and a hot prefix spills once its holder's queue outgrows the margin.

Nothing else weighs in: among equal costs (an idle fleet, new prefixes on empty queues) the fewest
outstanding requests win, then the emptiest cache (a new prefix evicts least there and caches fill
evenly), then the prompt's first block picks, so distinct prefixes spread whatever order they come in
and one prefix's ties go where it went before. A replica whose queue is at its limit would refuse the
request (429): it ranks after every other. With `temperature` above 0 the first pick is sampled.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from policies.view import ReplicaView, RouteRequest, healthy, rotate


def prefill_wait_s(prompt_tokens: int, replica: ReplicaView) -> float:
    """(Q + P - C) / mu: the model's wait for a prompt's first token on `replica`, the prefill queued
    ahead and the prompt's uncached part at its prefill rate. What the gateway predicts for every
    answer (x-prefixgate-predicted-ttft-ms), so that the model can be checked against the TTFT seen."""
    uncached = max(prompt_tokens - replica.cached_tokens, 0)
    return (replica.queued_prefill_tokens + uncached) / replica.prefill_rate


class PrefixAwareConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # precise: the index follows workers' KV events; approximate: it predicts from routing decisions.
    mode: Literal["precise", "approximate"] = "precise"
    # Weight of the fleet's cost of recomputing a prefix another replica holds, with no request
    # waiting (0 here and below: ttft alone).
    recompute_penalty: float = Field(1.0, ge=0.0, le=100.0)
    # What each request waiting in the fleet adds to that weight: each is delayed by the recompute.
    waiting_weight: float = Field(1.0, ge=0.0, le=100.0)
    # Seconds per sequence a replica runs: what its decode steps add to a new prefill's wait.
    decode_penalty_s: float = Field(0.0, ge=0.0, le=10.0)
    # In seconds: 0 picks the least cost; above 0 samples the first pick with weight
    # exp(-(cost - best) / temperature), so a replica `temperature` seconds worse is e times rarer.
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    seed: int = 0


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, config: PrefixAwareConfig | None = None) -> None:
        self.config = config or PrefixAwareConfig()
        self._rng = random.Random(self.config.seed)
        self._turn = 0

    def est_ttft(self, request: RouteRequest, replica: ReplicaView) -> float:
        return prefill_wait_s(request.prompt_tokens, replica) + self.config.decode_penalty_s * replica.running

    def recompute_weight(self, fleet_waiting: int) -> float:
        """How many recomputes' worth the fleet pays for one, with `fleet_waiting` requests waiting."""
        return self.config.recompute_penalty + self.config.waiting_weight * fleet_waiting

    def cost(self, request: RouteRequest, replica: ReplicaView, best_cached: int, weight: float) -> float:
        """est_ttft plus the prefill time of the cached tokens this replica would redo, `weight` times."""
        redo = best_cached - min(replica.cached_tokens, request.prompt_tokens)
        return self.est_ttft(request, replica) + weight * redo / replica.prefill_rate

    @staticmethod
    def saturated(replica: ReplicaView) -> bool:
        """Its queue is at the limit past which it refuses requests."""
        return replica.waiting >= replica.max_waiting

    def choose(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[str]:
        # The rotation fixes the order among full ties: the sort below is stable.
        candidates = rotate(healthy(replicas), request.prefix_key or self._turn)
        self._turn += 1
        if not candidates:
            return []
        best_cached = min(max(r.cached_tokens for r in candidates), request.prompt_tokens)
        weight = self.recompute_weight(sum(r.waiting for r in candidates))
        rows = sorted(
            (
                (self.saturated(r), self.cost(request, r, best_cached, weight), r.load, r.cached_blocks, r.id)
                for r in candidates
            ),
            key=lambda row: row[:4],
        )
        order = [(saturated, cost, rid) for saturated, cost, _, _, rid in rows]
        if self.config.temperature > 0.0 and len(order) > 1:
            order = self._sample_first(order)
        return [rid for _, _, rid in order]

    def _sample_first(self, order: list[tuple[bool, float, str]]) -> list[tuple[bool, float, str]]:
        """Softmax over cost among the rows as saturated as the best; the rest keep their rank."""
        pool = [row for row in order if row[0] == order[0][0]]
        best = pool[0][1]
        weights = [math.exp(-(row[1] - best) / self.config.temperature) for row in pool]
        pick = self._rng.choices(range(len(pool)), weights=weights)[0]
        return [order[pick], *order[:pick], *order[pick + 1 :]]
