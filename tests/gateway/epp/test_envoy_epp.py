"""Client → the real Envoy → the replica prefixgate picked, with prefixgate as Envoy's endpoint picker
(ext_proc), on the Envoy config operators deploy (deploy/envoy/envoy.yaml, its addresses changed)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable

import grpc
import httpx
import openai
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.probes import wait_for
from gateway.epp.health import PICKER_SERVICE
from tests.support.gateways import SIM_MODEL, WORD_WORKER, RecordingBackend, SimWorker, foreign_entries
from tests.support.servers import ServerThread

SYSTEM = "You answer questions about the inventory of a hardware store, briefly and exactly. " * 12


def _chat(url: str, question: str, system: str = SYSTEM) -> tuple[str, int]:
    """(the worker that answered, cached tokens) of one chat through `url` with the official client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model=SIM_MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
    )
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return raw.headers["x-prefixgate-worker"], answer.usage.prompt_tokens_details.cached_tokens or 0


def test_requests_sharing_a_prefix_land_on_the_replica_holding_it(
    start_sim_worker: Callable[..., SimWorker], start_gateway, start_envoy
) -> None:
    workers = [start_sim_worker(f"w{i}", *WORD_WORKER) for i in range(2)]
    picker = start_gateway([], picker=True, wait_for=2, replicas=foreign_entries(workers))
    envoy = start_envoy(picker.grpc_port, [w.port for w in workers])

    first, _ = _chat(envoy, "How many boxes of screws are left?")
    for k in range(4):
        served, cached = _chat(envoy, f"And how many hammers in aisle {k}?")
        assert served == first, "a request sharing the system prompt goes where it is cached"
        assert cached > 0, "the replica reused the prefix it held"
    other_system = "You plan train journeys across the country, with connections and fares. " * 12
    served_other = {_chat(envoy, f"Route {k}?", system=other_system)[0] for k in range(3)}
    assert len(served_other) == 1, "the second prefix also stays where it went first"

    state = picker.state
    wait_for(lambda: state.inflight == 0, "the picker to close every exchange")
    assert all(not r.inflight for r in state.replicas.all()), "no request left counted in a queue"
    learned = {r.id: r.rate_samples for r in state.replicas.all()}
    assert learned[first] > 0, "first-token times came back through the picker and were learned from"
    metrics = httpx.get(f"{picker.url}/metrics").text
    counted = [line for line in metrics.splitlines() if line.startswith("prefixgate_gateway_requests_total{")]
    assert any(f'replica="{first}"' in line and 'status="200"' in line for line in counted), counted


def test_a_killed_first_choice_falls_through_to_the_next_endpoint(
    start_sim_worker: Callable[..., SimWorker], start_gateway, start_envoy
) -> None:
    workers = [start_sim_worker(f"w{i}", *WORD_WORKER) for i in range(2)]
    # Health checks far apart: the picker still believes the killed worker is there.
    slow = {"interval_s": 60, "load_interval_s": 60}
    picker = start_gateway([], picker=True, wait_for=2, replicas=foreign_entries(workers), health=slow)
    envoy = start_envoy(picker.grpc_port, [w.port for w in workers])
    holder, _ = _chat(envoy, "Which drills are on sale?")
    dead = next(w for w in workers if w.id == holder)
    dead.server.stop()
    assert picker.state.replicas.get(holder).healthy, "the picker has not noticed"

    served, _ = _chat(envoy, "And which saws?")
    assert served != holder, "Envoy retried on the picker's next endpoint"
    wait_for(lambda: picker.state.inflight == 0, "the exchange to close")
    alive = picker.state.replicas.get(served)
    assert alive is not None and alive.rate_samples > 0, "the picker learned where the request was served"


class PacedBackend:
    """A foreign OpenAI-compatible server that records the bodies it receives and streams its answer
    in events `gap_s` apart, naming itself."""

    def __init__(self, name: str, gap_s: float = 0.3, events: int = 4) -> None:
        self.name, self.gap_s, self.events = name, gap_s, events
        self.bodies: list[bytes] = []
        app = web.Application(client_max_size=1 << 24)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.server = ServerThread(app)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "paced-m", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "x-prefixgate-worker": self.name}
        )
        await response.prepare(request)
        for k in range(self.events):
            delta = {"index": 0, "delta": {"content": f"part{k} "}, "finish_reason": None}
            chunk = {"id": "c", "object": "chat.completion.chunk", "model": "paced-m", "choices": [delta]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(self.gap_s)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def test_a_large_streamed_body_arrives_intact_and_the_answer_streams_event_by_event(
    start_gateway, start_envoy
) -> None:
    backend = PacedBackend("paced")
    url = backend.server.start()
    try:
        picker = start_gateway([url], picker=True, models={"paced-m": {"tokenizer": "default"}})
        envoy = start_envoy(picker.grpc_port, [backend.server.port])
        content = " ".join(f"item{k % 997}" for k in range(30_000))
        body = json.dumps(
            {"model": "paced-m", "stream": True, "messages": [{"role": "user", "content": content}]}
        ).encode()
        assert len(body) > 200_000
        arrivals: list[float] = []
        with httpx.stream(
            "POST", f"{envoy}/v1/chat/completions", content=body,
            headers={"content-type": "application/json"}, timeout=30,
        ) as response:  # fmt: skip
            assert response.status_code == 200
            assert response.headers["x-prefixgate-worker"] == "paced"
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
        assert backend.bodies == [body], "the replica got the client's body byte for byte"
        assert len(arrivals) == backend.events
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert min(gaps) > backend.gap_s / 2, f"events arrived as they were sent, not at the end: {gaps}"
    finally:
        backend.server.stop()


def test_no_ready_replica_is_a_503_from_the_picker_and_readiness_says_so(
    start_sim_worker: Callable[..., SimWorker], start_gateway, start_envoy
) -> None:
    worker = start_sim_worker("w0", *WORD_WORKER)
    picker = start_gateway([], picker=True, wait_for=1, replicas=foreign_entries([worker]))
    envoy = start_envoy(picker.grpc_port, [worker.port])
    with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def check(service: str) -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

        assert check("readiness") == check(PICKER_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        worker.server.stop()
        wait_for(lambda: not picker.state.replicas.get("w0").routable, "the picker to see the worker gone")
        assert check("") == health_pb2.HealthCheckResponse.SERVING, "alive, whatever the replicas"
        assert check("readiness") == check(PICKER_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            check("something-else")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    answer = httpx.post(
        f"{envoy}/v1/chat/completions",
        json={"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "no_replica_available"
    assert answer.headers["retry-after"] == "1"


def test_a_responses_answer_is_remembered_with_its_replica_and_continued_there(
    recording_backend: Callable[..., tuple[RecordingBackend, str]], start_gateway, start_envoy
) -> None:
    backends = [recording_backend(f"b{i}", model="resp-m") for i in range(2)]
    entries = [{"url": url, "id": backend.name, "kind": "openai"} for backend, url in backends]
    picker = start_gateway(
        [], picker=True, wait_for=2, replicas=entries, models={"resp-m": {"tokenizer": "default"}}
    )
    envoy = start_envoy(picker.grpc_port, [backend.server.port for backend, _ in backends])
    for k in range(3):
        created = httpx.post(
            f"{envoy}/v1/responses", json={"model": "resp-m", "input": f"Question {k}?"}, timeout=10
        )
        assert created.status_code == 200, created.text
        response_id = created.json()["id"]
        owner = next(b.name for b, _ in backends if response_id in b.responses)
        remembered = asyncio.run_coroutine_threadsafe(
            picker.state.response_owners.owner(response_id), picker.server.loop
        ).result(5)
        assert remembered == owner
        follow = {"model": "resp-m", "input": "And then?", "previous_response_id": response_id}
        answer = httpx.post(f"{envoy}/v1/responses", json=follow, timeout=10)
        assert answer.status_code == 200, (
            f"the follow-up went to the replica without {response_id}: {answer.text}"
        )
