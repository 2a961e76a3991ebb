"""One routing decision (docs/design.md §2 steps 3-5): hash the prompt, match the index, ask the policy.

Pure: the prompt's token ids in, an ordered choice and its explanation out. Hashes are computed once
per distinct block size among the model's replicas, since a hash chain depends on the block size.
A model served by prefill and decode replicas is routed in pairs (policies.pd), whatever the policy:
the order is then of the replicas that answer, each with the prefill replica it is paired with.

The prefill rates the policy weighs are pooled: each replica's is learned from its own TTFTs, which
also hold network, scheduling and decode steps, so replicas of one speed learn rates tens of percent
apart. Routed by them, a fleet of equal replicas sent every new prefix to whichever looked fastest,
and moved conversations off the replica holding their history to one that only looked faster for a
few TTFTs. So every replica routes by the median of its peers' learned rates (which follows the
fleet's load quickly), scaled by its relative speed only when that is evidence of another kind of
replica (another GPU, another model size): its speed, averaged over many TTFTs (Replica.speed),
differs from its peers' median by more than DISTINCT_RATE after MIN_SPEED_SAMPLES of them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.fleet.replicas import SPEED_ALPHA, Replica
from policies import Policy, PrefillDecode, ReplicaView, RouteRequest
from policies.prefix_aware import prefill_wait_s
from radix import RadixIndex, block_hashes
from radix.chain_cache import ChainCache

# A learned rate this far from the peers' median marks a replica of another speed.
DISTINCT_RATE = 0.3
# TTFTs a rate must be learned from before it counts.
MIN_RATE_SAMPLES = 4
# TTFTs a replica's speed must be learned from before it can set the replica apart: its whole window.
MIN_SPEED_SAMPLES = round(1 / SPEED_ALPHA)


@dataclass(frozen=True, slots=True)
class Decision:
    # Replica ids, best first; empty when none can serve.
    order: list[str]
    views: list[ReplicaView]
    # The prompt's block hashes per block size (what a prediction records for the chosen replica).
    hashes: dict[int, list[int]]
    # The tokens routed on: a prompt longer than limits.max_routed_tokens counts as its head.
    prompt_tokens: int
    seconds: float
    # The policy that decided: the configured one, or "pd" for a model served in pairs.
    policy: str
    # The prefill replica each choice in `order` is paired with; one absent computes the prompt itself.
    prefill: dict[str, str] = field(default_factory=dict)

    def view_of(self, replica_id: str) -> ReplicaView:
        return next(v for v in self.views if v.id == replica_id)

    def explain(self) -> list[dict[str, object]]:
        """Per replica: what the policy saw, and the estimated TTFT prefix_aware would compute."""
        rows = []
        for v in self.views:
            rows.append(
                {
                    "replica": v.id,
                    "role": v.role,
                    "healthy": v.healthy,
                    "matched_blocks": v.matched_blocks,
                    "cached_tokens": min(v.cached_tokens, self.prompt_tokens),
                    "running": v.running,
                    "waiting": v.waiting,
                    "queued_prefill_tokens": v.queued_prefill_tokens,
                    "prefill_rate": round(v.prefill_rate, 1),
                    "est_ttft_s": round(prefill_wait_s(self.prompt_tokens, v), 6),
                    "rank": self.order.index(v.id) if v.id in self.order else None,
                    "prefill_replica": self.prefill.get(v.id),
                }
            )
        return rows


def decide(
    policy: Policy,
    index: RadixIndex,
    replicas: list[Replica],
    tokens: Sequence[int] | None,
    session: str | None = None,
    pd: PrefillDecode | None = None,
    transfer: bool = True,
    chains: ChainCache | None = None,
) -> Decision:
    """Route a prompt (None: not tokenized, so no prefix to match) among one model's replicas; in pairs
    by `pd` when some of them are prefill or decode replicas (`transfer`: whether the request's body
    can name a prefill replica). `chains`: recent prompts' hashes, to hash only what a prompt adds."""
    start = time.perf_counter()
    hashes: dict[int, list[int]] = {}
    matched: dict[str, int] = {}
    if tokens:
        for size in sorted({r.block_size for r in replicas}):
            model = next(r.model for r in replicas if r.block_size == size)
            chain = (chains.block_hashes if chains is not None else block_hashes)(tokens, size, model)
            hashes[size] = chain
            # Chains of different block sizes never share a hash, so the matches never collide.
            if chain:
                matched |= index.match(chain)
    rates = routing_rates(replicas)
    prompt = len(tokens or ())
    views = [
        r.view(reusable(matched.get(r.id, 0), prompt, r.block_size), index.blocks_of(r.id), rates[r.id])
        for r in replicas
    ]
    first = min(hashes) if hashes else None
    request = RouteRequest(
        prompt_tokens=len(tokens or ()),
        prefix_key=hashes[first][0] if first is not None and hashes[first] else 0,
        session=session,
    )
    prefill: dict[str, str] = {}
    if pd is not None and any(r.role != "mixed" for r in replicas):
        pairs = pd.choose(request, views, transfer)
        order, name = [p.decode for p in pairs], pd.name
        prefill = {p.decode: p.prefill for p in pairs if p.prefill is not None}
    else:
        order, name = policy.choose(request, views), policy.name
    seconds = time.perf_counter() - start
    return Decision(order, views, hashes, len(tokens or ()), seconds, name, prefill)


def reusable(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Of a prompt's matched blocks, those a replica can reuse: an engine computes at least the prompt's
    last token, so a block that ends the prompt is computed again even where it is cached."""
    return min(matched_blocks, max(prompt_tokens - 1, 0) // block_size)


def routing_rates(replicas: list[Replica]) -> dict[str, float]:
    """The prefill rate each replica is routed by: the peers' median, times its relative speed where
    that sets it apart."""
    learned = [r.prefill_rate for r in replicas if r.rate_samples >= MIN_RATE_SAMPLES]
    if not learned:
        return {r.id: r.prefill_rate for r in replicas}
    pooled = statistics.median(learned)
    known = {r.id: r.speed for r in replicas if r.rate_samples >= MIN_SPEED_SAMPLES and r.speed > 0}
    typical = statistics.median(known.values()) if known else 0.0
    rates: dict[str, float] = {}
    for r in replicas:
        relative = known[r.id] / typical if r.id in known else 1.0
        rates[r.id] = pooled * relative if abs(relative - 1) > DISTINCT_RATE else pooled
    return rates
