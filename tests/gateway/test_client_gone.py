"""How a request whose client leaves is counted: a client that closes on [DONE], before the replica's
end of stream reaches the gateway, had its whole answer (a 200); one that leaves mid-stream is a 499,
labelled with the replica it was on, and counted once.

The replica is a minimal OpenAI-compatible server written for this test: it streams a few chunks
and [DONE], then holds its end of stream back, as a busy server or a slow network can."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from itertools import islice

import httpx
import orjson
import pytest
from aiohttp import web

from bench.probes import wait_for
from protocol.openai_responses import SSE_DONE, sse
from tests.support.gateways import RunningGateway, foreign_backend

MODEL = "slow-close"
CHUNKS = 5
HOLD_S = 3.0


async def _complete(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(CHUNKS):
        chunk = {
            "id": "c",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": f"{i}"}],
        }
        await response.write(sse(chunk))
        await asyncio.sleep(0.05)
    await response.write(SSE_DONE)
    await asyncio.sleep(HOLD_S)
    await response.write_eof()
    return response


@pytest.fixture
def slow_close_backend() -> Iterator[str]:
    with foreign_backend(MODEL, _complete) as url:
        yield url


def _counted(gateway: RunningGateway, status: str, replica: str) -> float:
    labels = {
        "model": MODEL if replica else "",
        "replica": replica,
        "policy": gateway.state.policy.name,
        "route": "completions",
    }
    value = gateway.state.metrics.registry.get_sample_value(
        "prefixgate_gateway_requests_total", {**labels, "status": status}
    )
    return value or 0.0


@pytest.mark.parametrize(("read_lines", "status"), [(CHUNKS + 1, "200"), (2, "499")])
def test_a_client_that_leaves_is_counted_once_with_its_replica(
    slow_close_backend: str,
    start_gateway: Callable[..., RunningGateway],
    read_lines: int,
    status: str,
) -> None:
    gateway = start_gateway([], wait_for=1, replicas=[{"url": slow_close_backend, "kind": "openai"}])
    replica = gateway.state.replicas.all()[0].id
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = list(islice((line for line in lines if line), read_lines))
        left = time.monotonic()
    assert (seen[-1] == "data: [DONE]") == (status == "200")
    # Counted once the gateway notices, well before the replica's held-back end of stream.
    wait_for(
        lambda: _counted(gateway, status, replica) >= 1, f"a request counted with status {status}", timeout=5
    )
    assert time.monotonic() - left < HOLD_S - 1
    other = "499" if status == "200" else "200"
    assert _counted(gateway, other, replica) == 0
    # Not a second time without labels, as the middleware counts a client that left before routing.
    assert _counted(gateway, "499", "") == 0
    # The replica was not blamed for the client's leaving.
    assert gateway.state.replicas.get(replica).routable


# Set by the test when the backend may end its stream.
END_NOW = threading.Event()


async def _ends_when_told(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"id": "c", "object": "text_completion", "model": MODEL, "choices": [{"index": 0, "text": "x"}]}
    await response.write(sse(chunk) + SSE_DONE)
    while not END_NOW.is_set():
        await asyncio.sleep(0.005)
    await response.write_eof()
    return response


def test_a_client_that_closes_as_the_stream_ends_is_counted_as_served(
    start_gateway: Callable[..., RunningGateway], caplog: pytest.LogCaptureFixture
) -> None:
    """The replica's end of stream and the client's close reach the gateway in one turn of its event
    loop, the end first: the gateway's last write then finds its client's connection closing. That
    client had its whole answer (a 200), and the write's failure is nobody's error."""
    END_NOW.clear()
    with foreign_backend(MODEL, _ends_when_told) as url:
        gateway = start_gateway([], wait_for=1, replicas=[{"url": url, "kind": "openai"}])
        replica = gateway.state.replicas.all()[0].id
        body = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1, "stream": True})
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", gateway.server.port)) as client:
            client.sendall(head.encode() + body)
            seen = b""
            while b"[DONE]" not in seen:
                seen += client.recv(65536)
            blocked = threading.Event()

            def block() -> None:
                blocked.set()
                time.sleep(0.3)

            gateway.server.loop.call_soon_threadsafe(block)
            assert blocked.wait(5)
            END_NOW.set()
            time.sleep(0.1)  # the end of stream is at the gateway's socket, unread
        wait_for(
            lambda: _counted(gateway, "200", replica) >= 1, "a request counted with status 200", timeout=5
        )
        assert _counted(gateway, "499", replica) == 0
        assert gateway.state.replicas.get(replica).routable
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
