"""Our own prefill/decode pairs through the gateway: the decode worker's body names its prefill worker
(beside the token ids), unless it already holds the prompt; its headers are read and passed on; a prefill
pool alone answers nobody; a worker's announced role is the one that counts.

The workers are small servers written for the test that speak a bundled worker's HTTP surface (/health
with its role, /load, the KV snapshot and event long-poll) and record the bodies they receive."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web

from protocol.transfer_auth import SECRET_ENV, check_grant
from radix import block_hashes
from tests.support.gateways import RunningGateway
from tests.support.servers import ServerThread

MODEL = "pd-ours"
BLOCK = 16
PROMPT = list(range(1000, 1400))  # 400 token ids: 25 blocks
SECRET = "a-test-kv-transfer-secret"


@pytest.fixture(autouse=True)
def transfer_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet's KV transfer secret, where the gateway reads it: bundled pairs are signed with it."""
    monkeypatch.setenv(SECRET_ENV, SECRET)


def prefill_of(body: dict[str, Any]) -> str | None:
    """The prefill worker a decode worker's body names, in a grant signed with the fleet's secret."""
    checked = check_grant(SECRET.encode(), body["prefixgate_prefill"])
    return checked[0] if checked is not None else None


OTHER = list(range(5000, 5400))


@dataclass
class FakeWorker:
    """A bundled worker of the given role (None: one from before roles, which announces none)."""

    id: str
    role: str | None
    # The prompt blocks its KV cache holds, as its snapshot reports them.
    cached: list[int] = field(default_factory=list)
    # The headers its answers carry (a decode worker's transfer report), and their status.
    answer_headers: dict[str, str] = field(default_factory=dict)
    status: int = 200
    # Sequences it reports running.
    running: int = 0
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    server: ServerThread | None = None
    url: str = ""

    def start(self) -> FakeWorker:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/load", self._load)
        app.router.add_get("/kv/snapshot", self._snapshot)
        app.router.add_get("/kv/events", self._events)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
            app.router.add_post(path, self._serve)
        self.server = ServerThread(app)
        self.url = self.server.start()
        return self

    async def _health(self, request: web.Request) -> web.Response:
        health = {
            "status": "ok",
            "worker_id": self.id,
            "model": MODEL,
            "incarnation": f"{self.id}-1",
            "block_size": BLOCK,
            "num_blocks": 1024,
            "max_context_len": 4096,
            "max_waiting": 256,
        }
        if self.role is not None:
            health["role"] = self.role
        return web.json_response(health)

    async def _load(self, request: web.Request) -> web.Response:
        load = {"running": self.running, "waiting": 0, "queued_prefill_tokens": 0, "kv_blocks_used": 0}
        return web.json_response(load | {"kv_blocks_total": 1024})

    async def _snapshot(self, request: web.Request) -> web.Response:
        return web.json_response({"hashes": self.cached, "incarnation": f"{self.id}-1", "seq": 0})

    async def _events(self, request: web.Request) -> web.Response:
        await asyncio.sleep(min(float(request.query.get("timeout", 1)), 1.0))
        return web.json_response({"batches": [], "seq": 0})

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body))
        if self.status != 200:
            error = {"error": {"message": f"{self.id} is full", "type": "overloaded"}}
            return web.json_response(error, status=self.status, headers={"Retry-After": "1"})
        if request.path == "/v1/embeddings":
            data = [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}]
            return web.json_response({"object": "list", "data": data, "model": MODEL})
        if body.get("stream") is not True:
            answer = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1,
                "model": MODEL,
                "choices": [{"index": 0, "text": f"from {self.id}", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 400, "completion_tokens": 2, "total_tokens": 402},
            }
            return web.json_response(answer, headers=self.answer_headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **self.answer_headers})
        await response.prepare(request)
        chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}
        choice = {"index": 0, "text": f"from {self.id}", "finish_reason": None}
        await response.write(b"data: " + json.dumps({**chunk, "choices": [choice]}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def bodies(self, path: str = "/v1/completions") -> list[dict[str, Any]]:
        return [body for got, body in self.received if got == path]


@pytest.fixture
def workers() -> Iterator[Callable[..., FakeWorker]]:
    started: list[FakeWorker] = []

    def start(worker_id: str, role: str | None, **fields: Any) -> FakeWorker:
        worker = FakeWorker(worker_id, role, **fields).start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        assert worker.server is not None
        worker.server.stop()


def gateway_for(
    start_gateway: Callable[..., RunningGateway], *fleet: FakeWorker, **config: Any
) -> RunningGateway:
    gateway = start_gateway([w.url for w in fleet], models={MODEL: {"tokenizer": "default"}}, **config)
    # Routing on what the workers cache: wait until every snapshot is in the index.
    deadline = time.monotonic() + 10
    for worker in fleet:
        while gateway.state.index.blocks_of(worker.id) < len(worker.cached):
            assert time.monotonic() < deadline, f"{worker.id}'s snapshot never reached the index"
            time.sleep(0.02)
    return gateway


def complete(gateway: RunningGateway, prompt: list[int], stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": stream, "seed": 3}
    return httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)


def metric(gateway: RunningGateway, name: str, **labels: str) -> float:
    return gateway.state.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_worker_is_told_its_prefill_worker_beside_the_token_ids(
    workers: Callable[..., FakeWorker], start_gateway: Callable[..., RunningGateway], stream: bool
) -> None:
    prefill = workers("p", "prefill")
    decode = workers("d", "decode", answer_headers={"x-prefixgate-transferred-tokens": "384"})
    gateway = gateway_for(start_gateway, prefill, decode, routing={"pd": {"min_transfer_tokens": 0}})
    messages = [{"role": "user", "content": "Tell me about prefill and decode."}]
    sent = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream, "top_k": 4}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=sent, timeout=30)
    assert response.status_code == 200 and "from d" in response.text
    (received,) = decode.bodies("/v1/chat/completions")
    ids = received.pop("prefixgate_token_ids")
    assert isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)
    assert prefill_of(received) == prefill.url
    assert {k: v for k, v in received.items() if k != "prefixgate_prefill"} == sent
    assert prefill.received == [], "the decode worker asks its prefill worker, not the gateway"
    assert response.headers["x-prefixgate-replica"] == "d"
    assert response.headers["x-prefixgate-prefill-replica"] == "p"
    assert response.headers["x-prefixgate-transferred-tokens"] == "384"
    assert response.headers["x-prefixgate-policy"] == "pd"
    pair = {"model": MODEL, "prefill": "p", "decode": "d"}
    assert metric(gateway, "prefixgate_gateway_pd_requests_total", **pair) == 1
    assert metric(gateway, "prefixgate_gateway_pd_transferred_tokens_total", **pair) == 384
    assert not gateway.state.replicas.get("p").inflight, "the prefill worker's part is over"


def test_a_prompt_a_decode_worker_holds_goes_there_without_a_prefill_worker(
    workers: Callable[..., FakeWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    prefill = workers("p", "prefill")
    holder = workers("holder", "decode", cached=block_hashes(PROMPT, BLOCK, MODEL))
    other = workers("other", "decode")
    gateway = gateway_for(start_gateway, prefill, holder, other)
    response = complete(gateway, PROMPT)
    assert response.headers["x-prefixgate-replica"] == "holder"
    assert "x-prefixgate-prefill-replica" not in response.headers
    assert holder.bodies() == [
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": False, "seed": 3}
    ]
    # A prompt no decode worker holds (400 tokens, above min_transfer_tokens) goes with the prefill worker.
    response = complete(gateway, OTHER)
    assert response.headers["x-prefixgate-prefill-replica"] == "p"
    served = holder if response.headers["x-prefixgate-replica"] == "holder" else other
    assert prefill_of(served.bodies()[-1]) == prefill.url


def test_a_failed_prefill_worker_is_marked_and_counted_and_the_request_served(
    workers: Callable[..., FakeWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    prefill = workers("p", "prefill")
    decode = workers("d", "decode", answer_headers={"x-prefixgate-prefill-error": "connection refused"})
    # Health checks far apart: the failure mark stays for the test to see.
    gateway = gateway_for(start_gateway, prefill, decode, health={"interval_s": 60, "failures": 3})
    response = complete(gateway, PROMPT, stream=True)
    assert response.status_code == 200 and "from d" in response.text
    assert response.headers["x-prefixgate-prefill-error"] == "connection refused"
    assert gateway.state.replicas.get("p").failures == 1
    assert metric(gateway, "prefixgate_gateway_pd_fallbacks_total", model=MODEL, prefill="p") == 1


def test_a_prefill_pool_alone_answers_no_client(
    workers: Callable[..., FakeWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    prefill = workers("p", "prefill")
    gateway = gateway_for(start_gateway, prefill)
    response = complete(gateway, PROMPT)
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert "no decode replica" in message and "(p)" in message
    embeddings = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=30)
    assert embeddings.status_code == 503
    assert prefill.received == []
    health = httpx.get(f"{gateway.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["replicas"]["routable"] == 0


def test_other_routes_go_to_decode_and_mixed_workers_by_load(
    workers: Callable[..., FakeWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    prefill = workers("p", "prefill")
    decode = workers("d", "decode")
    gateway = gateway_for(start_gateway, prefill, decode)
    for _ in range(4):
        sent = {"model": MODEL, "input": "hello"}
        assert httpx.post(f"{gateway.url}/v1/embeddings", json=sent, timeout=30).status_code == 200
    assert len(decode.bodies("/v1/embeddings")) == 4 and prefill.received == []


def test_a_worker_from_before_roles_is_mixed_and_answers_unpaired(
    workers: Callable[..., FakeWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    prefill = workers("p", "prefill")
    old = workers("old", None)
    gateway = gateway_for(start_gateway, prefill, old)
    assert gateway.state.replicas.get("old").role == "mixed"
    response = complete(gateway, PROMPT)
    assert response.headers["x-prefixgate-replica"] == "old"
    assert "prefixgate_prefill" not in old.bodies()[0] and prefill.received == []


def test_the_role_a_worker_announces_wins_over_the_config_and_the_log_says_so(
    workers: Callable[..., FakeWorker],
    start_gateway: Callable[..., RunningGateway],
    caplog: pytest.LogCaptureFixture,
) -> None:
    decode = workers("d", "decode")
    caplog.set_level(logging.ERROR, logger="prefixgate.gateway")
    gateway = start_gateway(
        [],
        wait_for=1,
        replicas=[{"url": decode.url, "role": "prefill"}],
        models={MODEL: {"tokenizer": "default"}},
    )
    assert gateway.state.replicas.get("d").role == "decode"
    assert any(
        "config says role prefill but the worker announces decode" in r.getMessage() for r in caplog.records
    )


def test_a_decode_worker_that_refuses_is_retried_on_the_next_pair(
    workers: Callable[..., FakeWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    holder = workers("p1", "prefill", cached=block_hashes(PROMPT, BLOCK, MODEL))
    other = workers("p2", "prefill")
    full = workers("full", "decode", status=503)
    busy = workers("busy", "decode", running=5)
    gateway = gateway_for(start_gateway, holder, other, full, busy)
    deadline = time.monotonic() + 10
    while gateway.state.replicas.get("busy").load()[0] != 5:
        assert time.monotonic() < deadline, "the busy worker's load never arrived"
        time.sleep(0.02)
    response = complete(gateway, PROMPT)
    assert response.status_code == 200 and response.headers["x-prefixgate-replica"] == "busy"
    # The first pair was the idle decode worker with the prefill worker holding the prompt; the
    # retry, the next decode worker with the next prefill worker.
    assert prefill_of(full.bodies()[0]) == holder.url
    assert prefill_of(busy.bodies()[0]) == other.url
    assert response.headers["x-prefixgate-prefill-replica"] == "p2"
    assert metric(gateway, "prefixgate_gateway_retries_total", model=MODEL, reason="http_503") == 1
    assert not any(gateway.state.replicas.get(rid).inflight for rid in ("p1", "p2", "full", "busy"))
