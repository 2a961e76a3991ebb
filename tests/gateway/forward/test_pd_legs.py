"""Foreign prefill/decode fleets through the gateway, driven by the official openai client: vLLM's protocol
(prefill first, one token, its kv_transfer_params handed to the decode instance) and SGLang's (bootstrap
fields in both requests, sent at once), each against small servers written for the test that check every
field they must receive, and that the rest of the client's body reaches them as the client sent it.
A server that finds a field wrong answers 400 with what it found, which fails the request."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from aiohttp import web

from tests.support.gateways import RunningGateway
from tests.support.pd import REMOTE_DECODE
from tests.support.servers import ServerThread

MODEL = "pd-m"
# What vLLM's prefill instance must be asked for, field by field (its reference proxy's).
BOOTSTRAP_PORT = 9123
TEXT = ["Hello", " from", " the", " decode", " side"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello from the decode side."},
]


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-d",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _usage_chunk() -> bytes:
    usage = {"prompt_tokens": 30, "completion_tokens": len(TEXT), "total_tokens": 30 + len(TEXT)}
    body = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    return b"data: " + json.dumps({**body, "choices": [], "usage": usage}).encode() + b"\n\n"


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-d",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 1, "total_tokens": 31},
    }


async def _answer(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """The decode side's answer: the text, streamed (with usage when asked) or whole."""
    if body.get("stream") is not True:
        return web.json_response(_completion("".join(TEXT)))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_chunk({"role": "assistant", "content": ""}))
    for piece in TEXT:
        await response.write(_chunk({"content": piece}))
    await response.write(_chunk({}, "stop"))
    if (body.get("stream_options") or {}).get("include_usage"):
        await response.write(_usage_chunk())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _remote_prefill(request_id: str) -> dict[str, Any]:
    """What a vLLM prefill instance answers with: where the KV is, and (for this test) which request
    made it, so that the decode side can check both came on unchanged."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-p",
        "remote_block_ids": [4, 5, 6],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "made_for": request_id,
    }


def _mismatch(what: str, got: Any, wanted: Any) -> web.Response:
    return web.json_response(
        {"error": {"message": f"{what}: got {got!r}, wanted {wanted!r}", "type": "test_mismatch"}}, status=400
    )


@dataclass
class Instance:
    """One foreign server of a PD fleet, of the role given. `expect` is the body the client sent."""

    role: str
    protocol: str
    expect: dict[str, Any] = field(default_factory=dict)
    received: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    # Requests to fail before serving (the prefill side), and with what status and body.
    failing: int = 0
    fail_status: int = 500
    # vLLM prefill: whether its answer carries kv_transfer_params.
    hands_params: bool = True
    # SGLang: the rooms a prefill server has served, which its decode servers wait for.
    rooms: set[int] = field(default_factory=set)
    # SGLang decode: requests given up while waiting for the KV.
    abandoned: int = 0
    prefill: Instance | None = None
    server: ServerThread | None = None
    url: str = ""

    def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.server = ServerThread(app)
        self.url = self.server.start()
        return self.url

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        # Every X-Request-Id it got, however spelled: one, or the pairing is ambiguous.
        self.request_ids.append(",".join(request.headers.getall("X-Request-Id", [])))
        if self.failing:
            self.failing -= 1
            error = {"error": {"message": f"{self.role} failed on purpose", "type": "server_error"}}
            return web.json_response(error, status=self.fail_status)
        serve = {"vllm": self._vllm, "sglang": self._sglang}[self.protocol]
        return await serve(request, body)

    async def _vllm(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id", "")
        if self.role == "prefill":
            wanted = {k: v for k, v in self.expect.items() if k not in ("stream_options", "min_tokens")}
            wanted |= {"max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
            if "max_completion_tokens" in self.expect:
                wanted["max_completion_tokens"] = 1
            if body != wanted:
                return _mismatch("prefill body", body, wanted)
            answer = _completion("H")
            if self.hands_params:
                answer["kv_transfer_params"] = _remote_prefill(request_id)
            return web.json_response(answer)
        assert self.prefill is not None
        wanted = self.expect
        if self.prefill.hands_params:
            wanted = {**wanted, "kv_transfer_params": _remote_prefill(request_id)}
        if body != wanted:
            return _mismatch("decode body", body, wanted)
        if not request_id or request_id not in self.prefill.request_ids:
            return _mismatch("X-Request-Id", request_id, self.prefill.request_ids)
        return await _answer(request, body)

    async def _sglang(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        room = body.get("bootstrap_room")
        sent = {k: v for k, v in body.items() if not k.startswith("bootstrap_")}
        if sent != self.expect:
            return _mismatch(f"{self.role} body", sent, self.expect)
        if body.get("bootstrap_host") != "127.0.0.1" or body.get("bootstrap_port") != BOOTSTRAP_PORT:
            return _mismatch("bootstrap host and port", body, ("127.0.0.1", BOOTSTRAP_PORT))
        if not isinstance(room, int) or not 0 <= room < 2**63:
            return _mismatch("bootstrap_room", room, "an int in [0, 2**63)")
        if self.role == "prefill":
            self.rooms.add(room)
            return await _answer(request, {**body, "stream": body.get("stream")})
        assert self.prefill is not None
        try:
            # The KV comes from the prefill server of the same room: wait for it, as SGLang's does.
            while room not in self.prefill.rooms:
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.abandoned += 1
            raise
        return await _answer(request, body)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture
def fleet(start_gateway: Callable[..., RunningGateway]) -> Iterator[Callable[..., Any]]:
    """`fleet(protocol, prefills, decodes)`: foreign instances and a gateway routing them in pairs."""
    started: list[Instance] = []

    def build(protocol: str, prefills: int = 1, decodes: int = 1) -> tuple[RunningGateway, list, list]:
        ps = [Instance("prefill", protocol) for _ in range(prefills)]
        ds = [Instance("decode", protocol, prefill=ps[0]) for _ in range(decodes)]
        entries = []
        for instance in ps + ds:
            started.append(instance)
            entry = {
                "url": instance.start(),
                "kind": "openai",
                "role": instance.role,
                "pd_protocol": protocol,
            }
            if protocol == "sglang" and instance.role == "prefill":
                entry["bootstrap_port"] = BOOTSTRAP_PORT
            entries.append(entry)
        gateway = start_gateway(
            [],
            wait_for=len(entries),
            replicas=entries,
            models={MODEL: {"tokenizer": "default"}},
            # Even this test's short prompts go through a prefill replica.
            routing={"pd": {"min_transfer_tokens": 0}},
            # A decode server left waiting for KV that never comes fails the test in seconds, not minutes.
            limits={"request_timeout_s": 10},
        )
        return gateway, ps, ds

    yield build
    for instance in started:
        instance.stop()


def _request(stream: bool, usage: bool = True) -> dict[str, Any]:
    """A chat request as a client of the official library sends it, vendor fields included."""
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0.2,
        "stream": stream,
        "user": "u-1",
    }
    if stream and usage:
        request["stream_options"] = {"include_usage": True}
    return request


def _send(
    gateway: RunningGateway, instances: list[Instance], stream: bool, usage: bool = True, **extra: Any
) -> tuple[str, Any]:
    """Send the chat request through the gateway; (the text, the raw response)."""
    request = _request(stream, usage) | extra
    for instance in instances:
        instance.expect = request
    given = {k: v for k, v in request.items() if k not in ("model", "messages", "stream")}
    create = gateway.client().chat.completions.with_raw_response.create
    raw = create(model=MODEL, messages=MESSAGES, stream=stream, extra_body=given)
    answer = raw.parse()
    if not stream:
        return answer.choices[0].message.content, raw
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    return text, raw


def _metric(gateway: RunningGateway, name: str, **labels: str) -> float:
    return gateway.state.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_prefill_then_decode_with_its_kv_transfer_params(
    fleet: Callable[..., Any], stream: bool
) -> None:
    gateway, (prefill,), (decode,) = fleet("vllm")
    extra = {"max_completion_tokens": 64, "min_tokens": 2} if stream else {}
    text, raw = _send(gateway, [prefill, decode], stream, **extra)
    assert text == "".join(TEXT)
    assert len(prefill.received) == 1 and len(decode.received) == 1
    # One request id for both sides, made up by the gateway as the client gave none.
    assert prefill.request_ids[0] == decode.request_ids[0] and uuid.UUID(prefill.request_ids[0])
    headers = raw.headers
    assert headers["x-prefixgate-policy"] == "pd"
    assert headers["x-prefixgate-replica"] == gateway.state.replicas.by_url(decode.url).id
    assert headers["x-prefixgate-prefill-replica"] == gateway.state.replicas.by_url(prefill.url).id
    pair = {
        "model": MODEL,
        "prefill": headers["x-prefixgate-prefill-replica"],
        "decode": headers["x-prefixgate-replica"],
    }
    assert _metric(gateway, "prefixgate_gateway_pd_requests_total", **pair) == 1


def test_a_paired_stream_goes_as_the_client_sent_it_without_asking_for_usage(
    fleet: Callable[..., Any],
) -> None:
    # Unpaired, a stream to a foreign replica asks for usage to learn its cache from; a paired decode
    # instance's usage is not learned from, so its stream goes as the client sent it.
    gateway, (prefill,), (decode,) = fleet("vllm")
    text, _ = _send(gateway, [prefill, decode], stream=True, usage=False)
    assert text == "".join(TEXT) and "stream_options" not in decode.received[0]


def test_a_client_request_id_gives_way_to_the_gateways_own_on_both_vllm_instances(
    fleet: Callable[..., Any],
) -> None:
    """The connector pairs the two sides by X-Request-Id: a client's own could name another request's."""
    gateway, (prefill,), (decode,) = fleet("vllm")
    request = _request(False)
    prefill.expect = decode.expect = request
    given = {k: v for k, v in request.items() if k not in ("model", "messages")}
    client = gateway.client()
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body=given, extra_headers={"x-request-id": "client-7"}
    )
    assert prefill.request_ids == decode.request_ids and uuid.UUID(prefill.request_ids[0])


def test_a_failed_vllm_prefill_is_retried_on_the_next_pair(fleet: Callable[..., Any]) -> None:
    gateway, (prefill,), decodes = fleet("vllm", prefills=1, decodes=2)
    prefill.failing = 1
    text, _ = _send(gateway, [prefill, *decodes], stream=False)
    assert text == "".join(TEXT)
    assert len(prefill.received) == 2, "the second attempt's prefill request"
    assert sorted(len(d.received) for d in decodes) == [0, 1], "no decode request for the failed attempt"
    pid = gateway.state.replicas.by_url(prefill.url).id
    assert _metric(gateway, "prefixgate_gateway_upstream_errors_total", replica=pid, kind="http_500") == 1
    assert _metric(gateway, "prefixgate_gateway_retries_total", model=MODEL, reason="http_500") == 1


def test_a_vllm_prefill_that_refuses_the_body_answers_the_client(fleet: Callable[..., Any]) -> None:
    gateway, (prefill,), (decode,) = fleet("vllm")
    prefill.failing, prefill.fail_status = 1, 400
    with pytest.raises(openai.BadRequestError, match="prefill failed on purpose"):
        _send(gateway, [prefill, decode], stream=False)
    assert decode.received == [] and len(prefill.received) == 1


def test_a_vllm_prefill_answer_without_params_leaves_the_decode_to_compute_the_prompt(
    fleet: Callable[..., Any],
) -> None:
    gateway, (prefill,), (decode,) = fleet("vllm")
    prefill.hands_params = False
    text, _ = _send(gateway, [prefill, decode], stream=True)
    assert text == "".join(TEXT) and decode.received == [decode.expect]
    pid = gateway.state.replicas.by_url(prefill.url).id
    assert _metric(gateway, "prefixgate_gateway_pd_fallbacks_total", model=MODEL, prefill=pid) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_pair_gets_one_bootstrap_room_at_once(fleet: Callable[..., Any], stream: bool) -> None:
    gateway, (prefill,), (decode,) = fleet("sglang")
    text, raw = _send(gateway, [prefill, decode], stream, n=1)
    assert text == "".join(TEXT)
    (sent_p,), (sent_d,) = prefill.received, decode.received
    assert sent_p == sent_d, "the prefill server gets the decode server's request"
    assert raw.headers["x-prefixgate-prefill-replica"] == gateway.state.replicas.by_url(prefill.url).id
    # Another request, another room.
    _send(gateway, [prefill, decode], stream)
    assert len(prefill.rooms) == 2


def test_a_failed_sglang_prefill_gives_up_the_decode_wait(fleet: Callable[..., Any]) -> None:
    gateway, (prefill,), (decode,) = fleet("sglang")
    prefill.failing = 10
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as error:
        _send(gateway, [prefill, decode], stream=True)
    assert error.value.status_code == 502 and "prefill replica" in str(error.value)
    assert time.monotonic() - started < 5, "not after the decode server's own timeout"
    deadline = time.monotonic() + 5
    while decode.abandoned < 1:
        assert time.monotonic() < deadline, "the decode request was left waiting"
        time.sleep(0.02)


def test_a_failed_sglang_prefill_is_retried_on_the_next_pair(fleet: Callable[..., Any]) -> None:
    gateway, (prefill,), decodes = fleet("sglang", prefills=1, decodes=2)
    prefill.failing = 1
    text, _ = _send(gateway, [prefill, *decodes], stream=False)
    assert text == "".join(TEXT)
    assert len(prefill.received) == 2 and sum(d.abandoned for d in decodes) <= 1
    assert _metric(gateway, "prefixgate_gateway_retries_total", model=MODEL, reason="http_500") == 1
