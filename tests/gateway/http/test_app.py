"""The gateway's OpenAI API over real simulated workers: the official client, streaming and not,
prefix-aware placement with cached tokens, every bad input a 4xx in OpenAI's shape, auth, failover,
and a client that leaves aborting the work upstream."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker

SYSTEM = "You are a careful assistant for a library. " * 12
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def fleet(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> Iterator[tuple[RunningGateway, list[SimWorker]]]:
    workers = [start_sim_worker(f"w{i}") for i in range(2)]
    yield start_gateway([w.url for w in workers]), workers


def chat(gateway: RunningGateway, question: str, **kwargs: object) -> tuple[object, httpx.Headers]:
    raw = gateway.client().chat.completions.with_raw_response.create(
        model=SIM_MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=8,
        **GREEDY,
        **kwargs,
    )
    return raw.parse(), raw.headers


def test_a_shared_prefix_goes_where_it_is_cached(fleet: tuple[RunningGateway, list[SimWorker]]) -> None:
    gateway, _ = fleet
    first, h1 = chat(gateway, "Where is the history section?")
    assert first.usage.prompt_tokens > 100 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert int(h1["x-prefixgate-predicted-cached-tokens"]) == 0
    # The model's wait on an idle fleet that has learned nothing: the whole prompt at the prior rate.
    prior = gateway.state.config.learning.prefill_rate_prior
    assert int(h1["x-prefixgate-predicted-ttft-ms"]) == round(1000 * first.usage.prompt_tokens / prior)
    # The KV events reach the gateway's index over HTTP; the next request sharing the system prompt
    # must follow them to the same replica and be served mostly from its cache.
    deadline = time.monotonic() + 5
    while gateway.state.index.blocks_of(h1["x-prefixgate-replica"]) == 0:
        assert time.monotonic() < deadline, "the KV events never reached the gateway's index"
        time.sleep(0.02)
    second, h2 = chat(gateway, "When do you close on Sundays?")
    assert h2["x-prefixgate-replica"] == h1["x-prefixgate-replica"]
    predicted = int(h2["x-prefixgate-predicted-cached-tokens"])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert predicted >= 100 and cached >= predicted - 16
    assert h2["x-prefixgate-policy"] == "prefix_aware"
    # Each answer's prediction is in the metrics beside its TTFT.
    text = httpx.get(f"{gateway.url}/metrics").text
    series = f'{{model="{SIM_MODEL}",replica="{h1["x-prefixgate-replica"]}"}}'
    for name in ("time_to_first_token_seconds", "predicted_time_to_first_token_seconds"):
        assert f"prefixgate_gateway_{name}_count{series} 2.0" in text, name


def test_streaming_passes_every_chunk_and_usage_through(
    fleet: tuple[RunningGateway, list[SimWorker]],
) -> None:
    gateway, _ = fleet
    client = gateway.client()
    stream = client.completions.create(
        model=SIM_MODEL,
        prompt=list(range(1000, 1100)),
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens == 100
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 12
    chat_stream = client.chat.completions.create(
        model=SIM_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True, **GREEDY
    )
    deltas = [c.choices[0].delta for c in chat_stream if c.choices]
    assert deltas[0].role == "assistant" and sum(1 for d in deltas if d.content) == 5
    completion = client.completions.create(model=SIM_MODEL, prompt="Once upon a time", max_tokens=4, **GREEDY)
    assert completion.usage.completion_tokens == 4 and completion.choices[0].finish_reason == "length"


def test_different_prefixes_spread_over_the_replicas(fleet: tuple[RunningGateway, list[SimWorker]]) -> None:
    gateway, _ = fleet
    client = gateway.client()
    served = set()
    for i in range(8):
        raw = client.completions.with_raw_response.create(
            model=SIM_MODEL, prompt=[2000 + 100 * i + j for j in range(64)], max_tokens=2, **GREEDY
        )
        served.add(raw.headers["x-prefixgate-replica"])
    assert served == {"w0", "w1"}


def test_models_health_metrics_and_openapi(fleet: tuple[RunningGateway, list[SimWorker]]) -> None:
    gateway, _ = fleet
    models = gateway.client().models.list().data
    assert [m.id for m in models] == [SIM_MODEL]
    health = httpx.get(f"{gateway.url}/health").json()
    assert health["status"] == "ok" and health["replicas"]["routable"] == 2
    chat(gateway, "count me")
    text = httpx.get(f"{gateway.url}/metrics").text
    for name in (
        "prefixgate_gateway_requests_total",
        "prefixgate_gateway_time_to_first_token_seconds_bucket",
        "prefixgate_gateway_routing_decision_seconds_bucket",
        "prefixgate_gateway_predicted_cached_tokens_total",
        "prefixgate_gateway_realised_cached_tokens_total",
        "prefixgate_gateway_index_entries",
        'prefixgate_gateway_replica_healthy{model="Llama-3.1-8B-Instruct",replica="w0"} 1.0',
        "prefixgate_gateway_kv_sync_lag_seconds",
    ):
        assert name in text, name
    assert 'status="200"' in text
    spec = httpx.get(f"{gateway.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/debug/route"} <= set(spec["paths"])


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/completions", {"model": SIM_MODEL, "prompt": ""}, 400, "invalid_value"),
    ("/v1/completions", {"model": SIM_MODEL}, 400, "invalid_value"),
    ("/v1/completions", {"model": SIM_MODEL, "prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": SIM_MODEL, "prompt": "x", "max_tokens": "9"}, 400, "invalid_value"),
    ("/v1/completions", {"model": SIM_MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "invalid_value"),
    ("/v1/completions", {"model": SIM_MODEL, "prompt": "x", "temperature": 7}, 400, "invalid_value"),
    ("/v1/completions", {"model": SIM_MODEL, "prompt": [1, -4]}, 400, "invalid_value"),
    ("/v1/completions", {"model": SIM_MODEL, "prompt": "x", "best_of": 3}, 400, "unsupported"),
    # What a bundled worker cannot honour is its to refuse, naming the field (a foreign one may serve it).
    (
        "/v1/chat/completions",
        {"model": SIM_MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "unsupported",
    ),
    (
        "/v1/chat/completions",
        {
            "model": SIM_MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
        },
        400,
        "unsupported",
    ),
    ("/v1/completions", {"model": "gpt-17", "prompt": "x"}, 404, "model_not_found"),
    ("/v1/completions", {"model": 5, "prompt": "x"}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": SIM_MODEL, "messages": []}, 400, "invalid_value"),
    (
        "/v1/chat/completions",
        {"model": SIM_MODEL, "messages": [{"role": "robot", "content": "x"}]},
        400,
        None,
    ),
    (
        "/v1/completions",
        {"model": SIM_MODEL, "prompt": [1000 + i % 40_000 for i in range(131_072)]},
        400,
        None,
    ),
    ("/v1/embeddings", {"model": SIM_MODEL, "input": "x"}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "code"), BAD_REQUESTS)
def test_bad_input_gets_an_openai_error(
    fleet: tuple[RunningGateway, list[SimWorker]], path: str, body: object, status: int, code: str | None
) -> None:
    gateway, _ = fleet
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{gateway.url}{path}", content=content, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code


def test_the_context_window_error_names_both_numbers(fleet: tuple[RunningGateway, list[SimWorker]]) -> None:
    gateway, _ = fleet
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().completions.create(
            model=SIM_MODEL, prompt=[1000 + i % 40_000 for i in range(131_072)]
        )
    assert "131072" in caught.value.message


def test_an_oversized_body_is_413(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    gateway = start_gateway([start_sim_worker("w0").url], limits={"max_body_bytes": 4096})
    response = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": SIM_MODEL, "prompt": "x" * 10_000}, timeout=10
    )
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"


def test_api_keys_and_the_admin_token(
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_PG_KEYS", "k1, k2")
    monkeypatch.setenv("TEST_PG_ADMIN", "root-token")
    worker = start_sim_worker("w0")
    gateway = start_gateway(
        [worker.url], auth={"api_keys_env": "TEST_PG_KEYS", "admin_token_env": "TEST_PG_ADMIN"}
    )
    with pytest.raises(openai.AuthenticationError):
        gateway.client("wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        gateway.client("root-token").models.list()  # the admin token is not an API key
    assert gateway.client("k2").models.list().data[0].id == SIM_MODEL
    assert gateway.admin("GET", "/admin/replicas").status_code == 401
    assert gateway.admin("GET", "/admin/replicas", token="k1").status_code == 401
    assert gateway.admin("GET", "/admin/replicas", token="root-token").status_code == 200
    assert httpx.get(f"{gateway.url}/health").status_code == 200  # probes need no key
    # The client's key is not forwarded: the worker would have seen it in its logs otherwise. The
    # request succeeds through a key the worker never checks, which is all a foreign backend sees.
    assert gateway.client("k1").completions.create(model=SIM_MODEL, prompt=[5, 6, 7], max_tokens=1).choices


def test_a_dead_replica_is_skipped_and_marked_unhealthy(
    fleet: tuple[RunningGateway, list[SimWorker]],
) -> None:
    gateway, workers = fleet
    workers[0].server.stop()
    client = gateway.client()
    for i in range(6):
        raw = client.completions.with_raw_response.create(
            model=SIM_MODEL, prompt=[3000 + 50 * i + j for j in range(40)], max_tokens=2, **GREEDY
        )
        assert raw.headers["x-prefixgate-replica"] == "w1"
    deadline = time.monotonic() + 5
    while gateway.state.replicas.get("w0").healthy:
        assert time.monotonic() < deadline, "the dead replica stayed healthy"
        time.sleep(0.05)
    health = httpx.get(f"{gateway.url}/health").json()
    assert health["replicas"]["routable"] == 1


def test_no_replica_at_all_is_a_503_with_retry_after(
    start_gateway: Callable[..., RunningGateway],
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    gateway = start_gateway([dead], wait_for=0)
    response = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    # No replica means no model either: the gateway says what it serves (nothing) rather than hang.
    assert response.status_code in (400, 404) and response.json()["error"]["message"]
    assert httpx.get(f"{gateway.url}/health").status_code == 503
    pending = gateway.admin("GET", "/admin/replicas").json()["pending"]
    assert pending == [{"url": dead, "source": "config"}]


def test_a_client_that_leaves_aborts_the_request_upstream(
    fleet: tuple[RunningGateway, list[SimWorker]],
) -> None:
    gateway, workers = fleet
    body = {
        "model": SIM_MODEL,
        "prompt": list(range(1000, 1200)),
        "max_tokens": 6000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        served = next(w for w in workers if w.id == response.headers["x-prefixgate-replica"])
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        assert served.load()["running"] == 1
    # The connection is gone: the worker must stop generating and release the blocks.
    deadline = time.monotonic() + 5
    while (load := served.load())["running"] or load["waiting"]:
        assert time.monotonic() < deadline, f"the upstream request kept running: {load}"
        time.sleep(0.05)
    assert not gateway.state.replicas.get(served.id).inflight


def test_requests_in_flight_are_counted_in_the_load_the_policy_sees(
    fleet: tuple[RunningGateway, list[SimWorker]],
) -> None:
    gateway, _ = fleet
    body = {"model": SIM_MODEL, "prompt": list(range(1000, 1100)), "max_tokens": 6000, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json={**body, "ignore_eos": True}) as response:
        rid = response.headers["x-prefixgate-replica"]
        lines = response.iter_lines()  # held: a dropped iterator closes the stream
        next(lines)
        replica = gateway.state.replicas.get(rid)
        assert len(replica.inflight) == 1
        deadline = time.monotonic() + 5
        while replica.load()[0] < 1:
            assert time.monotonic() < deadline, "the running request never showed in the load"
            time.sleep(0.02)


def test_a_prompt_in_flight_draws_the_requests_that_share_it(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    """Precise mode learns what a replica holds from its KV events, which come once the prompt is
    computed. A request sharing the prefix of one still being prefilled goes where that one is: it
    waits for that prefill anyway and then reuses it, where elsewhere it would compute it again."""
    workers = [start_sim_worker(f"w{i}", "--sim-profile", "cpu-smollm2") for i in range(2)]
    gateway = start_gateway([w.url for w in workers])
    model = httpx.get(f"{gateway.url}/v1/models").json()["data"][0]["id"]
    shared = [1000 + t for t in range(1500)]

    def complete(prompt: list[int]) -> httpx.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        return httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, [*shared, 1, 2, 3])
        time.sleep(0.3)  # the first is being prefilled (about a second on this profile)
        second = complete([*shared, 4, 5, 6])
    assert first.result().status_code == second.status_code == 200
    assert second.headers["x-prefixgate-replica"] == first.result().headers["x-prefixgate-replica"]
    assert int(second.headers["x-prefixgate-predicted-cached-tokens"]) >= 1488
    # Once both ended the index holds what the events confirmed, nothing more.
    again = complete([*shared, 7, 8, 9])
    assert again.headers["x-prefixgate-replica"] == first.result().headers["x-prefixgate-replica"]
    assert (
        int(again.headers["x-prefixgate-predicted-cached-tokens"])
        == again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
