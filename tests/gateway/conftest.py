"""Fleets for gateway tests: simulated workers and gateways served in-process over loopback HTTP.

The simulated workers announce a Llama-3.1-8B-sized model with 16-token blocks; the gateway is told to
tokenize that model's text with SmolLM2's tokenizer, whose ids fit its vocabulary, so chat and text
prompts run end to end through the official client while the workers stay fast cost models.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from gateway.app import GATEWAY, create_app
from gateway.cli import build_parser
from gateway.config import parse_config
from gateway.gateway import Gateway
from tests.conftest import free_port
from tests.workers.conftest import ServerThread
from workers.cli import build_worker, extra_contexts
from workers.server import Worker
from workers.server import create_app as create_worker_app

SIM_MODEL = "Llama-3.1-8B-Instruct"


@dataclass
class SimWorker:
    url: str
    id: str
    worker: Worker
    server: ServerThread
    port: int

    def load(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/load").json()


@dataclass
class RunningGateway:
    url: str
    app: Any
    server: ServerThread

    @property
    def gw(self) -> Gateway:
        return self.app[GATEWAY]

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def admin(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=10, **kwargs)

    def wait_routable(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(r.routable for r in self.gw.replicas.all()) != count:
            assert time.monotonic() < deadline, f"the gateway never saw {count} routable replicas"
            time.sleep(0.05)


@contextmanager
def foreign_backend(
    model: str, complete: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> Iterator[str]:
    """A minimal OpenAI-compatible server written for a test, standing in for a foreign backend
    (vLLM, SGLang): /v1/models names `model`, /health is vLLM's (200, no body), and `complete`
    answers /v1/completions. Yields its base URL."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", complete)
    server = ServerThread(app)
    try:
        yield server.start()
    finally:
        server.stop()


def sim_worker_args(worker_id: str, port: int, *extra: str) -> list[str]:
    return [
        "worker", "--sim", "--sim-profile", "h100-8b", "--block-size", "16", "--num-blocks", "512",
        "--id", worker_id, "--port", str(port), *extra,
    ]  # fmt: skip


@pytest.fixture
def start_sim_worker() -> Iterator[Callable[..., SimWorker]]:
    servers: list[ServerThread] = []

    def start(worker_id: str, *extra: str, port: int | None = None) -> SimWorker:
        port = port or free_port()
        args = build_parser().parse_args(sim_worker_args(worker_id, port, *extra))
        worker = build_worker(args)
        server = ServerThread(create_worker_app(worker, contexts=extra_contexts(args)), port=port)
        servers.append(server)
        return SimWorker(server.start(), worker_id, worker, server, port)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., RunningGateway]]:
    servers: list[ServerThread] = []

    def start(urls: list[str], wait_for: int | None = None, **config: Any) -> RunningGateway:
        data = {
            "replicas": [{"url": u} for u in urls],
            "models": {SIM_MODEL: {"tokenizer": "default"}},
            "health": {"interval_s": 0.2, "load_interval_s": 0.05},
            **config,
        }
        app = create_app(parse_config(data))
        server = ServerThread(app)
        servers.append(server)
        running = RunningGateway(server.start(), app, server)
        running.wait_routable(len(urls) if wait_for is None else wait_for)
        return running

    yield start
    for server in servers:
        server.stop()
