"""What a policy sees: the request as routing data and a read-only snapshot of each replica."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

# What a replica does in a prefill/decode disaggregated fleet (policies.pd), as protocol.disaggregation
# names the roles on the wire (this pure layer imports no protocol code; a test keeps the two equal).
Role = Literal["mixed", "prefill", "decode"]


# Neither is frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, which made
# a view cost 2.6 µs to build against 0.5, for every replica at every decision. Policies read them and
# never write them.
@dataclass(slots=True)
class RouteRequest:
    """A request reduced to what routing needs; built by the gateway (or a simulator) per request."""

    prompt_tokens: int
    # Leading block hash of the prompt at the first candidate's block size (0 when shorter than a
    # block): a stable per-prefix key for tie-breaking and sampling, never a replica preference.
    prefix_key: int = 0
    # Session key for affinity routing: a configured header's value or the OpenAI `user` field.
    session: str | None = None


@dataclass(slots=True)
class ReplicaView:
    """One replica as the gateway currently believes it to be."""

    id: str
    healthy: bool = True
    block_size: int = 16
    # Leading blocks of this request that the replica holds in its KV cache (index match).
    matched_blocks: int = 0
    # Requests admitted and running on the replica, and those queued behind them.
    running: int = 0
    waiting: int = 0
    # Prompt tokens still to be prefilled ahead of a new arrival.
    queued_prefill_tokens: int = 0
    # Queue length at which the replica counts as saturated (a hot spot must spill past it).
    max_waiting: int = 64
    # Prompt tokens per second the replica prefills; learned by the gateway from observed TTFTs.
    prefill_rate: float = 10_000.0
    # KV blocks the index holds for this replica (all prefixes, not just this request's): how full
    # its cache is believed to be, which cache_threshold reads to place unmatched prompts.
    cached_blocks: int = 0
    role: Role = "mixed"
    # KV blocks no sequence holds (cached ones that could be evicted count as free); None: not reported.
    free_blocks: int | None = None
    # How a prefill or decode replica moves KV to its pair: replicas pair only within one protocol
    # (None: prefixgate's own, between bundled workers).
    pd_protocol: str | None = None
    # Whether it can compute a prompt itself (an SGLang decode server cannot: it only decodes what a
    # prefill server sends it).
    local_prefill: bool = True

    @property
    def load(self) -> int:
        """Outstanding requests: the queue-length signal of the load-based policies."""
        return self.running + self.waiting

    @property
    def cached_tokens(self) -> int:
        return self.matched_blocks * self.block_size


class Policy(Protocol):
    """A routing policy: an ordered choice of replica ids (first pick, then fallbacks).

    Unhealthy replicas are never returned; an empty list means nothing can serve the request.
    Policies may keep their own counters or seeded generators but never do I/O.
    """

    name: str

    def choose(self, request: RouteRequest, replicas: list[ReplicaView]) -> list[str]: ...


def healthy(replicas: list[ReplicaView]) -> list[ReplicaView]:
    return [r for r in replicas if r.healthy]


def rotate(items: list[ReplicaView], offset: int) -> list[ReplicaView]:
    """`items` started at position `offset`: the tie-break that spreads equal choices around."""
    if not items:
        return items
    k = offset % len(items)
    return items[k:] + items[:k]
