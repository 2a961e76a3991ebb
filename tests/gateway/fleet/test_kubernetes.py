"""Replicas from Kubernetes, end to end: a real gateway follows an in-process API server speaking the real
wire format (tests/support/kube_apiserver.py), and routes real requests to pods served over loopback
(each pod on an address of its own, 127.0.0.N, all on the pool's one target port)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from bench.probes import wait_for
from tests.support.gateways import SIM_MODEL, RunningGateway
from tests.support.kube_apiserver import KubeApiServer, pod, pool
from tests.support.servers import ServerThread, free_port

pytestmark = pytest.mark.fleet

POOL = "llm"
PODS = "pods"


class PodBackends:
    """Foreign OpenAI servers standing in for pods: one per loopback address, all on one port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.hits: Counter[str] = Counter()
        self._servers: list[ServerThread] = []

    def start(self, ip: str) -> None:
        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": SIM_MODEL, "object": "model"}]})

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="")

        async def completions(request: web.Request) -> web.Response:
            self.hits[ip] += 1
            usage = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
            choice = {"index": 0, "text": ip, "finish_reason": "length", "logprobs": None}
            body = {
                "id": "c",
                "object": "text_completion",
                "created": 1,
                "model": SIM_MODEL,
                "choices": [choice],
            }
            return web.json_response({**body, "usage": usage})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        server = ServerThread(app, port=self.port, host=ip)
        self._servers.append(server)
        server.start()

    def stop(self) -> None:
        for server in self._servers:
            server.stop()


@pytest.fixture
def kube() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def backends() -> Iterator[PodBackends]:
    running = PodBackends()
    for n in range(2, 6):
        running.start(f"127.0.0.{n}")
    yield running
    running.stop()


@pytest.fixture
def pool_gateway(
    kube: KubeApiServer, backends: PodBackends, start_gateway: Callable[..., RunningGateway]
) -> Callable[[int], RunningGateway]:
    def start(routable: int) -> RunningGateway:
        """A gateway following pool `llm`, once it routes to `routable` pods."""
        kube.apply("inferencepools", pool(POOL, "one", backends.port))
        section = {"api_server": kube.url, "inference_pool": POOL, "model": SIM_MODEL}
        return start_gateway([], wait_for=routable, kubernetes=section)

    return start


def replicas(gateway: RunningGateway) -> set[str]:
    return {r.id for r in gateway.state.replicas.all() if r.source == "kubernetes"}


def wait_replicas(gateway: RunningGateway, expected: set[str]) -> None:
    wait_for(lambda: replicas(gateway) == expected, f"the replicas to be {sorted(expected)}", timeout=15)


def route(gateway: RunningGateway) -> str:
    body = {"model": SIM_MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.headers["x-prefixgate-replica"]


def lists_of(kube: KubeApiServer, plural: str) -> int:
    return sum(1 for path, query in kube.requests if path.endswith(plural) and "watch" not in query)


def test_ready_pods_get_traffic_until_not_ready_or_deleted(
    kube: KubeApiServer, backends: PodBackends, pool_gateway: Callable[[int], RunningGateway]
) -> None:
    kube.apply(PODS, pod("a", "127.0.0.2"))
    kube.apply(PODS, pod("b", "127.0.0.3", ready=False))
    gateway = pool_gateway(1)
    wait_replicas(gateway, {"a"})
    assert gateway.state.replicas.get("a").url == f"http://127.0.0.2:{backends.port}"
    assert {route(gateway) for _ in range(4)} == {"a"}
    kube.apply(PODS, pod("b", "127.0.0.3"))
    wait_replicas(gateway, {"a", "b"})
    kube.apply(PODS, pod("a", "127.0.0.2", ready=False))
    wait_replicas(gateway, {"b"})
    before = backends.hits["127.0.0.2"]
    assert {route(gateway) for _ in range(6)} == {"b"}
    assert backends.hits["127.0.0.2"] == before
    kube.delete(PODS, "b")
    wait_replicas(gateway, set())
    assert gateway.gw.pending == {}


def test_a_broken_watch_resumes_from_its_version(
    kube: KubeApiServer, pool_gateway: Callable[[int], RunningGateway]
) -> None:
    kube.apply(PODS, pod("a", "127.0.0.2"))
    kube.apply(PODS, pod("b", "127.0.0.3"))
    gateway = pool_gateway(2)
    wait_replicas(gateway, {"a", "b"})
    kept = gateway.state.replicas.get("a")
    seen = kube.version
    lists = lists_of(kube, PODS)
    kube.cut_watches(hold=True)
    kube.apply(PODS, pod("c", "127.0.0.4"))
    kube.delete(PODS, "b")
    kube.release()
    wait_replicas(gateway, {"a", "c"})
    resumed = [q for path, q in kube.requests if path.endswith(PODS) and q.get("watch") == "true"]
    assert resumed[-1]["resourceVersion"] == str(seen)
    # Resumed, not relisted: the replica that stayed is the same object, never re-added.
    assert lists_of(kube, PODS) == lists
    assert gateway.state.replicas.get("a") is kept


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
def test_410_gone_relists_and_reconciles(
    kube: KubeApiServer, pool_gateway: Callable[[int], RunningGateway], gone_as_http: bool
) -> None:
    kube.gone_as_http = gone_as_http
    kube.apply(PODS, pod("a", "127.0.0.2"))
    kube.apply(PODS, pod("b", "127.0.0.3"))
    gateway = pool_gateway(2)
    wait_replicas(gateway, {"a", "b"})
    kept = gateway.state.replicas.get("a")
    lists = lists_of(kube, PODS)
    kube.cut_watches(hold=True)
    kube.apply(PODS, pod("c", "127.0.0.4"))
    kube.delete(PODS, "b")
    kube.expire_history()
    kube.release()
    wait_replicas(gateway, {"a", "c"})
    assert lists_of(kube, PODS) == lists + 1
    assert gateway.state.replicas.get("a") is kept
    assert {route(gateway) for _ in range(8)} <= {"a", "c"}


def test_bad_annotations_are_skipped_and_counted(
    kube: KubeApiServer, backends: PodBackends, pool_gateway: Callable[[int], RunningGateway]
) -> None:
    kube.apply(PODS, pod("bad-size", "127.0.0.2", **{"prefixgate.io/block-size": "0"}))
    kube.apply(PODS, pod("bad-kind", "127.0.0.3", **{"prefixgate.io/kind": "mainframe"}))
    kube.apply(PODS, pod("bad-events", "127.0.0.4", **{"prefixgate.io/kv-events": "nonsense"}))
    kube.apply(PODS, pod("good", "127.0.0.5", **{"prefixgate.io/block-size": "32"}))
    gateway = pool_gateway(1)
    wait_replicas(gateway, {"good"})
    assert gateway.state.replicas.get("good").block_size == 32
    assert gateway.state.metrics.rejections.counts["kubernetes"] >= 3
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert 'prefixgate_gateway_rejected_entries_total{source="kubernetes"}' in metrics


def test_a_pool_whose_selector_changes_moves_the_replica_set(
    kube: KubeApiServer, backends: PodBackends, pool_gateway: Callable[[int], RunningGateway]
) -> None:
    kube.apply(PODS, pod("a", "127.0.0.2", app="one"))
    kube.apply(PODS, pod("b", "127.0.0.3", app="two"))
    gateway = pool_gateway(1)
    wait_replicas(gateway, {"a"})
    kube.apply("inferencepools", pool(POOL, "two", backends.port))
    wait_replicas(gateway, {"b"})
    assert route(gateway) == "b"
    kube.delete("inferencepools", POOL)
    wait_replicas(gateway, set())


def test_a_service_follows_its_endpointslices(
    kube: KubeApiServer, backends: PodBackends, start_gateway: Callable[..., RunningGateway]
) -> None:
    def endpoints(ready_b: bool) -> dict[str, Any]:
        return {
            "metadata": {"name": "llm-abc", "labels": {"kubernetes.io/service-name": "llm"}},
            "addressType": "IPv4",
            "endpoints": [
                {
                    "addresses": ["127.0.0.2"],
                    "conditions": {"ready": True},
                    "targetRef": {"kind": "Pod", "name": "a"},
                },
                {
                    "addresses": ["127.0.0.3"],
                    "conditions": {"ready": ready_b},
                    "targetRef": {"kind": "Pod", "name": "b"},
                },
            ],
            "ports": [{"name": "http", "port": backends.port, "protocol": "TCP"}],
        }

    kube.apply("endpointslices", endpoints(ready_b=True))
    section = {"api_server": kube.url, "service": "llm", "model": SIM_MODEL}
    gateway = start_gateway([], wait_for=2, kubernetes=section)
    wait_replicas(gateway, {"a", "b"})
    kube.apply("endpointslices", endpoints(ready_b=False))
    wait_replicas(gateway, {"a"})
    kube.delete("endpointslices", "llm-abc")
    wait_replicas(gateway, set())
