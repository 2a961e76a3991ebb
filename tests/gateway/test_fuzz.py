"""Bad input against a live gateway over HTTP: schemathesis drives every route of /openapi.json with
valid and invalid data, and hypothesis throws arbitrary bytes and JSON at the generation endpoints.

Whatever arrives: never a 5xx, never a hang, every refusal in OpenAI's error shape, every answer as
the document describes it. Generated requests that are valid are kept short (max_tokens clamped) so
the simulated workers answer in milliseconds.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from gateway.http.openapi import OPENAPI
from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker, assert_openai_error

pytestmark = pytest.mark.fuzz

# Requests that reach a worker generate at most this many tokens.
MAX_TOKENS = 4
# Any answer slower than this is a hang.
TIMEOUT_S = 20.0
# PREFIXGATE_FUZZ_SCALE=10 runs ten times the examples; PREFIXGATE_FUZZ_RANDOM=1 draws new ones each
# run instead of the same (derandomized) ones, for a deeper search than CI's.
SCALE = float(os.environ.get("PREFIXGATE_FUZZ_SCALE", "1"))
SCHEMA_EXAMPLES = max(1, int(80 * SCALE))
RAW_EXAMPLES = max(1, int(250 * SCALE))
SETTINGS = {
    "deadline": None,
    "database": None,
    "derandomize": os.environ.get("PREFIXGATE_FUZZ_RANDOM") != "1",
    "suppress_health_check": list(HealthCheck),
}
OPERATIONS = [(method.upper(), path) for path, item in OPENAPI["paths"].items() for method in item]
GENERATION = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture
def gateway(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> Iterator[RunningGateway]:
    workers = [start_sim_worker(f"w{i}") for i in range(2)]
    yield start_gateway([w.url for w in workers], model=SIM_MODEL)


@schemathesis.check
def openai_error_format(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """Every non-2xx answer is OpenAI's error JSON."""
    if response.status_code >= 300:
        assert_openai_error(response.status_code, response.content, f"{case.method} {case.path}")
    return None


def _clamped(body: Any) -> Any:
    """The body to send, with any valid max_tokens above MAX_TOKENS lowered to it, and MAX_TOKENS set
    where the request names none (the chat default is "all that fits": thousands of simulated tokens).
    A body that was invalid stays invalid: only integers that were valid change, and only to valid."""
    if isinstance(body, dict):
        names = ("max_completion_tokens", "max_tokens")
        for name in names:
            if type(body.get(name)) is int and body[name] > MAX_TOKENS:
                body[name] = MAX_TOKENS
        if all(body.get(name) is None for name in names):
            body["max_tokens"] = MAX_TOKENS
    return body


def _small(case: schemathesis.Case) -> schemathesis.Case:
    if case.path in GENERATION:
        _clamped(case.body)
    return case


CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
    schemathesis.checks.response_headers_conformance,
    openai_error_format,
]


def _has_input(method: str, path: str) -> bool:
    operation = OPENAPI["paths"][path][method.lower()]
    # A path parameter that is any string has no invalid value.
    query = [p for p in operation.get("parameters", []) if p["in"] == "query"]
    return "requestBody" in operation or bool(query)


# Every operation with valid data; those that take a body or a query with invalid data too.
RUNS = [
    (method, path, mode)
    for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or _has_input(method, path)
]


@pytest.mark.parametrize(("method", "path", "mode"), RUNS, ids=[f"{m} {p} {g.value}" for m, p, g in RUNS])
def test_schemathesis(gateway: RunningGateway, method: str, path: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=mode).map(_small)
    checks = [*CHECKS]
    if mode is GenerationMode.NEGATIVE:
        checks.append(schemathesis.checks.negative_data_rejection)

    @settings(max_examples=SCHEMA_EXAMPLES, **SETTINGS)
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=gateway.url, timeout=TIMEOUT_S)
        case.validate_response(response, checks=checks)

    run()
    # Whatever came before, both replicas still serve (the ids generated for drain and delete are
    # never theirs).
    health = httpx.get(f"{gateway.url}/health", timeout=5)
    assert health.status_code == 200 and health.json()["replicas"]["routable"] == 2


# -- hypothesis: whatever a client may send, not what the document says ------------------------------

# Small enough that oversized bodies cost little to generate and send.
BODY_LIMIT = 64 * 1024
BODY_TIMEOUT_S = 1.0
FIELDS = sorted(
    set(OPENAPI["components"]["schemas"]["CompletionRequest"]["properties"])
    | set(OPENAPI["components"]["schemas"]["ChatRequest"]["properties"])
)
VALID = {
    "/v1/completions": {"model": SIM_MODEL, "prompt": "Once upon a time", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.sampled_from(["NaN", "Infinity", "-Infinity", "", "0", "1e400", "\x00", "\ufeff", "🦙" * 50])
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=25,
)
token_lists = st.lists(st.integers(min_value=-5, max_value=2**33), max_size=40)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with fields replaced, added or removed: wrong types, huge numbers, odd unicode."""
    body = dict(VALID[draw(st.sampled_from(GENERATION))])
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(FIELDS) | st.text(max_size=8))
        action = draw(st.sampled_from(["set", "set", "tokens", "delete"]))
        if action == "delete":
            body.pop(name, None)
        else:
            body[name] = draw(json_values if action == "set" else token_lists)
    return body


def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(str.encode),
    st.tuples(st.text(max_size=60), st.sampled_from(["utf-8", "utf-16", "utf-32", "latin-1"])).map(
        lambda t: json.dumps({"prompt": t[0]}, ensure_ascii=False).encode(t[1], "replace")
    ),
    st.integers(1, 5000).map(_nested),
    st.integers(4000, 6000).map(lambda n: b'{"prompt": "x", "max_tokens": 1' + b"0" * n + b"}"),
    st.sampled_from(
        [
            b'{"prompt": "x", "temperature": NaN}',
            b'{"prompt": "x", "temperature": Infinity}',
            b'{"prompt": "x", "top_p": 1e400}',
            b'{"prompt": "\\udc00"}',
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            b'{"prompt": "x"',
            b"null",
            b"",
            b"\xef\xbb\xbf{}",
        ]
    ),
    st.integers(BODY_LIMIT + 1, 4 * BODY_LIMIT).map(lambda n: b'{"prompt": "' + b"a" * n + b'"}'),
)


@pytest.fixture
def small_gateway(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> Iterator[RunningGateway]:
    workers = [start_sim_worker(f"w{i}") for i in range(2)]
    limits = {"max_body_bytes": BODY_LIMIT, "body_timeout_s": BODY_TIMEOUT_S}
    yield start_gateway([w.url for w in workers], model=SIM_MODEL, limits=limits)


def post_and_check(
    client: httpx.Client, path: str, content: bytes, headers: dict[str, str] | None = None
) -> int:
    where = f"POST {path} {content[:200]!r}"
    try:
        response = client.post(path, content=content, headers=headers or {"Content-Type": "application/json"})
    except httpx.TimeoutException:
        raise AssertionError(f"{where}: no answer in {TIMEOUT_S} s") from None
    if response.status_code >= 300:
        assert_openai_error(response.status_code, response.content, where)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), f"{where}: {response.text[-300:]!r}"
    else:
        assert "choices" in response.json(), f"{where}: {response.text[:300]}"
    return response.status_code


def _encode(body: Any) -> bytes:
    # allow_nan: the client side may well send NaN; the gateway must refuse it, not choke on it.
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


def test_arbitrary_json_values(small_gateway: RunningGateway) -> None:
    with httpx.Client(base_url=small_gateway.url, timeout=TIMEOUT_S) as client:

        @settings(max_examples=RAW_EXAMPLES, **SETTINGS)
        @given(path=st.sampled_from(GENERATION), body=json_values)
        def run(path: str, body: Any) -> None:
            post_and_check(client, path, _encode(_clamped(body)))

        run()


def test_valid_bodies_with_wrong_fields(small_gateway: RunningGateway) -> None:
    statuses: set[int] = set()
    with httpx.Client(base_url=small_gateway.url, timeout=TIMEOUT_S) as client:

        @settings(max_examples=RAW_EXAMPLES, **SETTINGS)
        @given(path=st.sampled_from(GENERATION), body=mutated_bodies(), stream=st.booleans())
        def run(path: str, body: dict[str, Any], stream: bool) -> None:
            if stream and "stream" not in body:
                body["stream"] = True
            statuses.add(post_and_check(client, path, _encode(_clamped(body))))

        run()
    # The mutations are mild enough that some requests still go through, and others are refused.
    assert 200 in statuses and 400 in statuses, statuses


def test_bytes_that_are_not_a_json_object(small_gateway: RunningGateway) -> None:
    with httpx.Client(base_url=small_gateway.url, timeout=TIMEOUT_S) as client:

        @settings(max_examples=RAW_EXAMPLES, **SETTINGS)
        @given(path=st.sampled_from(GENERATION), content=raw_bodies)
        def run(path: str, content: bytes) -> None:
            post_and_check(client, path, content)

        run()


@pytest.mark.parametrize("path", GENERATION)
def test_bodies_the_http_layer_must_refuse(small_gateway: RunningGateway, path: str) -> None:
    """Corrupt compressed bodies, an oversized body, and a compression bomb: 4xx in OpenAI's shape."""
    import gzip
    import zlib

    valid = json.dumps(VALID[path]).encode()
    with httpx.Client(base_url=small_gateway.url, timeout=TIMEOUT_S) as client:
        for encoding, content in (
            ("gzip", b"not gzip at all"),
            ("gzip", gzip.compress(valid)[:12] + b"\xff" * 8 + gzip.compress(valid)[20:]),
            ("deflate", b"\x00\x01garbage"),
            ("gzip", gzip.compress(b" " * (BODY_LIMIT * 64))),
        ):
            # A body that cannot be read cannot be drained either: the server closes the connection.
            headers = {
                "Content-Type": "application/json",
                "Content-Encoding": encoding,
                "Connection": "close",
            }
            status = post_and_check(client, path, content, headers)
            assert 400 <= status < 500, (encoding, content[:20], status)
        ok = post_and_check(client, path, gzip.compress(valid), {"Content-Encoding": "gzip"})
        assert ok == 200 and zlib.decompress(zlib.compress(valid)) == valid
        big = post_and_check(client, path, b'{"prompt": "' + b"x" * (BODY_LIMIT + 1) + b'"}')
        assert big == 413
        # A coding the gateway does not decode is refused, not read as if there were none.
        for encoding in ("compress", "x-gzip2", "gzip, gzip"):
            refused = post_and_check(client, path, valid, {"Content-Encoding": encoding})
            assert refused == 415, encoding


@pytest.mark.parametrize("sent", [0, 40])
def test_a_body_that_never_arrives_is_refused_in_time(small_gateway: RunningGateway, sent: int) -> None:
    """Content-Length promises more than is sent: 408 in OpenAI's shape once body_timeout_s has
    passed, rather than a connection and an in-flight slot held for ever."""
    body = json.dumps(VALID["/v1/completions"]).encode()
    host, port = small_gateway.url.removeprefix("http://").split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) + 100}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        started = time.monotonic()
        sock.sendall(head + body[:sent])
        reply = sock.recv(65536)
        waited = time.monotonic() - started
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 408 Request Timeout"
    assert_openai_error(408, rest.partition(b"\r\n\r\n")[2], "truncated body")
    assert BODY_TIMEOUT_S - 0.1 < waited < BODY_TIMEOUT_S + 2
    assert small_gateway.state.inflight == 0


def test_the_fleet_still_serves_after_the_abuse(small_gateway: RunningGateway) -> None:
    """The last word: after a burst of garbage and of clients that leave mid-request, the workers'
    engines still run and the gateway still routes (nothing leaked into a broken state)."""
    with httpx.Client(base_url=small_gateway.url, timeout=TIMEOUT_S) as client:
        for path in GENERATION:
            for content in (b"{", b"[]", _nested(4000), b'{"prompt": "\\udc00"}'):
                post_and_check(client, path, content)
    # Clients that give up before the answer: the gateway and the workers must shrug them off.
    slow = {**VALID["/v1/completions"], "max_tokens": 200, "ignore_eos": True}
    for _ in range(10):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{small_gateway.url}/v1/completions", json=slow, timeout=0.02)
    with httpx.Client(base_url=small_gateway.url, timeout=TIMEOUT_S) as client:
        for path in GENERATION:
            for _ in range(4):
                assert post_and_check(client, path, json.dumps(VALID[path]).encode()) == 200
