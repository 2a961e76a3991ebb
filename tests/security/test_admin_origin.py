"""A tokenless admin API on a loopback listener (the example config, `prefixgate up`) cannot be driven by a
web page the operator visits: cross-origin requests, a Host that DNS rebinding points at 127.0.0.1, and
the non-JSON bodies a page may send without asking first are refused, and no replica is added."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

import httpx
import pytest

from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker, assert_openai_error

ADMIN_ENV = "TEST_PG_SECURITY_ADMIN"


@pytest.fixture
def workers(start_sim_worker: Callable[..., SimWorker]) -> list[SimWorker]:
    # w0 serves; "evil" is the replica a hostile page would have the gateway send users' prompts to.
    return [start_sim_worker("w0"), start_sim_worker("evil")]


@pytest.fixture
def tokenless(workers: list[SimWorker], start_gateway: Callable[..., RunningGateway]) -> RunningGateway:
    return start_gateway([workers[0].url], model=SIM_MODEL)


def _port(gateway: RunningGateway) -> int:
    return int(gateway.url.rsplit(":", 1)[1])


def _refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    assert_openai_error(status, response.content, "admin")
    assert response.json()["error"]["code"] == code, response.text


def _nothing_added(gateway: RunningGateway) -> None:
    listed = gateway.admin("GET", "/admin/replicas").json()
    assert [r["id"] for r in listed["replicas"]] == ["w0"] and listed["pending"] == []


def test_a_cross_site_form_post_adds_no_replica(tokenless: RunningGateway, workers: list[SimWorker]) -> None:
    """What a hostile page's fetch(..., {mode: "no-cors", body}) sends: text/plain, its own Origin."""
    body = json.dumps({"url": workers[1].url})
    for headers, status, code in (
        ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 403, "cross_origin"),
        ({"Content-Type": "text/plain", "Origin": "null"}, 403, "cross_origin"),
        ({"Content-Type": "application/json", "Origin": "http://evil.example"}, 403, "cross_origin"),
        ({"Content-Type": "text/plain", "Sec-Fetch-Site": "cross-site"}, 403, "cross_origin"),
        # A page on another port of this host is same-site, and still another origin.
        ({"Content-Type": "application/json", "Sec-Fetch-Site": "same-site"}, 403, "cross_origin"),
        # The same origin, still not JSON: the browser would not have asked first.
        ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "unsupported_media_type"),
        ({}, 415, "unsupported_media_type"),
    ):
        response = httpx.post(f"{tokenless.url}/admin/replicas", content=body, headers=headers, timeout=10)
        _refused(response, status, code)
        _nothing_added(tokenless)
    # Drains too: a form POST with no body at all.
    drained = httpx.post(
        f"{tokenless.url}/admin/replicas/w0/drain", headers={"Content-Type": "text/plain"}, timeout=10
    )
    _refused(drained, 415, "unsupported_media_type")
    assert not tokenless.state.replicas.get("w0").draining


def test_dns_rebinding_is_refused(tokenless: RunningGateway, workers: list[SimWorker]) -> None:
    """A page served from evil.example, whose name now resolves to 127.0.0.1: to the browser the
    request is same-origin (Origin and Host agree), and the Host is what gives it away."""
    port = _port(tokenless)
    for host in (
        f"evil.example:{port}",
        "evil.example",
        f"127.0.0.1:{port + 1}",
        f"localhost.evil:{port}",
        "",
    ):
        headers = {"Host": host, "Origin": f"http://{host}", "Content-Type": "application/json"}
        added = httpx.post(
            f"{tokenless.url}/admin/replicas", json={"url": workers[1].url}, headers=headers, timeout=10
        )
        _refused(added, 403, "admin_host_refused")
        listed = httpx.get(f"{tokenless.url}/admin/replicas", headers={"Host": host}, timeout=10)
        _refused(listed, 403, "admin_host_refused")
        explained = httpx.get(f"{tokenless.url}/debug/route", params={"prompt": "x"}, headers={"Host": host})
        _refused(explained, 403, "admin_host_refused")
    _nothing_added(tokenless)
    # An absolute-form target names its own host: refused as well, over a raw socket.
    request = (
        f"GET http://evil.example:{port}/admin/replicas HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 403 "), reply[:200]
    assert b"admin_host_refused" in reply


def test_the_operator_still_administers(tokenless: RunningGateway, workers: list[SimWorker]) -> None:
    """curl, the CLI or a same-origin page: loopback names and addresses, this port, JSON."""
    port = _port(tokenless)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
        listed = httpx.get(f"{tokenless.url}/admin/replicas", headers={"Host": host}, timeout=10)
        assert listed.status_code == 200, listed.text
    same_origin = {
        "Origin": f"http://localhost:{port}",
        "Host": f"localhost:{port}",
        "Sec-Fetch-Site": "same-origin",
    }
    drained = httpx.post(f"{tokenless.url}/admin/replicas/w0/drain", headers=same_origin, timeout=10)
    assert drained.status_code == 200 and drained.json()["draining"] is True
    undrained = tokenless.admin("POST", "/admin/replicas/w0/undrain")
    assert undrained.status_code == 200 and undrained.json()["draining"] is False
    added = httpx.post(
        f"{tokenless.url}/admin/replicas",
        content=json.dumps({"url": workers[1].url}),
        headers={"Content-Type": "application/json; charset=utf-8"},
        timeout=10,
    )
    assert added.status_code in (201, 202), added.text
    tokenless.wait_routable(2)
    # The API routes are not the admin API's: a page may call them as any client may.
    chat = httpx.post(
        f"{tokenless.url}/v1/chat/completions",
        json={"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Origin": "http://elsewhere.example", "Host": "api.example"},
        timeout=10,
    )
    assert chat.status_code == 200, chat.text


def test_with_a_token_any_host_but_still_same_origin_and_json(
    workers: list[SimWorker], start_gateway: Callable[..., RunningGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a proxy, the Host is the proxy's name: with a token it is not checked. Origin and the
    content type still are (a page cannot send the token, and needs none of it to be refused)."""
    monkeypatch.setenv(ADMIN_ENV, "root-token")
    gateway = start_gateway([workers[0].url], model=SIM_MODEL, auth={"admin_token_env": ADMIN_ENV})
    auth = {"Authorization": "Bearer root-token"}
    behind = httpx.get(
        f"{gateway.url}/admin/replicas", headers={**auth, "Host": "gateway.internal:443"}, timeout=10
    )
    assert behind.status_code == 200, behind.text
    cross = httpx.post(
        f"{gateway.url}/admin/replicas",
        json={"url": workers[1].url},
        headers={**auth, "Origin": "http://evil.example"},
        timeout=10,
    )
    _refused(cross, 403, "cross_origin")
    plain = httpx.post(
        f"{gateway.url}/admin/replicas",
        content=json.dumps({"url": workers[1].url}),
        headers={**auth, "Content-Type": "text/plain"},
        timeout=10,
    )
    _refused(plain, 415, "unsupported_media_type")
    untokened = httpx.get(f"{gateway.url}/admin/replicas", timeout=10)
    _refused(untokened, 401, "invalid_admin_token")
    assert [r.id for r in gateway.state.replicas.all()] == ["w0"]
