"""The gateway's metrics page: the tokenizers' prefix-cache counts exported as counters, read from the
caches at each scrape."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.forward.prefix_cache import CacheStats
from gateway.gateway_metrics import GatewayMetrics

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
    metrics.watch_prefix_caches(lambda: stats)
    page = samples(metrics)
    assert page[LOOKUPS, (("model", "m"), ("outcome", "hit"))] == 3
    assert page[LOOKUPS, (("model", "m"), ("outcome", "miss"))] == 1
    assert page[TOKENS, (("model", "m"), ("source", "cache"))] == 900
    assert page["prefixgate_gateway_tokenizer_cache_bytes", (("model", "m"),)] == 4096
    # The next scrape reads the cache as it is then; a model whose cache went is no longer listed.
    stats["m"].hits = 5
    stats["n"] = CacheStats()
    page = samples(metrics)
    assert page[LOOKUPS, (("model", "m"), ("outcome", "hit"))] == 5
    assert page["prefixgate_gateway_tokenizer_cache_bytes", (("model", "n"),)] == 0
    del stats["m"]
    assert not any(labels == (("model", "m"),) for _, labels in samples(metrics))
