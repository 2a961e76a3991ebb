"""The gateway in front of a foreign OpenAI-compatible server is transparent: what the official client
sends reaches the backend byte for byte, whatever OpenAI field or vendor extension it holds, and the
backend's answer (or error) reaches the client unchanged. The gateway refuses only what is its own to
judge."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateways import RecordingBackend, RunningGateway

MODEL = "foreign-m"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_HISTORY = [
    {"role": "system", "content": "You answer with the tools you have."},
    {"role": "user", "content": "What is the weather in Lyon?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "clear"}'},
]
USER = [{"role": "user", "content": "Say hi."}]
# What each scenario adds to a chat request, as a client of the official library writes it.
SCENARIOS: dict[str, dict[str, Any]] = {
    "tools": {
        "messages": USER,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    },
    "tool history": {"messages": TOOL_HISTORY, "tools": [WEATHER_TOOL]},
    "response_format": {
        "messages": USER,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "greeting",
                "schema": {"type": "object", "properties": {"text": {"type": "string"}}},
            },
        },
    },
    "n=3": {"messages": USER, "n": 3, "temperature": 0.7},
    "logprobs": {"messages": USER, "logprobs": True, "top_logprobs": 2},
    "vendor fields": {
        "messages": USER,
        "extra_body": {"guided_json": {"type": "object"}, "regex": "[a-z]+", "top_k": 5, "min_p": 0.1},
    },
}

CHAT_ANSWER = json.dumps(
    {
        "id": "chatcmpl-backend",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": None if i == 0 else f"choice {i}",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                        }
                    ]
                    if i == 0
                    else None,
                },
                "logprobs": None,
                "finish_reason": "tool_calls" if i == 0 else "stop",
            }
            for i in range(3)
        ],
        "usage": {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49},
        "vendor_extension": {"kv_transfer_params": None, "note": "é ✓"},
    },
    ensure_ascii=False,
).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    body = {
        "id": "chatcmpl-backend",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": MODEL,
        "choices": [] if usage else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


CHAT_STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "call_9", "type": "function", "function": {"name": "get_weather"}}
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Lyon"}'}}]}),
    _chunk({}, finish="tool_calls"),
    _chunk({}, usage={"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49}),
    b"data: [DONE]\n\n",
]
ANSWERS = {("/v1/chat/completions", False): CHAT_ANSWER, ("/v1/chat/completions", True): CHAT_STREAM}


class Sent:
    """The bodies the official client puts on the wire, as httpx sends them."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def __call__(self, request: httpx.Request) -> None:
        self.bodies.append(request.read())


def client_for(gateway: RunningGateway, sent: Sent) -> openai.OpenAI:
    http = httpx.Client(event_hooks={"request": [sent]})
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, http_client=http)


@pytest.fixture
def fleet(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> tuple[RecordingBackend, RunningGateway]:
    backend, url = recording_backend("b0", answers=ANSWERS)
    return backend, start_gateway([url], models={MODEL: {"tokenizer": "default"}})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_chat_requests_reach_the_backend_byte_for_byte_and_come_back_unchanged(
    fleet: tuple[RecordingBackend, RunningGateway], scenario: str, stream: bool
) -> None:
    backend, gateway = fleet
    sent = Sent()
    client = client_for(gateway, sent)
    kwargs = {"model": MODEL, **SCENARIOS[scenario]}
    if stream:
        kwargs |= {"stream": True, "stream_options": {"include_usage": True}}
        with client.chat.completions.with_streaming_response.create(**kwargs) as response:
            received = b"".join(response.iter_bytes())
            replica = response.headers["x-prefixgate-replica"]
        assert received == b"".join(CHAT_STREAM)
    else:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        assert raw.http_response.content == CHAT_ANSWER
        replica = raw.headers["x-prefixgate-replica"]
        parsed = raw.parse()
        assert [c.index for c in parsed.choices] == [0, 1, 2]
        assert parsed.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert replica == gateway.state.replicas.all()[0].id
    assert len(backend.received) == 1
    got = backend.received[0]
    assert (got.method, got.target) == ("POST", "/v1/chat/completions")
    assert got.body == sent.bodies[-1], "the body must reach the backend byte for byte"
    # The client's own headers travel with it; its key does not (auth.forward_client_key is off).
    assert got.headers.get("X-Stainless-Lang") == "python"
    assert "Authorization" not in got.headers
    assert json.loads(got.body)["model"] == MODEL


def test_the_parsed_stream_carries_the_tool_call(fleet: tuple[RecordingBackend, RunningGateway]) -> None:
    _, gateway = fleet
    client = client_for(gateway, Sent())
    stream = client.chat.completions.create(
        model=MODEL, messages=TOOL_HISTORY, tools=[WEATHER_TOOL], stream=True
    )
    arguments = "".join(
        call.function.arguments or ""
        for chunk in stream
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
    )
    assert json.loads(arguments) == {"city": "Lyon"}


def test_backend_errors_come_back_as_the_backend_sent_them(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    error = b'{"object":"error","message":"guided_json is malformed","type":"BadRequestError","code":400}'
    backend, url = recording_backend("b0", answers={("/v1/chat/completions", False): error})
    backend.status = 400
    gateway = start_gateway([url], models={MODEL: {"tokenizer": "default"}})
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": MODEL, "messages": USER, "guided_json": 5}
    )
    assert response.status_code == 400
    assert response.content == error


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
        (
            "/v1/chat/completions",
            json.dumps({"model": "other-m", "messages": USER}).encode(),
            404,
            "model_not_found",
        ),
        ("/v1/chat/completions", json.dumps({"model": 7, "messages": USER}).encode(), 400, "invalid_value"),
        ("/v1/embeddings", b"nope", 400, "invalid_json"),
    ],
)
def test_the_gateway_refuses_only_what_it_must_judge(
    fleet: tuple[RecordingBackend, RunningGateway], path: str, body: bytes, status: int, code: str
) -> None:
    backend, gateway = fleet
    response = httpx.post(f"{gateway.url}{path}", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert backend.received == [], "a request the gateway refused never reaches a replica"


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "messages": "not a list"},
        {"model": MODEL, "messages": [{"role": "robot", "content": 5}]},
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
        {"model": MODEL, "messages": USER, "n": 500, "temperature": "hot", "best_of": 9},
        {"model": MODEL},
    ],
)
def test_what_only_the_backend_can_judge_is_passed_to_it(
    fleet: tuple[RecordingBackend, RunningGateway], body: dict[str, Any]
) -> None:
    backend, gateway = fleet
    raw = json.dumps(body).encode()
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200
    assert backend.received[-1].body == raw


def test_other_routes_pass_through_by_load(fleet: tuple[RecordingBackend, RunningGateway]) -> None:
    backend, gateway = fleet
    client = client_for(gateway, Sent())
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=["a", "b"])
    assert json.loads(raw.http_response.content) == {
        "backend": "b0",
        "path": "/v1/embeddings",
        "method": "POST",
    }
    listed = httpx.get(f"{gateway.url}/v1/files?purpose=batch&limit=3")
    assert listed.json() == {"backend": "b0", "path": "/v1/files", "method": "GET"}
    assert backend.received[-1].target == "/v1/files?purpose=batch&limit=3"
    for path in ("/tokenize", "/detokenize", "/v1/score", "/rerank"):
        answer = httpx.post(f"{gateway.url}{path}", json={"model": MODEL, "prompt": "hi", "tokens": [1, 2]})
        assert answer.json()["path"] == path
    deleted = httpx.delete(f"{gateway.url}/v1/files/file-123")
    assert deleted.json() == {"backend": "b0", "path": "/v1/files/file-123", "method": "DELETE"}
    # A body that is not JSON (a file upload) on a route the gateway does not read is passed on as is.
    upload = httpx.post(
        f"{gateway.url}/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"}
    )
    assert upload.status_code == 200
    assert backend.received[-1].headers["Content-Type"].startswith("multipart/form-data")
    assert b'name="purpose"' in backend.received[-1].body
    assert [m.id for m in client.models.list().data] == [MODEL]
