"""The gateway's Prometheus metrics, in a registry of its own per app (several gateways share a test
process). Names say what a Grafana user reads: prefixgate_gateway_* by replica, model and policy.

Gauges that mirror state (health, index size, sync lag) are set at scrape time from the live
objects, so they can never drift from what routing actually sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as MetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics import MetricWrapperBase

from gateway.collector import Pauses
from gateway.forward.prefix_cache import CacheStats
from gateway.rejections import Rejections
from protocol.serving import LATENCY_BUCKETS
from radix.chain_cache import ChainStats

# Routing decisions take microseconds to a millisecond; inter-token gaps milliseconds to a second.
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


Metric = TypeVar("Metric", bound=MetricWrapperBase)


class GatewayMetrics:
    def __init__(self) -> None:
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "prefixgate_gateway_requests",
            "Requests by model, replica, policy, HTTP status (499: the client left) and route (chat, "
            "completions, responses, embeddings, score, tokenize, detokenize, other)",
            ("model", "replica", "policy", "status", "route"),
            registry=registry,
        )
        self.ttft = Histogram(
            "prefixgate_gateway_time_to_first_token_seconds",
            "From request arrival at the gateway to the first response bytes from the replica",
            ("model", "replica"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.predicted_ttft = Histogram(
            "prefixgate_gateway_predicted_time_to_first_token_seconds",
            "The routing model's wait for the first token on the chosen replica, (queued prefill + "
            "uncached prompt) / prefill rate: against time_to_first_token, whether the model holds",
            ("model", "replica"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "prefixgate_gateway_inter_token_seconds",
            "Gaps between streamed chunks passed through",
            ("model",),
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "prefixgate_gateway_e2e_request_latency_seconds",
            "From request arrival to the end of its response",
            ("model", "replica"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill_queue_wait = Histogram(
            "prefixgate_gateway_prefill_queue_wait_seconds",
            "Time a request waited at the gateway for its replica to take one more prompt "
            "(limits.prefill_depth; only where it is set)",
            ("model", "replica"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.decision = Histogram(
            "prefixgate_gateway_routing_decision_seconds",
            "Hashing, index match and policy choice for one request",
            ("policy",),
            buckets=DECISION_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "prefixgate_gateway_prompt_tokens",
            "Prompt tokens routed",
            ("model", "replica"),
            registry=registry,
        )
        self.predicted_cached = Counter(
            "prefixgate_gateway_predicted_cached_tokens",
            "Prompt tokens the index predicted the chosen replica held",
            ("model", "replica"),
            registry=registry,
        )
        self.realised_cached = Counter(
            "prefixgate_gateway_realised_cached_tokens",
            "Prompt tokens the replica reported served from its cache (usage.prompt_tokens_details)",
            ("model", "replica"),
            registry=registry,
        )
        self.upstream_errors = Counter(
            "prefixgate_gateway_upstream_errors",
            "Forwards that failed, by replica and kind: connect_failed, timeout, disconnected, bad_response, "
            "bad_url, or http_429/http_503 (a refusal retried elsewhere)",
            ("replica", "kind"),
            registry=registry,
        )
        self.index_entries = Gauge(
            "prefixgate_gateway_index_entries",
            "(hash, replica) entries in the prefix index",
            registry=registry,
        )
        self.replica_healthy = Gauge(
            "prefixgate_gateway_replica_healthy",
            "1 when the replica receives traffic (healthy and not draining)",
            ("replica", "model"),
            registry=registry,
        )
        self.inflight = Gauge(
            "prefixgate_gateway_inflight_requests",
            "Generation requests in the gateway now, from arrival to the end of the response",
            registry=registry,
        )
        self.replica_inflight = Gauge(
            "prefixgate_gateway_replica_inflight",
            "Requests this gateway has in flight on the replica",
            ("replica",),
            registry=registry,
        )
        self.replica_prefill_rate = Gauge(
            "prefixgate_gateway_replica_prefill_rate_tokens_per_second",
            "The prefill rate learned from observed TTFTs",
            ("replica",),
            registry=registry,
        )
        self.replica_capacity = Gauge(
            "prefixgate_gateway_replica_capacity_blocks",
            "The capacity bound of a predicted replica's cache, as configured and then learned from what "
            "it reports reusing (absent: unbounded, or followed exactly by its KV events)",
            ("replica",),
            registry=registry,
        )
        self.retries = Counter(
            "prefixgate_gateway_retries",
            "Requests sent to another replica after one failed before any output reached the client, by "
            "how it failed: connect_failed, timeout, disconnected, bad_response, http_429, http_503",
            ("model", "reason"),
            registry=registry,
        )
        self.stream_migrations = Counter(
            "prefixgate_gateway_stream_migrations",
            "Streams whose replica failed after output had reached the client, by outcome: continued "
            "(on another replica, as one stream), failed (no replica could continue it: an error event "
            "ended it) or unsupported (its backend cannot continue an answer: an error event ended it)",
            ("model", "outcome"),
            registry=registry,
        )
        self.pd_requests = Counter(
            "prefixgate_gateway_pd_requests",
            "Attempts sent to a prefill/decode pair: the prefill replica computes the prompt, the decode "
            "replica answers",
            ("model", "prefill", "decode"),
            registry=registry,
        )
        self.pd_transferred_tokens = Counter(
            "prefixgate_gateway_pd_transferred_tokens",
            "Prompt tokens a bundled decode worker received from its prefill worker instead of computing "
            "them (its x-prefixgate-transferred-tokens)",
            ("model", "prefill", "decode"),
            registry=registry,
        )
        self.pd_fallbacks = Counter(
            "prefixgate_gateway_pd_fallbacks",
            "Paired requests whose decode replica computed the prompt itself because the prefill replica "
            "failed (a bundled decode worker's x-prefixgate-prefill-error, or a vLLM prefill answer "
            "without kv_transfer_params)",
            ("model", "prefill"),
            registry=registry,
        )
        self.redis_up = Gauge(
            "prefixgate_gateway_redis_up",
            "1 while the gateway reaches Redis; 0: degraded, routing on its local index",
            registry=registry,
        )
        self.sync_lag = Gauge(
            "prefixgate_gateway_kv_sync_lag_seconds",
            "Age of the oldest KV event not yet applied to the index (0: caught up)",
            ("replica",),
            registry=registry,
        )
        self.sync_resyncs = Gauge(
            "prefixgate_gateway_kv_resyncs",
            "Snapshot resyncs of the replica's index entries since the gateway started",
            ("replica",),
            registry=registry,
        )
        self.rejected_entries = Counter(
            "prefixgate_gateway_rejected_entries",
            "Entries read from Redis, a replica's event socket or Kubernetes that failed validation and were "
            "skipped, by source: registry, load, kv_stream, kv_events, predictions, zmq, kubernetes "
            "(gateway/rejections.py)",
            ("source",),
            registry=registry,
        )
        self.rejections = Rejections(lambda source: self.child(self.rejected_entries, source).inc())

    def child(self, metric: Metric, *labels: str) -> Metric:
        """`metric.labels(*labels)`, bound once: labels() validates and takes a lock at every call,
        and a request touches eight series."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[return-value]

    def forget_replica(self, replica_id: str, model: str) -> None:
        """Drop the series of a replica that left, so dashboards do not show it forever."""
        for gauge in (
            self.replica_capacity,
            self.replica_inflight,
            self.replica_prefill_rate,
            self.sync_lag,
            self.sync_resyncs,
        ):
            _remove(gauge, replica_id)
        _remove(self.replica_healthy, replica_id, model)

    def watch_caches(
        self, prefixes: Callable[[], Mapping[str, CacheStats]], chains: Callable[[], ChainStats]
    ) -> None:
        """Export the counts of the tokenizers' prefix caches and of the hash-chain cache, read at each
        scrape: the caches count for themselves, so the request path touches no metric for them."""
        self.registry.register(_CacheCollector(prefixes, chains))

    def watch_collector(self, pauses: Pauses) -> None:
        """Export the garbage collector's pauses, counted by `pauses` (gateway.collector), at each scrape."""
        self.registry.register(_PauseCollector(pauses))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove(gauge: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: nothing to forget
        gauge.remove(*labels)


class _CacheCollector:
    """Per model, its tokenizer's prefix-cache counts since that tokenizer loaded (a reload starts
    them again, which Prometheus reads as a counter reset); the hash-chain cache's since start."""

    def __init__(
        self, prefixes: Callable[[], Mapping[str, CacheStats]], chains: Callable[[], ChainStats]
    ) -> None:
        self._prefixes = prefixes
        self._chains = chains

    def describe(self) -> list[MetricFamily]:
        return []  # no fixed samples to check against other collectors at registration

    def collect(self) -> Iterator[MetricFamily]:
        lookups = CounterMetricFamily(
            "prefixgate_gateway_tokenizer_cache_lookups",
            "Prompts tokenized through the model's prefix cache, by outcome: hit (a known prefix's ids "
            "reused) or miss",
            labels=("model", "outcome"),
        )
        tokens = CounterMetricFamily(
            "prefixgate_gateway_tokenizer_cache_tokens",
            "Prompt token ids by source: cache (a known prefix's) or tokenized",
            labels=("model", "source"),
        )
        held = GaugeMetricFamily(
            "prefixgate_gateway_tokenizer_cache_bytes",
            "Bytes the model's prefix cache holds (bounded by limits.tokenizer_cache_mib)",
            labels=("model",),
        )
        for model, s in self._prefixes().items():
            lookups.add_metric((model, "hit"), s.hits)
            lookups.add_metric((model, "miss"), s.misses)
            tokens.add_metric((model, "cache"), s.reused_tokens)
            tokens.add_metric((model, "tokenized"), s.tokenized_tokens)
            held.add_metric((model,), s.bytes)
        chains = self._chains()
        blocks = CounterMetricFamily(
            "prefixgate_gateway_hash_cache_blocks",
            "Prompt blocks routed by source of their hash: cache (a recent prompt's chain) or hashed",
            labels=("source",),
        )
        blocks.add_metric(("cache",), chains.reused_blocks)
        blocks.add_metric(("hashed",), chains.hashed_blocks)
        chain_bytes = GaugeMetricFamily(
            "prefixgate_gateway_hash_cache_bytes",
            "Bytes the hash-chain cache holds (bounded by limits.hash_cache_mib)",
            value=chains.bytes,
        )
        yield from (lookups, tokens, held, blocks, chain_bytes)


class _PauseCollector:
    """The garbage collector's pauses by generation (0, 1: young; 2: full) since the gateway started:
    each stops every request on the event loop."""

    def __init__(self, pauses: Pauses) -> None:
        self._pauses = pauses

    def describe(self) -> list[MetricFamily]:
        return []

    def collect(self) -> Iterator[MetricFamily]:
        p = self._pauses
        collections = CounterMetricFamily(
            "prefixgate_gateway_gc_collections", "Garbage collections by generation", labels=("generation",)
        )
        seconds = CounterMetricFamily(
            "prefixgate_gateway_gc_pause_seconds",
            "Time the event loop stood still in garbage collections, by generation",
            labels=("generation",),
        )
        longest = GaugeMetricFamily(
            "prefixgate_gateway_gc_longest_pause_seconds",
            "The longest garbage collection so far, by generation",
            labels=("generation",),
        )
        for g, (n, total, most) in enumerate(zip(p.collections, p.seconds, p.longest, strict=True)):
            collections.add_metric((str(g),), n)
            seconds.add_metric((str(g),), total)
            longest.add_metric((str(g),), most)
        yield from (collections, seconds, longest)
