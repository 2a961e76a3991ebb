"""What a client sends at the gateway's edge cannot break it or stall the others: credentials of any bytes
are a 401, bodies sent slowly hold no in-flight slot, and JSON nested past the bound is a clear 400 on
every route that parses one."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from protocol.openai_api import MAX_JSON_DEPTH
from tests.support.gateways import SIM_MODEL, RecordingBackend, RunningGateway, SimWorker, assert_openai_error

KEYS_ENV, ADMIN_ENV = "TEST_PG_SECURITY_KEYS", "TEST_PG_SECURITY_ADMIN"
KEY, ADMIN = "key-ascii-1", "admin-ascii-1"
CHAT = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _address(gateway: RunningGateway) -> tuple[str, int]:
    host, port = gateway.url.removeprefix("http://").split(":")
    return host, int(port)


# -- credentials ----------------------------------------------------------------------------------

# Authorization values as bytes on the wire: none of them is a key, none may be a 500.
MALFORMED = [
    b"Bearer \xff\xfe",
    b"Bearer key-ascii-1\xe9",
    "Bearer cl\u00e9".encode(),
    "Bearer \u2603\u2603".encode(),
    b"Bearer \x80",
    b"bearer \xc3\x28",
    b"Basic \xff",
    b"\xff\xfe key-ascii-1",
    b"Bearer key-ascii-1 \xff",
]


@pytest.fixture
def keyed(
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
    monkeypatch: pytest.MonkeyPatch,
) -> RunningGateway:
    monkeypatch.setenv(KEYS_ENV, KEY)
    monkeypatch.setenv(ADMIN_ENV, ADMIN)
    worker = start_sim_worker("w0")
    return start_gateway(
        [worker.url], model=SIM_MODEL, auth={"api_keys_env": KEYS_ENV, "admin_token_env": ADMIN_ENV}
    )


def test_a_credential_of_any_bytes_is_a_401(keyed: RunningGateway) -> None:
    for path, method, code in (
        ("/v1/chat/completions", "POST", "invalid_api_key"),
        ("/v1/models", "GET", "invalid_api_key"),
        ("/admin/replicas", "GET", "invalid_admin_token"),
        ("/debug/route?prompt=x", "GET", "invalid_admin_token"),
    ):
        for value in MALFORMED:
            response = httpx.request(
                method, f"{keyed.url}{path}", json=CHAT, headers={"Authorization": value}, timeout=10
            )
            assert response.status_code == 401, (path, value, response.status_code, response.text)
            assert_openai_error(401, response.content, f"{path} {value!r}")
            assert response.json()["error"]["code"] == code
    # The keys still work, through the official client, and the refusals are counted, not crashed on.
    answer = keyed.client(KEY).chat.completions.create(
        model=SIM_MODEL, messages=CHAT["messages"], max_tokens=2
    )
    assert answer.choices[0].message.content is not None
    assert keyed.admin("GET", "/admin/replicas", token=ADMIN).status_code == 200
    metrics = httpx.get(f"{keyed.url}/metrics", timeout=10)
    assert (
        metrics.status_code == 200 and 'status="401"' in metrics.text and 'status="500"' not in metrics.text
    )


# -- slow bodies ----------------------------------------------------------------------------------

MAX_INFLIGHT = 4
BODY_TIMEOUT_S = 3.0
TRICKLERS = 3 * MAX_INFLIGHT


def _trickle(address: tuple[str, int], stop: threading.Event, replies: list[bytes], index: int) -> None:
    """A client that announces a body and sends it a byte at a time, every 0.2 s, until answered: then
    reads the answer to the end of the connection."""
    body = json.dumps(CHAT).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    received = b""
    with socket.create_connection(address, timeout=BODY_TIMEOUT_S + 15) as sock:
        sock.sendall(head)
        sock.settimeout(0.2)
        sent = 0
        while not stop.is_set():
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if sent < len(body) - 1:  # never the whole body
                    sock.sendall(body[sent : sent + 1])
                    sent += 1
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    replies[index] = received


def test_slow_bodies_hold_no_slot_others_need(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    worker = start_sim_worker("w0")
    limits = {"max_inflight": MAX_INFLIGHT, "body_timeout_s": BODY_TIMEOUT_S}
    gateway = start_gateway([worker.url], model=SIM_MODEL, limits=limits)
    address = _address(gateway)
    stop = threading.Event()
    replies: list[bytes] = [b""] * TRICKLERS
    threads = [
        threading.Thread(target=_trickle, args=(address, stop, replies, i), daemon=True)
        for i in range(TRICKLERS)
    ]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)  # every trickler has sent its head, and is sending its body
        client = gateway.client()
        for _ in range(MAX_INFLIGHT + 2):
            answer = client.chat.completions.with_raw_response.create(
                model=SIM_MODEL, messages=CHAT["messages"], max_tokens=2, timeout=BODY_TIMEOUT_S
            )
            assert answer.status_code == 200
            assert answer.parse().choices[0].message.content is not None
        assert time.monotonic() - started < BODY_TIMEOUT_S, "the client waited on the tricklers' budget"
        for thread in threads:
            thread.join(timeout=BODY_TIMEOUT_S + 10)
    finally:
        stop.set()
    # Each trickler got a 408 in OpenAI's shape once its budget ran out, and its connection was closed.
    assert not any(thread.is_alive() for thread in threads), "a trickler's connection stayed open"
    for reply in replies:
        status_line, _, rest = reply.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout", reply[:300]
        assert_openai_error(408, rest.partition(b"\r\n\r\n")[2], "trickled body")
    assert time.monotonic() - started < BODY_TIMEOUT_S + 8
    assert gateway.state.inflight == 0
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert 'status="408"' in metrics and 'status="429"' not in metrics


# -- nesting --------------------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    """A JSON value `depth` levels deep, objects and arrays in turn (built as text: the standard
    library's encoder cannot write 1,000 levels either)."""
    opening = "".join('{"k": ' if level % 2 == 0 else "[" for level in range(depth))
    closing = "".join("}" if level % 2 == 0 else "]" for level in reversed(range(depth)))
    return f'{opening}"x"{closing}'.encode()


def _deep_bodies(depth: int) -> dict[str, bytes]:
    """A body per route that parses JSON, the deep value where a client would put it, whose whole
    nesting is `depth` levels."""
    model = json.dumps(SIM_MODEL).encode()
    return {
        "/v1/chat/completions": b'{"model": %b, "messages": [{"role": "user", "content": %b}]}'
        % (model, _nested(depth - 3)),
        "/v1/completions": b'{"model": %b, "prompt": "hi", "metadata": %b}' % (model, _nested(depth - 1)),
        "/v1/responses": b'{"model": %b, "input": [{"role": "user", "content": %b}]}'
        % (model, _nested(depth - 3)),
        "/v1/embeddings": b'{"model": %b, "input": %b}' % (model, _nested(depth - 1)),
        "/admin/replicas": b'{"url": "http://127.0.0.1:1", "model": %b}' % _nested(depth - 1),
        "/debug/route": b'{"model": %b, "messages": [{"role": "user", "content": %b}]}'
        % (model, _nested(depth - 3)),
    }


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 300, 1_000, 5_000])
def test_json_nested_past_the_bound_is_a_400(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway], depth: int
) -> None:
    """Past orjson's 254 levels a body the gateway re-encodes (token ids attached for a bundled
    worker) was a 500, and near 1,000 the canonical prompt's serialization was: now every route that
    parses JSON refuses it, naming the limit, before anything is forwarded."""
    worker = start_sim_worker("w0")
    gateway = start_gateway([worker.url], model=SIM_MODEL)
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        for path, body in _deep_bodies(depth).items():
            response = client.post(path, content=body, headers={"Content-Type": "application/json"})
            where = f"{path} at depth {depth}"
            assert response.status_code == 400, (where, response.status_code, response.text[:300])
            assert_openai_error(400, response.content, where)
            assert str(MAX_JSON_DEPTH) in response.json()["error"]["message"], response.text
        assert [r.id for r in gateway.state.replicas.all()] == ["w0"]
        assert worker.load()["running"] == 0
        ok = client.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200, ok.text
    assert httpx.get(f"{gateway.url}/metrics", timeout=10).status_code == 200


def test_json_nested_within_the_bound_goes_through(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    """A deep JSON schema (100 levels) is an ordinary request: forwarded byte for byte, through the
    official client, on the chat route and the Responses one."""
    backend, url = recording_backend("b0")
    gateway = start_gateway([url])
    schema = {"type": "json_schema", "json_schema": {"name": "deep", "schema": json.loads(_nested(100))}}
    client = gateway.client()
    client.chat.completions.with_raw_response.create(
        model="foreign-m",
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"response_format": schema},
    )
    client.responses.create(model="foreign-m", input="hi", extra_body={"text": {"format": schema}})
    assert [r.target for r in backend.received] == ["/v1/chat/completions", "/v1/responses"]
    assert json.loads(backend.received[0].body)["response_format"] == schema
    assert json.loads(backend.received[1].body)["text"]["format"] == schema
