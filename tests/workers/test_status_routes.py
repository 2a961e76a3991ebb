"""/v1/models, /health, /load and /metrics (workers.status_routes) over real loopback HTTP on the
tiny random model."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.workers import RunningWorker, StartWorker, load, random_ids, slow_down
from tests.workers.worker_http import LONG, first_event, greedy


def test_models_health_and_load(tiny_worker: RunningWorker) -> None:
    [model] = tiny_worker.client().models.list().data
    assert model.id == "tiny-llama" and model.owned_by == "prefixgate"
    health = httpx.get(f"{tiny_worker.url}/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny-llama"
    assert (health["block_size"], health["num_blocks"], health["max_context_len"]) == (4, 256, 512)
    assert (
        health["incarnation"] == tiny_worker.worker.events.incarnation
        and health["backend"] == "torch_sdpa"
        and health["backend_reason"].startswith("auto chose torch_sdpa: flash_attn cannot run")
    )
    assert load(tiny_worker) == {
        "running": 0,
        "waiting": 0,
        "queued_prefill_tokens": 0,
        "kv_blocks_used": 0,
        "kv_blocks_total": 256,
        "block_size": 4,
    }


def samples(worker: RunningWorker) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{worker.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_metrics_use_vllm_names_and_a_registry_per_app(make_worker: StartWorker) -> None:
    a, b = make_worker(), make_worker()
    slow_down(a, 0.02)
    ids = random_ids(24, seed=6)
    for _ in range(2):
        a.client().completions.create(model=a.model, prompt=ids, max_tokens=3, **greedy())
    model = (("model_name", "tiny-llama"),)
    with httpx.stream(
        "POST",
        f"{a.url}/v1/completions",
        json={"prompt": random_ids(30, seed=7), "max_tokens": 300, "stream": True, **LONG},
    ) as s:
        lines = s.iter_lines()
        first_event(lines)
        busy = samples(a)
    assert busy[("vllm:num_requests_running", model)] == 1
    assert busy[("vllm:num_requests_waiting", model)] == 0
    assert 0 < busy[("vllm:kv_cache_usage_perc", model)] <= 1
    assert busy[("prefixgate_worker_kv_blocks_total", model)] == 256
    assert (
        busy[("prefixgate_worker_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 2
    )
    assert busy[("prefixgate_worker_prompt_tokens_total", model)] == 48
    assert busy[("prefixgate_worker_generation_tokens_total", model)] == 6
    assert busy[("prefixgate_worker_prefix_cache_hit_tokens_total", model)] == 20
    assert busy[("prefixgate_worker_time_to_first_token_seconds_count", model)] == 3
    assert busy[("prefixgate_worker_e2e_request_latency_seconds_count", model)] == 2
    other = samples(b)
    assert (
        "prefixgate_worker_requests_total",
        (("endpoint", "/v1/completions"), ("status", "200")),
    ) not in other
    assert other[("vllm:num_requests_running", model)] == 0
