"""Gateways and simulated workers served in-process over loopback HTTP (as the fixtures in
tests/support/fixtures.py start them), foreign OpenAI-compatible backends written for a test, and what
tests check of a gateway's answers.

The simulated workers announce a Llama-3.1-8B-sized model with 16-token blocks; the gateway is told to
tokenize that model's text with SmolLM2's tokenizer, whose ids fit its vocabulary, so chat and text
prompts run end to end through the official client while the workers stay fast cost models.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from aiohttp import web
from multidict import CIMultiDict

from bench.probes import wait_for
from gateway.gateway import Gateway
from gateway.gateway_state import GatewayState
from gateway.http.keys import GATEWAY, STATE
from tests.support.servers import ServerThread
from workers.bundled_worker import Worker

SIM_MODEL = "Llama-3.1-8B-Instruct"
PREFIX = [1000 + (7 * i) % 30_000 for i in range(160)]


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
    # The endpoint picker's gRPC port, where the gateway serves one.
    grpc_port: int | None = None

    @property
    def gw(self) -> Gateway:
        return self.app[GATEWAY]

    @property
    def state(self) -> GatewayState:
        return self.app[STATE]

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def admin(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=10, **kwargs)

    def wait_routable(self, count: int, timeout: float = 10.0) -> None:
        wait_for(
            lambda: sum(r.routable for r in self.state.replicas.all()) == count,
            f"the gateway to see {count} routable replicas",
            timeout=timeout,
            interval=0.05,
        )


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


# A simulated worker that reads text itself, in words: a backend with a tokenizer of its own.
WORD_WORKER = ("--sim-tokenizer", "words")


def foreign_entries(workers: list[SimWorker], block_size: int = 16) -> list[dict[str, object]]:
    """Config entries declaring simulated workers foreign OpenAI servers (approximate mode)."""
    return [{"url": w.url, "id": w.id, "kind": "openai", "block_size": block_size} for w in workers]


def sim_worker_args(worker_id: str, port: int, *extra: str) -> list[str]:
    return [
        "worker", "--sim", "--sim-profile", "h100-8b", "--block-size", "16", "--num-blocks", "512",
        "--id", worker_id, "--port", str(port), *extra,
    ]  # fmt: skip


def complete(gateway: RunningGateway, prompt: list[int], **extra: Any) -> tuple[str, int, int]:
    """(replica, predicted cached tokens, realised cached tokens) of one completion."""
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": SIM_MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (
        response.headers["x-prefixgate-replica"],
        int(response.headers["x-prefixgate-predicted-cached-tokens"]),
        cached,
    )


@dataclass(frozen=True)
class Received:
    method: str
    # Path and query string, as they reached the backend.
    target: str
    headers: CIMultiDict[str]
    body: bytes


Answers = dict[tuple[str, bool], bytes | list[bytes]]


class RecordingBackend:
    """A foreign OpenAI-compatible server for pass-through tests: it records every request as the bytes
    it received, and answers with the bytes a test gave it (`answers[(path, stream)]`; a list of bytes
    is sent as SSE, one write each). /v1/responses answers carry a fresh id, `resp_{name}_{n}`, and,
    like a real server, a `previous_response_id` this backend did not produce is a 404."""

    def __init__(self, name: str, model: str, answers: Answers) -> None:
        self.name = name
        self.model = model
        self.answers = answers
        # The status the given answers are sent with (an error body, say).
        self.status = 200
        self.received: list[Received] = []
        self.responses: list[str] = []
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._record)
        self.server = ServerThread(app)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": self.model, "object": "model", "max_model_len": 8192}]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _record(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append(Received(request.method, request.raw_path, CIMultiDict(request.headers), raw))
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        stream = isinstance(body, dict) and body.get("stream") is True
        if request.path == "/v1/responses" and request.method == "POST":
            return await self._response(request, body, stream)
        answer = self.answers.get((request.path, stream))
        if answer is None:
            return web.json_response({"backend": self.name, "path": request.path, "method": request.method})
        if isinstance(answer, bytes):
            return web.Response(body=answer, status=self.status, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in answer:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def _response(self, request: web.Request, body: dict[str, Any], stream: bool) -> web.StreamResponse:
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.responses:
            error = {
                "error": {
                    "message": f"Response with id '{previous}' not found.",
                    "type": "invalid_request_error",
                }
            }
            return web.json_response(error, status=404)
        response_id = f"resp_{self.name}_{len(self.responses)}"
        self.responses.append(response_id)
        obj = {
            "id": response_id,
            "object": "response",
            "created_at": 1,
            "model": self.model,
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": f"msg_{response_id}",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": f"from {self.name}", "annotations": []}],
                }
            ],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "previous_response_id": previous,
        }
        if not stream:
            return web.json_response(obj)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = [
            {"type": "response.created", "sequence_number": 0, "response": {**obj, "status": "in_progress"}},
            {"type": "response.output_text.delta", "sequence_number": 1, "item_id": f"msg_{response_id}",
             "output_index": 0, "content_index": 0, "delta": f"from {self.name}"},
            {"type": "response.completed", "sequence_number": 2, "response": obj},
        ]  # fmt: skip
        for event in events:
            await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        await response.write_eof()
        return response


def assert_openai_error(status: int, body: bytes, where: str) -> None:
    """A 4xx in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, the last two null or str."""
    assert status < 500, f"{where}: {status} {body[:500]!r}"
    try:
        payload = json.loads(body)
    except ValueError:
        raise AssertionError(f"{where}: {status} with a body that is not JSON: {body[:500]!r}") from None
    error = payload.get("error") if isinstance(payload, dict) else None
    assert isinstance(error, dict), f"{where}: {status} {payload!r}"
    assert isinstance(error.get("message"), str) and error["message"], f"{where}: {payload!r}"
    assert isinstance(error.get("type"), str) and error["type"], f"{where}: {payload!r}"
    assert set(error) >= {"param", "code"}, f"{where}: {payload!r}"
    assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), payload
