"""The whole Kubernetes path on loopback: prefixgate as Envoy's endpoint picker, its replicas the pods an
InferencePool selects, read from an API server speaking the real wire format (tests/support/
kube_apiserver.py); each pod a simulated worker on an address of its own (127.0.0.N), all on the
pool's one target port, as pods are."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest

from bench.probes import wait_for
from protocol.loopback_ports import free_port
from tests.support.gateways import SIM_MODEL, WORD_WORKER, SimWorker
from tests.support.kube_apiserver import KubeApiServer, pod, pool

pytestmark = pytest.mark.fleet

SYSTEM = "You keep the timetable of a ferry line and answer in one line, with times. " * 12


@pytest.fixture
def kube() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    server.start()
    yield server
    server.stop()


def _chat(url: str, question: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model=SIM_MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
    )
    raw.parse()
    return raw.headers["x-prefixgate-worker"]


def test_envoy_routes_to_the_pool_pod_the_picker_chooses_and_follows_its_readiness(
    kube: KubeApiServer, start_sim_worker: Callable[..., SimWorker], start_gateway, start_envoy
) -> None:
    port = free_port()
    ips = {"a": "127.0.0.2", "b": "127.0.0.3"}
    for name, ip in ips.items():
        start_sim_worker(name, *WORD_WORKER, port=port, host=ip)
        kube.apply("pods", pod(name, ip, app="llm", **{"prefixgate.io/block-size": "16"}))
    kube.apply("inferencepools", pool("llm-pool", "llm", port))
    section = {"api_server": kube.url, "inference_pool": "llm-pool", "model": SIM_MODEL}
    picker = start_gateway([], picker=True, wait_for=2, kubernetes=section)
    envoy = start_envoy(picker.grpc_port, [f"{ip}:{port}" for ip in ips.values()])

    holder = _chat(envoy, "When is the first boat?")
    assert {_chat(envoy, f"And the boat after {k}?") for k in range(3)} == {holder}, "the prefix's pod"

    kube.apply("pods", pod(holder, ips[holder], ready=False, app="llm"))
    wait_for(
        lambda: picker.state.replicas.get(holder) is None, "the picker to drop the pod that is not ready"
    )
    other = next(name for name in ips if name != holder)
    assert {_chat(envoy, f"And the last boat {k}?") for k in range(3)} == {other}
