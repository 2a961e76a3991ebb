"""The canned replica answers every route a router's benchmark needs, over keep-alive connections,
streamed when asked, and 404 to anything else."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from bench.local_fleet import Child, spawn, stop, wait_healthy
from protocol.loopback_ports import free_port

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    port = free_port()
    command = [sys.executable, "-m", "bench.canned_replica", "--port", str(port), "--model", "c"]
    child = spawn("replica", command, f"http://127.0.0.1:{port}", tmp_path_factory.mktemp("canned"))
    try:
        wait_healthy([child], 60)
        yield child
    finally:
        stop([child])


def test_every_route_answers_on_one_kept_alive_connection(replica: Child) -> None:
    with httpx.Client(base_url=replica.url, limits=httpx.Limits(max_connections=1)) as client:
        assert client.get("/health").status_code == 200
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["c"]
        chat = client.post(
            "/v1/chat/completions", json={"model": "c", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.json()["choices"][0]["message"]["content"] == "ok"
        assert chat.json()["usage"]["completion_tokens"] == 1
        text = client.post("/v1/completions", json={"model": "c", "prompt": "hi"})
        assert text.json()["choices"][0]["text"] == "ok"
        streamed = client.post("/v1/chat/completions", json={"model": "c", "messages": [], "stream": True})
        assert streamed.headers["content-type"] == "text/event-stream"
        assert streamed.text.endswith("data: [DONE]\n\n") and '"delta": {"content": "ok"}' in streamed.text
        assert client.post("/v1/embeddings", json={}).status_code == 404
        assert client.get("/v1/models?x=1").status_code == 200


def test_bytes_that_are_not_http_close_the_connection(replica: Child) -> None:
    port = int(replica.url.rsplit(":", 1)[1])
    done = subprocess.run(
        [sys.executable, "-c", f"import socket; s=socket.create_connection(('127.0.0.1', {port})); "
         "s.sendall(b'NOT HTTP AT ALL\\r\\n\\r\\n'); s.settimeout(5); print(s.recv(100))"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.stdout.strip() == "b''"
    assert httpx.get(f"{replica.url}/health").status_code == 200
