"""Headers at the edges, either way: a client's or a replica's header of any bytes is no 500, the request
goes upstream in origin form with its hop-by-hop headers removed (those its Connection header names
included) and the gateway's hop recorded in X-Forwarded-*, and repeated headers (Cookie, Set-Cookie)
arrive each one."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker

FOREIGN = "foreign-m"
MESSAGES = [{"role": "user", "content": "hi"}]
CACHED_TOKENS = b"x-prefixgate-cached-tokens"


@dataclass
class Seen:
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def all(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


@dataclass
class RawReplica:
    """A replica written at the byte level, to say in its headers what no HTTP library would let it:
    a prefixgate worker's /health (`bundled`) or an OpenAI server's, one chat completion for anything
    else, with `extra` header lines after its own. It records each request's target and header lines
    as they arrived."""

    bundled: bool
    model: str
    extra: list[bytes] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        self._thread.start()
        assert self._ready.wait(10)
        return self.url

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *lines = head[:-4].split(b"\r\n")
                headers = [tuple(part.strip() for part in h.split(b":", 1)) for h in lines]
                length = next((int(v) for k, v in headers if k.lower() == b"content-length"), 0)
                body = await reader.readexactly(length)
                writer.write(self._answer(line.split(b" ")[1], headers, body))  # type: ignore[arg-type]
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def _answer(self, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        extra: list[bytes] = []
        if target == b"/health":
            health = {"model": self.model, "incarnation": "i1", "block_size": 16, "num_blocks": 512}
            payload = json.dumps({**health, "max_context_len": 8192, "worker_id": "raw"}).encode()
            payload = payload if self.bundled else b""
        elif target == b"/v1/models":
            payload = json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode()
        elif target == b"/load":
            payload = b'{"running": 0, "waiting": 0}'
        elif target.startswith(b"/kv/"):
            return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
        else:
            self.seen.append(Seen(target, headers, body))
            choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            answer = {"id": "c1", "object": "chat.completion", "created": 0, "model": self.model}
            payload = json.dumps({**answer, "choices": [choice]}).encode()
            extra = self.extra
        head = [b"HTTP/1.1 200 OK", b"Content-Type: application/json", b"Content-Length: %d" % len(payload)]
        return b"\r\n".join(head + extra) + b"\r\n\r\n" + payload


@pytest.fixture
def raw_replica() -> Iterator[Callable[..., RawReplica]]:
    started: list[RawReplica] = []

    def start(bundled: bool, model: str) -> RawReplica:
        replica = RawReplica(bundled, model)
        replica.start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.stop()


def _exchange(gateway: RunningGateway, request: bytes) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
    """One request over a raw socket (it must ask for Connection: close): status line, headers, body."""
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, [tuple(part.strip() for part in h.split(b":", 1)) for h in lines], body  # type: ignore[misc]


def _chat_request(gateway: RunningGateway, target: str, headers: list[str]) -> bytes:
    body = json.dumps({"model": FOREIGN, "messages": MESSAGES}).encode()
    host = gateway.url.removeprefix("http://")
    head = [f"POST {target} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    head += [f"Content-Length: {len(body)}", *headers]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


def test_a_replica_count_header_of_any_bytes_is_no_count(
    raw_replica: Callable[..., RawReplica], start_gateway: Callable[..., RunningGateway]
) -> None:
    """`²` (byte 0xB2, which the gateway reads as Latin-1) passes str.isdigit() and fails int(): the
    bundled worker's cached-tokens header is a count only when it is ASCII digits."""
    replica = raw_replica(True, SIM_MODEL)
    gateway = start_gateway([replica.url], model=SIM_MODEL)
    client = gateway.client()
    for value in (
        b"\xb2",
        "\u00b2".encode(),
        "\u0663".encode(),
        b"\xd9",
        b"1e3",
        b"-1",
        b"9" * 40,
        b"",
        b"7",
    ):
        replica.extra = [CACHED_TOKENS + b": " + value]
        answer = client.chat.completions.with_raw_response.create(model=SIM_MODEL, messages=MESSAGES)
        assert answer.status_code == 200, value
        assert answer.parse().choices[0].message.content == "ok"
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10)
    assert metrics.status_code == 200
    realised = [
        line
        for line in metrics.text.splitlines()
        if line.startswith("prefixgate_gateway_realised_cached_tokens_total") and 'replica="raw"' in line
    ]
    # Only the one count that was one (7) was added up.
    assert realised and all(line.endswith(" 7.0") for line in realised), realised


def test_a_session_key_of_any_bytes_routes(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    workers = [start_sim_worker(f"w{i}") for i in range(3)]
    gateway = start_gateway([w.url for w in workers], model=SIM_MODEL, routing={"policy": "session_affinity"})
    chat = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 2}
    for key in (b"\xff\xfe\x80", b"caf\xe9", b"\xc3\x28", "\u2603".encode()):
        replicas = set()
        for _ in range(3):
            answer = httpx.post(
                f"{gateway.url}/v1/chat/completions", json=chat, headers={"x-session-id": key}, timeout=10
            )
            assert answer.status_code == 200, (key, answer.text)
            replicas.add(answer.headers["x-prefixgate-replica"])
        assert len(replicas) == 1, (key, replicas)  # one session, one replica
        explained = httpx.post(
            f"{gateway.url}/debug/route", json=chat, headers={"x-session-id": key}, timeout=10
        )
        assert explained.status_code == 200 and explained.json()["order"][0] in replicas, explained.text


def test_the_target_goes_upstream_in_origin_form(
    raw_replica: Callable[..., RawReplica], start_gateway: Callable[..., RunningGateway]
) -> None:
    """An absolute-form target (which a proxy in front would take for a virtual host) names no host
    to the replica: it gets the path and query, and its own Host."""
    replica = raw_replica(False, FOREIGN)
    gateway = start_gateway([replica.url])
    for target, upstream in (
        ("http://evil.internal/v1/chat/completions?tenant=b&x=%2F", b"/v1/chat/completions?tenant=b&x=%2F"),
        ("http://evil.internal:8080/v1/chat/completions", b"/v1/chat/completions"),
        ("/v1/chat/completions?q=%20", b"/v1/chat/completions?q=%20"),
    ):
        status, _, body = _exchange(gateway, _chat_request(gateway, target, ["Connection: close"]))
        assert status == b"HTTP/1.1 200 OK", (target, status, body)
        seen = replica.seen[-1]
        assert seen.target == upstream, (target, seen.target)
        assert seen.all(b"host") == [f"127.0.0.1:{replica.port}".encode()]


def test_hop_by_hop_headers_stop_and_repeats_pass_both_ways(
    raw_replica: Callable[..., RawReplica], start_gateway: Callable[..., RunningGateway]
) -> None:
    replica = raw_replica(False, FOREIGN)
    replica.extra = [
        b"Set-Cookie: s1=one; Path=/",
        b"Set-Cookie: s2=two; Path=/",
        b"Connection: keep-alive, X-Upstream-Hop",
        b"X-Upstream-Hop: replica-private",
        b"Proxy-Authenticate: Basic",
        b"X-Prefixgate-Replica: forged",
        b"X-Vendor: kept",
    ]
    gateway = start_gateway([replica.url])
    client_headers = [
        "Connection: close, X-Hop-Secret",
        "X-Hop-Secret: client-private",
        "Keep-Alive: timeout=5",
        "TE: trailers",
        "Upgrade: h2c",
        "Cookie: a=1",
        "Cookie: b=2",
        "X-Forwarded-For: 203.0.113.7",
        "X-Forwarded-Proto: https",
        "X-Forwarded-Host: spoofed.example",
        "Forwarded: for=198.51.100.1",
        "X-Custom: as-sent",
        "X-Prefixgate-Stream-Token-Ids: 1",
        "X-Prefixgate-Cached-Tokens: 9",
    ]
    status, headers, _ = _exchange(gateway, _chat_request(gateway, "/v1/chat/completions", client_headers))
    assert status == b"HTTP/1.1 200 OK"
    seen = replica.seen[-1]
    for name in (b"x-hop-secret", b"keep-alive", b"te", b"upgrade", b"connection"):
        assert seen.all(name) == [], (name, seen.headers)
    assert seen.all(b"cookie") == [b"a=1", b"b=2"]
    assert seen.all(b"x-forwarded-for") == [b"203.0.113.7, 127.0.0.1"]
    assert seen.all(b"x-forwarded-proto") == [b"http"]
    assert seen.all(b"x-forwarded-host") == [gateway.url.removeprefix("http://").encode()]
    assert seen.all(b"forwarded") == [b"for=198.51.100.1"]
    assert seen.all(b"x-custom") == [b"as-sent"]
    assert not [k for k, _ in seen.headers if k.lower().startswith(b"x-prefixgate-")], seen.headers

    def got(name: bytes) -> list[bytes]:
        return [v for k, v in headers if k.lower() == name]

    assert got(b"set-cookie") == [b"s1=one; Path=/", b"s2=two; Path=/"]
    assert got(b"x-upstream-hop") == [] and got(b"proxy-authenticate") == []
    assert got(b"x-prefixgate-replica") == [f"127.0.0.1:{replica.port}".encode()]
    assert got(b"x-vendor") == [b"kept"]
    # Without a client X-Forwarded-For, the chain starts at the client.
    _exchange(gateway, _chat_request(gateway, "/v1/chat/completions", ["Connection: close"]))
    assert replica.seen[-1].all(b"x-forwarded-for") == [b"127.0.0.1"]
