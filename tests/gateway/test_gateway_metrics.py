"""The gateway's metrics page: the tokenizers' prefix-cache and the hash-chain cache's counts exported
as counters, read from the caches at each scrape."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.forward.prefix_cache import CacheStats
from gateway.gateway_metrics import GatewayMetrics
from radix.chain_cache import ChainStats

LOOKUPS = "prefixgate_gateway_tokenizer_cache_lookups_total"
TOKENS = "prefixgate_gateway_tokenizer_cache_tokens_total"


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    page = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def test_prefix_cache_counts_are_counters_read_at_each_scrape() -> None:
    metrics = GatewayMetrics()
    stats = {"m": CacheStats(hits=3, misses=1, reused_tokens=900, tokenized_tokens=120, bytes=4096)}
    chains = ChainStats(reused_blocks=590, hashed_blocks=30, bytes=8192)
    metrics.watch_caches(lambda: stats, lambda: chains)
    page = samples(metrics)
    assert page[LOOKUPS, (("model", "m"), ("outcome", "hit"))] == 3
    assert page[LOOKUPS, (("model", "m"), ("outcome", "miss"))] == 1
    assert page[TOKENS, (("model", "m"), ("source", "cache"))] == 900
    assert page["prefixgate_gateway_hash_cache_blocks_total", (("source", "cache"),)] == 590
    assert page["prefixgate_gateway_hash_cache_bytes", ()] == 8192
    assert page["prefixgate_gateway_tokenizer_cache_bytes", (("model", "m"),)] == 4096
    # The next scrape reads the cache as it is then; a model whose cache went is no longer listed.
    stats["m"].hits = 5
    stats["n"] = CacheStats()
    page = samples(metrics)
    assert page[LOOKUPS, (("model", "m"), ("outcome", "hit"))] == 5
    assert page["prefixgate_gateway_tokenizer_cache_bytes", (("model", "n"),)] == 0
    del stats["m"]
    assert not any(labels == (("model", "m"),) for _, labels in samples(metrics))
