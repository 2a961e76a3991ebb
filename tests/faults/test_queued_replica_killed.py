"""A foreign replica SIGKILLed while requests are queued on it — vLLM-style: it has answered 200 and
sent its opening role event, but no token yet. None of them is lost: no output had reached a client,
so each one is retried on the next choice and its client gets one clean answer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.probes import wait_for
from tests.support.gateways import RunningGateway
from tests.support.servers import free_port

MODEL = "foreign-m"
# A vLLM-like server: a stream answers 200 and its role event at once, and its tokens after
# QUEUE_S (a request waiting in the replica's queue); a whole answer comes after QUEUE_S too.
BACKEND = """
import asyncio, json, sys
from aiohttp import web
queue_s, port = float(sys.argv[1]), int(sys.argv[2])

def chunk(delta, finish=None):
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "foreign-m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\\n\\n"

async def chat(request):
    body = await request.json()
    if not body.get("stream"):
        await asyncio.sleep(queue_s)
        return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": "foreign-m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"served on {port}"},
                         "finish_reason": "stop"}]})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk({"role": "assistant", "content": ""}))
    await asyncio.sleep(queue_s)
    await response.write(chunk({"content": f"served on {port}"}))
    await response.write(chunk({}, "stop") + b"data: [DONE]\\n\\n")
    await response.write_eof()
    return response

async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "foreign-m", "object": "model"}]})

app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/v1/models", models)
app.router.add_get("/health", lambda request: web.Response(text=""))
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


@pytest.fixture
def backend() -> Iterator[Callable[[float], tuple[subprocess.Popen[bytes], str]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(queue_s: float) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-c", BACKEND, str(queue_s), str(port)])
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, f"the backend exited with {proc.returncode}"
            try:
                return httpx.get(f"{url}/v1/models", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "the backend", timeout=30)
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def chat(gateway: RunningGateway, i: int, stream: bool) -> tuple[int, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "stream": stream}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)
    if not stream:
        return response.status_code, response.json()["choices"][0]["message"]["content"]
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", response.text
    text = "".join(
        choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in json.loads(event)["choices"]
    )
    assert "error" not in response.text, response.text
    return response.status_code, text


def test_requests_queued_on_a_killed_replica_are_served_elsewhere(
    backend: Callable[[float], tuple[subprocess.Popen[bytes], str]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    doomed, doomed_url = backend(60.0)
    _, healthy_url = backend(0.05)
    gateway = start_gateway(
        [],
        wait_for=2,
        replicas=[{"url": doomed_url, "kind": "openai"}, {"url": healthy_url, "kind": "openai"}],
        routing={"policy": "round_robin"},
        models={MODEL: {"tokenizer": "none"}},
    )
    doomed_id = gateway.state.replicas.by_url(doomed_url).id
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(chat, gateway, i, stream=i % 2 == 0) for i in range(16)]
        # Half of them are queued on the doomed replica: 200 and a role event sent, no token.
        wait_for(
            lambda: len(gateway.state.replicas.get(doomed_id).inflight) >= 6,
            "requests queued there",
            timeout=5,
        )
        time.sleep(0.2)
        doomed.send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [status for status, _ in results] == [200] * 16
    healthy_port = healthy_url.rsplit(":", 1)[1]
    assert all(text == f"served on {healthy_port}" for _, text in results), results
    retried = gateway.state.metrics.registry.get_sample_value(
        "prefixgate_gateway_retries_total", {"model": MODEL, "reason": "disconnected"}
    )
    assert retried is not None and retried >= 6
