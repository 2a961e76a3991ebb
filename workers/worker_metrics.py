"""The worker's Prometheus metrics, in a registry of its own per app (never the global one), so that
several workers can live in one process (tests, the fleet simulator) without clashing.

The queue and cache gauges are exported twice: under prefixgate's names and under the names vLLM
uses, so that dashboards and load pickers written for vLLM read a prefixgate worker unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from protocol.serving import LATENCY_BUCKETS
from workers.engine.scheduler import SchedulerStats

if TYPE_CHECKING:
    from workers.engine.model.moe import RoutingCounts


class WorkerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.model = model
        by_model = ("model_name",)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, by_model, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, by_model, registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, by_model, buckets=LATENCY_BUCKETS, registry=registry)

        self.requests = Counter(
            "prefixgate_worker_requests",
            "HTTP requests by endpoint and status code (499: the client left)",
            ("endpoint", "status"),
            registry=registry,
        )
        self.ttft = histogram(
            "prefixgate_worker_time_to_first_token_seconds", "From request arrival to its first token"
        )
        self.e2e = histogram(
            "prefixgate_worker_e2e_request_latency_seconds", "From request arrival to its end"
        )
        self.prompt_tokens = counter("prefixgate_worker_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("prefixgate_worker_generation_tokens", "Generated tokens")
        self.cache_hit_tokens = counter(
            "prefixgate_worker_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"
        )
        # Each load figure under prefixgate's name and vLLM's.
        self._load_gauges = {
            "running": (
                gauge("prefixgate_worker_requests_running", "Sequences in the running batch"),
                gauge("vllm:num_requests_running", "Sequences in the running batch"),
            ),
            "waiting": (
                gauge("prefixgate_worker_requests_waiting", "Sequences waiting to be admitted"),
                gauge("vllm:num_requests_waiting", "Sequences waiting to be admitted"),
            ),
            "kv_usage": (
                gauge("prefixgate_worker_kv_cache_usage_ratio", "Fraction of KV blocks in use"),
                gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use, 0 to 1 despite the name"),
            ),
        }
        self.queued_prefill_tokens = gauge(
            "prefixgate_worker_queued_prefill_tokens", "Prompt tokens not yet in the KV cache"
        )
        self.kv_blocks_used = gauge("prefixgate_worker_kv_blocks_used", "KV blocks referenced by a sequence")
        self.kv_blocks_total = gauge("prefixgate_worker_kv_blocks_total", "KV blocks in the pool")
        self.cached_blocks = gauge(
            "prefixgate_worker_kv_cached_blocks", "Blocks registered in the prefix cache"
        )
        # Prefill/decode disaggregation: KV pulled in (decode side) and pushed out (prefill side).
        self.transferred_tokens = counter(
            "prefixgate_worker_kv_transfer_tokens", "Prompt tokens whose KV arrived from a prefill worker"
        )
        self.transfer_received_bytes = counter(
            "prefixgate_worker_kv_transfer_received_bytes", "KV bytes received from prefill workers"
        )
        self.transfer_sent_bytes = counter(
            "prefixgate_worker_kv_transfer_sent_bytes", "KV bytes pushed to decode workers"
        )
        self.transfer_seconds = histogram(
            "prefixgate_worker_kv_pull_seconds", "From asking a prefill worker to having its KV"
        )
        self.transfer_failures = counter(
            "prefixgate_worker_kv_pull_failures", "Pulls given up: the prompt was computed here instead"
        )

        self.moe = MoeMetrics(registry)

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def observe_finished(
        self, e2e_s: float, prompt_tokens: int, completion_tokens: int, cached_tokens: int
    ) -> None:
        self.e2e.labels(self.model).observe(e2e_s)
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.generation_tokens.labels(self.model).inc(completion_tokens)
        self.cache_hit_tokens.labels(self.model).inc(cached_tokens)

    def observe_pull(self, tokens: int, num_bytes: int, seconds: float, *, failed: bool) -> None:
        if failed:
            self.transfer_failures.labels(self.model).inc()
            return
        self.transferred_tokens.labels(self.model).inc(tokens)
        self.transfer_received_bytes.labels(self.model).inc(num_bytes)
        if tokens:
            self.transfer_seconds.labels(self.model).observe(seconds)

    def observe_push(self, num_bytes: int) -> None:
        self.transfer_sent_bytes.labels(self.model).inc(num_bytes)

    def set_load(self, stats: SchedulerStats, cached_blocks: int) -> None:
        values = {"running": stats.running, "waiting": stats.waiting, "kv_usage": stats.kv_usage}
        for key, gauges in self._load_gauges.items():
            for gauge in gauges:
                gauge.labels(self.model).set(values[key])
        self.queued_prefill_tokens.labels(self.model).set(stats.queued_prefill_tokens)
        self.kv_blocks_used.labels(self.model).set(stats.kv_blocks_used)
        self.kv_blocks_total.labels(self.model).set(stats.kv_blocks_total)
        self.cached_blocks.labels(self.model).set(cached_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MoeMetrics:
    """Tokens routed per expert and per expert-parallel rank (summed over MoE layers): in total, and in
    the last step with the rank imbalance (max / mean), which is what an all-to-all waits on. Exported
    only by workers serving a mixture-of-experts model."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._totals: dict[str, Counter] = {}
        self._steps: dict[str, Gauge] = {}
        for kind, whose in (("expert", "each expert"), ("rank", "each rank's experts")):
            labels = ("model_name", kind)
            self._totals[kind] = Counter(
                f"prefixgate_worker_moe_{kind}_tokens", f"Tokens routed to {whose}", labels, registry=registry
            )
            self._steps[kind] = Gauge(
                f"prefixgate_worker_moe_step_{kind}_tokens",
                f"Tokens routed to {whose} in the last step",
                labels,
                registry=registry,
            )
        self.step_imbalance = Gauge(
            "prefixgate_worker_moe_step_rank_imbalance",
            "Max over mean of the ranks' routed tokens in the last step (1: balanced)",
            ("model_name",),
            registry=registry,
        )
        # Totals already counted, per (kind, index): counters only go up by what is new.
        self._counted: dict[tuple[str, int], int] = {}

    def set(self, model: str, routing: RoutingCounts, ranks: int) -> None:
        by_rank = routing.per_rank(routing.last_step, ranks).tolist()
        self._export(model, "expert", routing.total.tolist(), routing.last_step.tolist())
        self._export(model, "rank", routing.per_rank(routing.total, ranks).tolist(), by_rank)
        mean = sum(by_rank) / ranks
        self.step_imbalance.labels(model).set(max(by_rank) / mean if mean else 1.0)

    def _export(self, model: str, kind: str, totals: list[int], last_step: list[int]) -> None:
        for index, (total, step) in enumerate(zip(totals, last_step, strict=True)):
            self._totals[kind].labels(model, str(index)).inc(total - self._counted.get((kind, index), 0))
            self._counted[(kind, index)] = total
            self._steps[kind].labels(model, str(index)).set(step)
