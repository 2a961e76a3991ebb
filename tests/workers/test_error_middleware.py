"""Every failure a worker answers is OpenAI's error JSON (workers.error_middleware): aiohttp's own
refusals over real HTTP on the tiny random model, and each kind of failure on a simulated worker,
each counted under its route's template."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import test_utils, web

from protocol.errors import ApiError
from tests.support.workers import RunningWorker, load
from tests.workers.worker_http import error_of
from workers.bundled_worker import Worker
from workers.kv_event_log import KVEventLog
from workers.sim.profiles import CPU_SMOLLM2
from workers.sim.runner import VirtualClock
from workers.sim.sim_engine import SimEngine
from workers.worker_app import create_app


def test_transport_level_refusals_are_openai_errors_too(tiny_worker: RunningWorker) -> None:
    too_big = httpx.post(
        f"{tiny_worker.url}/v1/completions", content=b'{"prompt": "' + b"a" * 100_000 + b'"}'
    )
    assert error_of(too_big, 413)["type"] == "invalid_request_error"
    error_of(httpx.get(f"{tiny_worker.url}/v1/nowhere"), 404)
    error_of(httpx.get(f"{tiny_worker.url}/v1/completions"), 405)
    for query in ("", "after=x", "after=-1", "after=0&timeout=500", "after=0&limit=0"):
        error_of(httpx.get(f"{tiny_worker.url}/kv/events?{query}"), 400)
    assert load(tiny_worker)["running"] == 0


# -- every kind of failure, on a simulated worker in this loop -----------------------------------------


async def crash(request: web.Request) -> web.Response:
    raise RuntimeError("secret internals")


async def busy(request: web.Request) -> web.Response:
    raise ApiError(503, "come back later", code="busy", headers={"Retry-After": "3"})


async def moved(request: web.Request) -> web.Response:
    raise web.HTTPFound("/health")


def sim_app() -> web.Application:
    events = KVEventLog()
    sim = SimEngine(CPU_SMOLLM2, clock=VirtualClock(), **events.callbacks())
    app = create_app(Worker.around(sim, events, worker_id="sim-1", backend="sim"))
    app.router.add_get("/crash", crash)
    app.router.add_get("/busy", busy)
    app.router.add_get("/moved/{where}", moved)
    return app


async def requests_counted(client: test_utils.TestClient) -> set[str]:
    text = await (await client.get("/metrics")).text()
    return {line for line in text.splitlines() if line.startswith("prefixgate_worker_requests_total{")}


def test_failures_are_openai_errors_and_every_request_is_counted_by_its_route(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        async with test_utils.TestClient(test_utils.TestServer(sim_app())) as client:
            crashed = await client.get("/crash")
            assert crashed.status == 500
            assert (await crashed.json())["error"] == {
                "message": "internal error in the worker",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
            refused = await client.get("/busy")
            assert refused.status == 503 and refused.headers["Retry-After"] == "3"
            assert (await refused.json())["error"]["code"] == "busy"
            missing = await client.get("/nowhere/42")
            assert missing.status == 404 and (await missing.json())["error"]["code"] == "not_found"
            wrong = await client.post("/health")
            assert (await wrong.json())["error"]["code"] == "method_not_allowed"
            redirect = await client.get("/moved/7", allow_redirects=False)
            assert redirect.status == 302 and redirect.headers["Location"] == "/health"
            assert await requests_counted(client) == {
                'prefixgate_worker_requests_total{endpoint="/crash",status="500"} 1.0',
                'prefixgate_worker_requests_total{endpoint="/busy",status="503"} 1.0',
                'prefixgate_worker_requests_total{endpoint="unmatched",status="404"} 1.0',
                'prefixgate_worker_requests_total{endpoint="unmatched",status="405"} 1.0',
            }, "a label per route template, never the raw path (none for a refused method); a redirect passes"

    asyncio.run(main())
    assert "unhandled error serving GET /crash" in caplog.text
