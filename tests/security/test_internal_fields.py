"""Internal fields are the gateway's alone (issue 20, item 1): what a client sends of them never goes
upstream, on any route, paired or not. A `prefixgate_*` field other than the public
`prefixgate_token_ids` is refused with a 400 naming it; vLLM's `kv_transfer_params` and SGLang's
bootstrap fields are dropped. Checked through a real gateway against a backend that records what it got,
and against bundled simulated workers, where the finding was a request to any URL the client named with
its answer read back: the capture server the client names receives nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from protocol.disaggregation import TRANSFERRED_TOKENS_HEADER
from protocol.transfer_auth import SECRET_ENV
from tests.support.gateways import SIM_MODEL, RecordingBackend, RunningGateway, SimWorker

MODEL = "foreign-m"
SECRET = "a-test-kv-transfer-secret"
PAIRING = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1},
    "bootstrap_host": "10.9.9.9",
    "bootstrap_port": 8998,
    "bootstrap_room": 7,
}
# One body per route the gateway names, and one it does not: what a client sends there.
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"input": "hi"},
    "/v1/embeddings": {"input": "hi"},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/tokenize": {"prompt": "hi"},
    "/v1/some/vendor/route": {"input": "hi"},
}


@pytest.fixture
def foreign(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> tuple[RecordingBackend, RunningGateway]:
    backend, url = recording_backend("b0", model=MODEL)
    return backend, start_gateway([url], models={MODEL: {"tokenizer": "default"}})


def post(gateway: RunningGateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=30)


def posted(backend: RecordingBackend, path: str) -> list[dict[str, Any]]:
    return [json.loads(r.body) for r in backend.received if r.method == "POST" and r.target == path]


@pytest.mark.parametrize("field", ["prefixgate_prefill", "prefixgate_anything_else"])
@pytest.mark.parametrize("path", list(ROUTES))
def test_a_clients_prefixgate_field_is_refused_on_every_route(
    foreign: tuple[RecordingBackend, RunningGateway], path: str, field: str
) -> None:
    backend, gateway = foreign
    body = {"model": MODEL, **ROUTES[path], field: {"url": "http://127.0.0.1:9/steal"}}
    refused = post(gateway, path, body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and error["code"] == "internal_field" and field in error["message"]
    assert posted(backend, path) == [], "nothing of it went upstream"
    # The next client, on the same route, is served; and the public field is still the client's.
    served = post(gateway, path, {"model": MODEL, **ROUTES[path], "prefixgate_token_ids": [1, 2, 3]})
    assert served.status_code == 200, served.text
    assert posted(backend, path)[-1]["prefixgate_token_ids"] == [1, 2, 3]
    assert httpx.get(f"{gateway.url}/metrics").status_code == 200


def test_the_official_client_is_told_which_field_it_may_not_send(
    foreign: tuple[RecordingBackend, RunningGateway],
) -> None:
    backend, gateway = foreign
    with pytest.raises(openai.BadRequestError) as refused:
        gateway.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"prefixgate_prefill": {"url": "http://127.0.0.1:9"}},
        )
    assert refused.value.param == "prefixgate_prefill" and refused.value.code == "internal_field"
    assert backend.received == [] or all(r.method == "GET" for r in backend.received)


@pytest.mark.parametrize("path", list(ROUTES))
def test_vllm_and_sglang_pairing_fields_are_dropped_on_every_route(
    foreign: tuple[RecordingBackend, RunningGateway], path: str
) -> None:
    backend, gateway = foreign
    body = {"model": MODEL, **ROUTES[path], **PAIRING, "vendor_field": {"kept": True}}
    served = post(gateway, path, body)
    assert served.status_code == 200, served.text
    (got,) = posted(backend, path)
    assert not set(PAIRING) & set(got), f"{sorted(set(PAIRING) & set(got))} reached the backend"
    assert got == {"model": MODEL, **ROUTES[path], "vendor_field": {"kept": True}}


def test_an_unpaired_vllm_decode_replica_gets_no_client_transfer_params(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    """A vLLM decode instance with no prefill instance to pair it with serves alone: a client's
    `kv_transfer_params` would have it pull KV from wherever they say."""
    backend, url = recording_backend("d", model=MODEL)
    replica = {"url": url, "kind": "openai", "model": MODEL, "role": "decode", "pd_protocol": "vllm"}
    gateway = start_gateway([url], replicas=[replica], models={MODEL: {"tokenizer": "default"}})
    path = "/v1/chat/completions"
    served = post(gateway, path, {"model": MODEL, **ROUTES[path], **PAIRING})
    assert served.status_code == 200, served.text
    (got,) = posted(backend, path)
    assert "kv_transfer_params" not in got and "bootstrap_room" not in got


@pytest.fixture
def capture(recording_backend: Callable[..., tuple[RecordingBackend, str]]) -> tuple[RecordingBackend, str]:
    """The server a client would have a decode worker call: it records whatever reaches it."""
    return recording_backend("capture", model="none")


def _completion(prefill_url: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SIM_MODEL, "prompt": list(range(3000, 3041)), "max_tokens": 4, **extra}
    if prefill_url is not None:
        body["prefixgate_prefill"] = {"url": prefill_url}
    return body


@pytest.mark.parametrize("role", ["decode", "mixed"])
def test_no_bundled_worker_calls_the_url_a_client_names(
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
    capture: tuple[RecordingBackend, str],
    role: str,
) -> None:
    """The finding reproduced: an unpaired request to a bundled decode worker, naming a capture server
    as its prefill worker. Through the gateway it is refused; sent to the worker itself (which no client
    should reach, but the port is open), it is refused too, for want of the gateway's signature."""
    recorder, capture_url = capture
    worker = start_sim_worker("w", "--role", role, "--transfer-secret", SECRET)
    gateway = start_gateway([worker.url])
    through = post(gateway, "/v1/completions", _completion(capture_url))
    assert through.status_code == 400 and through.json()["error"]["param"] == "prefixgate_prefill"
    direct = httpx.post(f"{worker.url}/v1/completions", json=_completion(capture_url), timeout=30)
    assert direct.status_code == (403 if role == "decode" else 400), direct.text
    assert "x-prefixgate-prefill-error" not in direct.headers
    assert [r for r in recorder.received if r.target != "/health"] == [], "the capture server got nothing"
    assert worker.load()["kv_blocks_used"] == 0
    served = post(gateway, "/v1/completions", _completion(**PAIRING))
    assert served.status_code == 200, served.text


def test_a_paired_request_carries_the_gateways_grant_and_never_the_clients(
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
    capture: tuple[RecordingBackend, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a prefill worker to pair with, the decode worker pulls from it, as the gateway's signed
    grant says: the pairing works, and a client's own field is refused just the same."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    recorder, capture_url = capture
    prefill = start_sim_worker("p", "--role", "prefill", "--transfer-secret", SECRET)
    decode = start_sim_worker("d", "--role", "decode", "--transfer-secret", SECRET)
    gateway = start_gateway([prefill.url, decode.url], routing={"pd": {"min_transfer_tokens": 0}})
    paired = post(gateway, "/v1/completions", _completion(**PAIRING))
    assert paired.status_code == 200, paired.text
    assert paired.headers["x-prefixgate-prefill-replica"] == "p"
    assert paired.headers[TRANSFERRED_TOKENS_HEADER] == "32"
    refused = post(gateway, "/v1/completions", _completion(capture_url, prompt=list(range(4000, 4041))))
    assert refused.status_code == 400
    assert [r for r in recorder.received if r.target != "/health"] == []
