"""What a request needs of the gateway, and nothing it does not (docs/design.md §2.1).

A request reads the config in force, the replicas and what they are known to hold, the policy that
chooses among them, and writes back what its answer taught: load, first-token times, predictions,
the owner of a stored response. It never starts a replica's KV follower, probes one, or reloads the
config: that is the lifecycle's (gateway.gateway.Gateway), which owns this state and keeps it current
on the same event loop — hence no locks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from gateway.fleet.predictions import Predictions
from gateway.fleet.replicas import Replica, ReplicaSet
from gateway.fleet.response_owners import ResponseOwners
from gateway.forward.prefill_queue import PrefillQueue
from gateway.forward.tokenizers import Tokenizers
from gateway.forward.upstream_client import UpstreamClient
from gateway.gateway_config import GatewayConfig
from gateway.gateway_metrics import GatewayMetrics
from policies import Policy, PrefillDecode, build_pd, build_policy
from policies.least_load import LeastLoad
from protocol.errors import RETRY_AFTER_S, ApiError
from radix import RadixIndex
from radix.chain_cache import ChainCache

log = logging.getLogger("prefixgate.gateway")


@dataclass
class GatewayState:
    config: GatewayConfig
    gateway_id: str
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    replicas: ReplicaSet = field(default_factory=ReplicaSet)
    # What each replica holds (limits.index_max_entries: kept across a reload, its bound set anew).
    index: RadixIndex = field(init=False)
    policy: Policy = field(init=False)
    # Models served by prefill and decode replicas are routed in pairs (policies.pd).
    pd: PrefillDecode = field(init=False)
    # Routes with no prompt to match (embeddings, scoring, any other /v1 route) go by load.
    by_load: Policy = field(default_factory=LeastLoad)
    tokenizers: Tokenizers = field(init=False)
    # Recent prompts' block hashes (limits.hash_cache_mib), so that a prompt is hashed where it grew.
    chains: ChainCache = field(init=False)
    # Made when the gateway starts, on its loop (they hold connections and tasks).
    upstream: UpstreamClient = field(init=False)
    predictions: Predictions = field(init=False)
    response_owners: ResponseOwners = field(init=False)
    # Generation requests in the gateway now, from arrival to the end of the response.
    inflight: int = 0
    # Requests held while their replica computes others (limits.prefill_depth; unused without one).
    prefill_queue: PrefillQueue = field(default_factory=PrefillQueue)

    def __post_init__(self) -> None:
        self.configure(self.config)
        self.tokenizers = tokenizers_of(self.config)
        # Read through self at each scrape: a reload swaps the tokenizers.
        self.metrics.watch_caches(lambda: self.tokenizers.cache_stats(), lambda: self.chains.stats)

    def admit(self) -> None:
        """A 429 when the gateway is at `limits.max_inflight` requests in flight."""
        limit = self.config.limits.max_inflight
        if self.inflight >= limit:
            raise ApiError(
                429,
                f"the gateway is at its limit of {limit} requests in flight; retry shortly",
                code="gateway_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def configure(self, config: GatewayConfig) -> None:
        """The config and the policies made from it (a reload swaps the tokenizers itself, once the
        new ones are loaded)."""
        self.config = config
        if config.limits.prefill_depth is not None:
            self.prefill_queue.depth = config.limits.prefill_depth
        self.policy = build_policy(config.routing)
        self.pd = build_pd(config.routing)
        if hasattr(self, "index"):
            self.index.bound_entries(config.limits.index_max_entries)
        else:
            self.index = RadixIndex(config.limits.index_max_entries)
        bound = config.limits.hash_cache_mib * 2**20
        if not hasattr(self, "chains") or self.chains.max_bytes != bound:
            self.chains = ChainCache(bound)  # kept across a reload that leaves its bound as it was

    @property
    def approximate_everywhere(self) -> bool:
        """`prefix_aware.mode: approximate` predicts every replica's cache, even bundled ones'."""
        return self.config.routing.prefix_aware.mode == "approximate"

    def mark_failure(self, replica: Replica) -> None:
        replica.failures += 1
        if replica.failures >= self.config.health.failures and replica.healthy:
            replica.healthy = False
            replica.down_since = time.monotonic()
            log.warning("replica %s is unhealthy after %d failures", replica.id, replica.failures)


def tokenizers_of(config: GatewayConfig) -> Tokenizers:
    specs = {name: m.tokenizer for name, m in config.models.items()}
    return Tokenizers(specs, cache_bytes=config.limits.tokenizer_cache_mib * 2**20)
