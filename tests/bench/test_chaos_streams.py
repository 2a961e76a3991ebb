"""How the streaming chaos scenario judges a stream, against a stub gateway: whole only with every word
asked for, one finish_reason, one id and [DONE]; and the migrations it reads from /metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from bench.chaos_streams import _migrations, stream_replay
from protocol.loopback_ports import free_port
from tests.bench.stub_server import serving

METRICS = """\
prefixgate_gateway_stream_migrations_total{model="m",outcome="continued"} 2.0
prefixgate_gateway_stream_migrations_total{model="n",outcome="continued"} 1.0
prefixgate_gateway_stream_migrations_total{model="m",outcome="failed"} 5.0
"""


def _event(payload: Any) -> bytes:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n".encode()


@pytest.fixture
def gateway() -> Iterator[str]:
    """Streams `max_tokens` words; a prompt [1] cut after one word, [2] with a second id, [3] a 503."""

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = body["prompt"][0]
        if kind == 3:
            return web.json_response({"error": {"code": "unavailable"}}, status=503)
        response = web.StreamResponse()
        await response.prepare(request)
        words = 1 if kind == 1 else body["max_tokens"]
        for n in range(words):
            last = n == body["max_tokens"] - 1
            chunk_id = "b" if kind == 2 and n else "a"
            choice = {"text": f" w{n}", "finish_reason": "length" if last else None}
            await response.write(_event({"id": chunk_id, "choices": [choice]}))
        await response.write(_event("[DONE]"))
        return response

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    with serving(("POST", "/v1/completions", complete), ("GET", "/metrics", metrics)) as url:
        yield url


def test_a_stream_is_whole_only_when_nothing_is_missing(gateway: str) -> None:
    bodies = [{"prompt": [kind], "max_tokens": 3} for kind in (0, 1, 2, 3)]
    whole, cut, two_ids, refused = asyncio.run(stream_replay(gateway, bodies, spacing_s=0.01))
    assert whole.status == 200 and whole.whole and whole.error is None and whole.seconds > 0
    assert cut.status == 200 and not cut.whole and cut.error and cut.error.startswith("truncated: 1 words")
    assert two_ids.status == 200 and not two_ids.whole
    assert refused.status == 503 and not refused.whole and "unavailable" in (refused.error or "")


def test_migrations_count_the_continued_streams(gateway: str) -> None:
    assert _migrations(gateway) == 3.0
    assert _migrations(f"http://127.0.0.1:{free_port()}") == 0.0
