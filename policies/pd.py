"""Prefill/decode pairing (docs/design.md §4, §5): routing for a model served by a prefill pool and a
decode pool.

Each request goes to a pair: a decode replica that answers the client, and the prefill replica that
computes its prompt and sends the KV over, or none when the decode replica computes the prompt itself.

Who answers: decode replicas, and mixed ones; prefill replicas compute prompts for decode replicas and
answer no client. Each is scored by when it could start on this request, plus `decode_penalty_s` for
every sequence it already holds (running or queued), which the new one would slow down: decode is
memory-bound, every sequence in the batch adds to every step.

    start(r) = est_ttft(p)   r a decode replica lacking `min_transfer_tokens` or more of the prompt,
                             p the best prefill replica for the prompt
             = est_ttft(r)   otherwise: it computes the rest itself (and a mixed replica always does)
    cost(r)  = start(r) + decode_penalty_s * (running(r) + waiting(r))

with prefix_aware's est_ttft: queued prefill work plus the prompt's uncached tokens, at the replica's
prefill rate. So the decode replica's own cached prefix counts twice: a prompt mostly cached there (a
conversation's next turn, whose history it decoded or received) needs no prefill replica and no
transfer, and starts sooner than anywhere else unless that replica is much busier; among replicas that
all need a transfer, start is the same and the fewest sequences win. A replica whose free KV blocks
cannot hold the prompt's uncached blocks, or whose queue is at its limit, ranks after every other (as
prefix_aware's saturated ones do): admitted, the request would wait for blocks or preempt others.
Costs within `tie_tolerance_s` of the best are equal: then the fewest sequences, then
the most free blocks, then by the prompt's first block, so that one prefix's ties go where it went.

Which prefill replica: prefix_aware's own ranking among the prefill replicas that speak the decode
replica's transfer protocol (prefix affinity against queued prefill work: the prefix caches that save
prefill compute live there). The i-th answering choice is paired with the i-th prefill choice, cycling,
so that a retry after a failed attempt goes to a pair that did not fail.

Mixed replicas beside the pools compete with the pairs on the same cost, as replicas that compute
their prompts themselves: a fleet in transition, or a few mixed replicas kept for short prompts, take
the requests they would start sooner.

Empty pools: without a healthy prefill replica (or on a route whose body cannot name one, `transfer`
False), decode replicas compute prompts themselves, except those that cannot (SGLang's), which are left
out. Without a healthy decode or mixed replica there is no choice: a prefill replica's answer would be
one token, so the gateway refuses the request (503) and says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from policies.prefix_aware import PrefixAware
from policies.view import ReplicaView, RouteRequest, healthy, rotate


class PdConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # A decode replica lacking fewer of the prompt's tokens than this computes them itself: a transfer
    # costs a prefill replica's queue and the link more than a short tail costs the decode batch.
    min_transfer_tokens: int = Field(256, ge=0)
    # Seconds charged per sequence an answering replica already runs or queues.
    decode_penalty_s: float = Field(0.01, ge=0.0, le=10.0)
    # Costs closer than this to the best are a tie, broken by sequences, free blocks, then prefix.
    tie_tolerance_s: float = Field(0.001, ge=0.0, le=10.0)


@dataclass(frozen=True, slots=True)
class Pair:
    # The replica that answers the client: a decode replica, or a mixed one.
    decode: str
    # The prefill replica that computes the prompt for it; None: it computes the prompt itself.
    prefill: str | None = None


@dataclass(frozen=True, slots=True)
class _Row:
    # Out of KV room or at its queue limit: after every other.
    short: bool
    cost: float
    replica: ReplicaView
    # The prefill replicas to pair it with, best first (empty: it computes the prompt itself).
    prefills: list[ReplicaView]


class PrefillDecode:
    name = "pd"

    def __init__(self, config: PdConfig | None = None, prefill: PrefixAware | None = None) -> None:
        self.config = config or PdConfig()
        # Ranks prefill replicas, and estimates TTFTs: prefix_aware's, with the routing section's knobs.
        self.prefill = prefill or PrefixAware()
        self._turn = 0

    def choose(self, request: RouteRequest, replicas: list[ReplicaView], transfer: bool = True) -> list[Pair]:
        """Pairs, best first; empty when no replica can answer. `transfer`: whether this request's body
        can name a prefill replica (False: decode replicas compute its prompt themselves)."""
        candidates = healthy(replicas)
        # The rotation fixes the order among ties: the sort below is stable.
        answering = rotate([r for r in candidates if r.role != "prefill"], request.prefix_key or self._turn)
        self._turn += 1
        ranked: dict[str | None, list[ReplicaView]] = {}

        def prefills(protocol: str | None) -> list[ReplicaView]:
            """The prefill replicas speaking `protocol`, ranked once per request, when first needed."""
            if protocol not in ranked:
                pool = [r for r in candidates if r.role == "prefill" and r.pd_protocol == protocol]
                by_id = {r.id: r for r in pool}
                ranked[protocol] = [by_id[rid] for rid in self.prefill.choose(request, pool)] if pool else []
            return ranked[protocol]

        rows = []
        for r in answering:
            uncached = max(request.prompt_tokens - r.cached_tokens, 0)
            lacks = uncached >= self.config.min_transfer_tokens or not r.local_prefill
            paired = prefills(r.pd_protocol) if transfer and r.role == "decode" and lacks else []
            if not paired and not r.local_prefill:
                continue
            start = self.prefill.est_ttft(request, paired[0] if paired else r)
            short = r.waiting >= r.max_waiting or (
                r.free_blocks is not None and r.free_blocks < -(-uncached // r.block_size)
            )
            rows.append(_Row(short, start + self.config.decode_penalty_s * r.load, r, paired))
        if not rows:
            return []
        best = min(rows, key=lambda row: (row.short, row.cost))
        tolerance = self.config.tie_tolerance_s

        def rank(row: _Row) -> tuple[bool, float, int, int]:
            if row.short == best.short and row.cost - best.cost <= tolerance:
                free = row.replica.free_blocks
                return row.short, best.cost, row.replica.load, -(free if free is not None else 0)
            return row.short, row.cost, 0, 0

        ordered = sorted(rows, key=rank)
        return [
            Pair(row.replica.id, row.prefills[i % len(row.prefills)].id if row.prefills else None)
            for i, row in enumerate(ordered)
        ]
