"""The forward path's HTTP/1.1 client against real loopback servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.forward.upstream import _HIGH_WATER, UpstreamError, header_count
from gateway.forward.upstream_client import MAX_IDLE_PER_ORIGIN, UpstreamClient, origin_of
from tests.support.servers import free_port

Reply = Callable[["Peer", bytes], Awaitable[None]]
OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


@dataclass
class Peer:
    """One accepted connection of the test server."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def send(self, data: bytes) -> None:
        self.writer.write(data)


@dataclass
class Server:
    """Reads each request (head and Content-Length body) and lets `reply` answer it."""

    reply: Reply
    scheme: str = "http"
    port: int = 0
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        peer = Peer(reader, writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                await self.reply(peer, request)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            writer.close()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"


def serve(
    reply: Reply, test: Callable[[Server, UpstreamClient], Awaitable[None]], tls: ssl.SSLContext | None = None
) -> None:
    async def main() -> None:
        server = Server(reply, scheme="https" if tls else "http")
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=tls)
        server.port = listener.sockets[0].getsockname()[1]
        client = UpstreamClient()
        try:
            await test(server, client)
        finally:
            client.close()
            listener.close()

    asyncio.run(asyncio.wait_for(main(), 30))


async def post(client: UpstreamClient, server: Server, path: str = "/v1/completions", read_s: float = 5.0):
    headers = {"Content-Type": "application/json", "Authorization": "Bearer clé"}
    return await client.request(
        "POST", server.url, path, b'{"prompt": "hi"}', headers, connect_s=5, read_s=read_s
    )


def test_a_stream_arrives_chunk_by_chunk_not_when_it_ends() -> None:
    go_on = asyncio.Event()

    async def reply(peer: Peer, _: bytes) -> None:
        peer.send(OK_HEAD + chunk(b"data: one\n\n"))
        await go_on.wait()
        peer.send(chunk(b"data: two\n\n") + b"0\r\n\r\n")

    async def test(server: Server, client: UpstreamClient) -> None:
        response = await post(client, server)
        try:
            assert response.status == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert await response.read_chunk() == b"data: one\n\n"  # while the server holds the rest back
            go_on.set()
            assert await response.read() == b"data: two\n\n"
            assert await response.read_chunk() == b""
        finally:
            response.release()
        head = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
        assert head[0] == b"POST /v1/completions HTTP/1.1"
        assert f"Host: 127.0.0.1:{server.port}".encode() in head
        assert "Authorization: Bearer clé".encode() in head  # a client's key, forwarded byte for byte
        assert server.requests[0].endswith(b'{"prompt": "hi"}')

    serve(reply, test)


def test_a_connection_read_to_the_end_is_reused_and_one_left_unread_is_closed() -> None:
    async def reply(peer: Peer, _: bytes) -> None:
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def test(server: Server, client: UpstreamClient) -> None:
        for _ in range(3):
            response = await post(client, server)
            assert await response.read() == b"ok"
            response.release()
        assert server.connections == 1
        assert client.idle_connections() == 1

    serve(reply, test)

    async def endless(peer: Peer, _: bytes) -> None:
        peer.send(OK_HEAD + chunk(b"data: more\n\n"))

    async def left(server: Server, client: UpstreamClient) -> None:
        response = await post(client, server)
        assert await response.read_chunk() == b"data: more\n\n"
        response.release()  # the client left mid-answer: the replica must see its connection close
        await asyncio.wait_for(server.closed.wait(), 5)
        assert client.idle_connections() == 0

    serve(endless, left)


def test_leaving_is_called_once_before_the_client_first_waits() -> None:
    async def reply(peer: Peer, _: bytes) -> None:
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def test(server: Server, client: UpstreamClient) -> None:
        seen: list[tuple[int, int]] = []
        for _ in range(2):  # on a new connection, then on the pooled one
            response = await client.request(
                "POST",
                server.url,
                "/v1/completions",
                b"{}",
                {},
                connect_s=5,
                read_s=5,
                leaving=lambda: seen.append((server.connections, len(server.requests))),
            )
            assert await response.read() == b"ok"
            response.release()
        # No other task ran before it: the server had neither the new connection nor the request.
        assert seen == [(0, 0), (1, 1)]

    serve(reply, test)


def test_a_kept_alive_connection_the_replica_closed_is_not_reused() -> None:
    async def reply(peer: Peer, request: bytes) -> None:
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await peer.writer.drain()
        peer.writer.close()  # its keep-alive timeout, right after the answer

    async def test(server: Server, client: UpstreamClient) -> None:
        for _ in range(2):
            response = await post(client, server)
            assert await response.read() == b"ok"
            response.release()
        assert server.connections == 2
        assert len(server.requests) == 2  # each POST sent once (tests/security/test_upstream_client.py)

    serve(reply, test)


def test_a_burst_leaves_a_bounded_number_of_idle_connections() -> None:
    async def reply(peer: Peer, _: bytes) -> None:
        await asyncio.sleep(0.05)  # all of the burst in flight at once
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def one(server: Server, client: UpstreamClient) -> bytes:
        response = await post(client, server)
        try:
            return await response.read()
        finally:
            response.release()

    async def test(server: Server, client: UpstreamClient) -> None:
        burst = MAX_IDLE_PER_ORIGIN + 40
        assert await asyncio.gather(*(one(server, client) for _ in range(burst))) == [b"ok"] * burst
        assert server.connections == burst
        assert client.idle_connections() == MAX_IDLE_PER_ORIGIN

    serve(reply, test)


def test_a_new_connection_that_closes_without_an_answer_fails() -> None:
    async def reply(peer: Peer, _: bytes) -> None:
        peer.writer.close()

    async def test(server: Server, client: UpstreamClient) -> None:
        with pytest.raises(UpstreamError) as failed:
            await post(client, server)
        assert failed.value.kind == "disconnected"
        assert server.connections == 1  # no retry: nothing was kept alive

    serve(reply, test)


def test_a_silent_replica_times_out_before_its_head_and_mid_body() -> None:
    async def silent(peer: Peer, _: bytes) -> None:
        return None

    async def no_head(server: Server, client: UpstreamClient) -> None:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await post(client, server, read_s=0.3)
        assert 0.25 < time.monotonic() - start < 2.0

    serve(silent, no_head)

    async def stalls(peer: Peer, _: bytes) -> None:
        peer.send(OK_HEAD + chunk(b"data: one\n\n"))

    async def mid_body(server: Server, client: UpstreamClient) -> None:
        response = await post(client, server, read_s=0.3)
        try:
            await asyncio.sleep(0.5)  # the gateway busy elsewhere is no silence of the replica's
            assert await response.read_chunk() == b"data: one\n\n"
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                await response.read_chunk()
            assert 0.25 < time.monotonic() - start < 2.0
        finally:
            response.release()
        await asyncio.wait_for(server.closed.wait(), 5)

    serve(stalls, mid_body)


def test_unreachable_and_garbled_replicas_fail_with_their_kind() -> None:
    async def garbled(peer: Peer, _: bytes) -> None:
        peer.send(b"HELLO THERE\r\n\r\n")

    async def test(server: Server, client: UpstreamClient) -> None:
        with pytest.raises(UpstreamError) as bad:
            await post(client, server)
        assert bad.value.kind == "bad_response"
        with pytest.raises(UpstreamError) as refused:
            await client.request(
                "POST", f"http://127.0.0.1:{free_port()}", "/v1/completions", b"{}", {}, connect_s=2, read_s=2
            )
        assert refused.value.kind == "connect_failed"

    serve(garbled, test)


def test_a_reader_that_falls_behind_pauses_the_socket_instead_of_buffering_everything() -> None:
    body = bytes(range(256)) * (4 * _HIGH_WATER // 256)

    async def flood(peer: Peer, _: bytes) -> None:
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    async def test(server: Server, client: UpstreamClient) -> None:
        response = await post(client, server)
        try:
            await asyncio.sleep(0.5)
            assert response._conn._paused
            assert response._buffered < 2 * _HIGH_WATER
            assert await response.read() == body
        finally:
            response.release()

    serve(flood, test)


def test_the_replica_url_path_prefixes_every_request_and_names_the_host() -> None:
    origin = origin_of("https://models.example:8443/serving/")
    assert (origin.scheme, origin.host, origin.port, origin.base) == (
        "https",
        "models.example",
        8443,
        "/serving",
    )
    assert origin.authority == "models.example:8443"
    assert origin_of("http://[::1]/").authority == "[::1]"
    assert origin_of("http://bücher.example:81").authority == "xn--bcher-kva.example:81"
    with pytest.raises(ValueError, match="http:// or https://"):
        origin_of("unix:///tmp/worker.sock")


def test_an_https_replica_is_reached_only_with_a_certificate_the_gateway_trusts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def reply(peer: Peer, _: bytes) -> None:
        peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def untrusted(server: Server, client: UpstreamClient) -> None:
        with pytest.raises(UpstreamError) as refused:
            await post(client, server)
        assert refused.value.kind == "connect_failed" and "CERTIFICATE_VERIFY_FAILED" in str(refused.value)

    serve(reply, untrusted, tls)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the system's trust store, as an operator extends it

    async def trusted(server: Server, client: UpstreamClient) -> None:
        response = await post(client, server)
        try:
            assert (response.status, await response.read()) == (200, b"ok")
        finally:
            response.release()

    serve(reply, trusted, tls)


@pytest.mark.parametrize(
    ("value", "count"),
    [("0", 0), ("4096", 4096), (None, None), ("", None), ("\xb2", None), ("\u0663", None), ("-1", None),
     (" 7", None), ("1e3", None), ("9" * 16, None), ("9" * 15, 10**15 - 1)],
)  # fmt: skip
def test_a_count_header_is_a_plain_decimal_or_none(value: str | None, count: int | None) -> None:
    """Latin-1 `²` and Arabic-Indic digits pass str.isdigit() and would fail or surprise int()."""
    assert header_count(value) == count
