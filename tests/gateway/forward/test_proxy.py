"""The forward path's parts (gateway.forward.proxy), one at a time: which replica continues a broken
stream (_successor), the id read from a Responses body (sse_events.response_body_id), the head of a
stream held back until it carries output (_until_output), what a relayed stream's chunks pass through
(_Relay.watch), and the order in which `forward` tries replicas and what the client gets when they fail.

The end-to-end tests (tests/gateway, tests/faults) drive these through routed requests, where the
policy picks the order; here the order is chosen by the test, so each branch of the retry loop is
reached on purpose. `forward` runs on a real gateway's loop, against replicas served over loopback
HTTP (tests.support.gateways.foreign_backend), each answering as its script says; the pure parts run
in-process with no server.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.fleet.replicas import Replica
from gateway.fleet.response_owners import ResponseOwners
from gateway.forward.outcome import TAIL_BYTES
from gateway.forward.proxy import _Attempt, _Relay, _Stream, _successor, _until_output, forward
from gateway.forward.routed import Routed
from gateway.forward.sse_events import ResponseIdScan, UsageStrip, response_body_id
from gateway.forward.upstream import UpstreamResponse
from gateway.gateway_config import parse_config
from gateway.gateway_state import GatewayState
from policies.view import ReplicaView
from protocol.errors import ApiError
from tests.support.gateways import RunningGateway, foreign_backend
from tests.support.raw_replicas import MODEL, gateway_for
from tests.support.replicas import replica, routed
from tests.support.servers import ServerThread

# -- the object the proxy's functions take ----------------------------------------------------------


def state_of(running: RunningGateway) -> GatewayState:
    """What `forward` is given by a running gateway's handlers."""
    return running.state


def bare_state(*replicas: Replica) -> GatewayState:
    """The same object with no server, no loop and no I/O behind it, holding `replicas`."""
    state = GatewayState(parse_config({}), "test-proxy")
    for r in replicas:
        state.replicas.add(r)
    return state


def metric(state: GatewayState, name: str, **labels: str) -> float | None:
    """A sample of the state's metrics (None: never counted)."""
    return state.metrics.registry.get_sample_value(name, labels)


# -- _successor ---------------------------------------------------------------------------------------


def decided(order: list[str], body: dict[str, Any] | None = None, **kwargs: Any) -> Routed:
    """A request (a chat one for model "m", tests.support.replicas, unless said otherwise) that the
    policy ranked in `order`."""
    views = [ReplicaView(id=rid) for rid in order]
    return routed(body if body is not None else {"messages": []}, views=views, **kwargs)


def test_a_stream_continues_on_the_next_replica_in_the_routing_order() -> None:
    # "b" would come first among the model's replicas (by id); the routing order says "d".
    state = bare_state(*(replica(rid) for rid in "abcd"))
    chosen = _successor(state, decided(["a", "d", "b"]), {"a"}, "bundled")
    assert chosen is not None and chosen.id == "d"


def test_past_the_routing_order_any_other_replica_of_the_model_continues_it() -> None:
    """The model's replicas the policy left out of the order, never another model's."""
    state = bare_state(replica("a"), replica("0-other-model", model="other"), replica("z"))
    chosen = _successor(state, decided(["a"]), {"a"}, "bundled")
    assert chosen is not None and chosen.id == "z"


@pytest.mark.parametrize(
    "unfit",
    [
        {"tried": True},
        {"healthy": False},
        {"draining": True},
        {"kind": "openai"},
        {"role": "prefill"},
    ],
    ids=["tried", "unhealthy", "draining", "another-kind", "prefill"],
)
def test_a_replica_that_cannot_continue_the_stream_is_passed_over(unfit: dict[str, Any]) -> None:
    tried = {"a", "b"} if unfit.pop("tried", False) else {"a"}
    state = bare_state(replica("a"), replica("b", **unfit), replica("c"))
    chosen = _successor(state, decided(["a", "b", "c"]), tried, "bundled")
    assert chosen is not None and chosen.id == "c"


def test_a_foreign_stream_continues_only_on_a_mixed_replica_a_bundled_one_on_a_decode_one_too() -> None:
    """A foreign decode replica answers only with its prefill pair's KV; a bundled one computes what it
    lacks itself."""
    foreign = bare_state(
        replica("a", kind="openai"), replica("b", kind="openai", role="decode"), replica("c", kind="openai")
    )
    chosen = _successor(foreign, decided(["a", "b", "c"]), {"a"}, "openai")
    assert chosen is not None and chosen.id == "c"
    bundled = bare_state(replica("a"), replica("b", role="decode"), replica("c"))
    chosen = _successor(bundled, decided(["a", "b", "c"]), {"a"}, "bundled")
    assert chosen is not None and chosen.id == "b"


def test_a_replica_gone_since_the_decision_is_skipped_and_none_is_left_when_all_were_tried() -> None:
    state = bare_state(replica("a"), replica("b"))
    chosen = _successor(state, decided(["a", "gone", "b"]), {"a"}, "bundled")
    assert chosen is not None and chosen.id == "b"
    assert _successor(state, decided(["a", "gone", "b"]), {"a", "b"}, "bundled") is None


# -- response_body_id --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"id": "resp_1", "object": "response", "output": []}', "resp_1"),
        (b'{"object": "response", "id": "resp_\\u00e9"}', "resp_\u00e9"),
        (b"not json", None),
        (b"", None),
        (b'{"id": "resp_1"', None),
        (b'["resp_1"]', None),
        (b'"resp_1"', None),
        (b"null", None),
        (b'{"object": "response"}', None),
        (b'{"id": ""}', None),
        (b'{"id": 7}', None),
        (b'{"id": null}', None),
        (b'{"id": {"id": "resp_1"}}', None),
    ],
)
def test_a_responses_body_names_its_id_and_anything_else_names_none(
    body: bytes, expected: str | None
) -> None:
    assert response_body_id(body) == expected


# -- _until_output --------------------------------------------------------------------------------------


def sse(payload: Any) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else orjson.dumps(payload)) + b"\n\n"


def delta(**fields: Any) -> bytes:
    return sse(
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": fields, "finish_reason": None}]}
    )


ROLE = delta(role="assistant", content="")
HELLO = delta(content="Hello")
WORLD = delta(content=" world")


class _Line:
    """The connection an UpstreamResponse is read from, as far as these tests need one: nothing."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def idle(self) -> None: ...

    def close(self) -> None: ...


async def held(chunks: list[bytes], *, ends: bool = True) -> tuple[bytes, bytes]:
    """What _until_output holds of a real UpstreamResponse whose body arrives as `chunks`, one per
    read (and then ends, if `ends`), and what was left unread after it."""
    upstream = UpstreamResponse(_Line(), asyncio.get_running_loop(), read_s=10.0)
    upstream.on_head(200, [("Content-Type", "text/event-stream")])

    async def arrive() -> None:
        for data in chunks:
            upstream.on_body(data)
            await asyncio.sleep(0)  # the reader takes it before the next arrives
        if ends:
            upstream.on_end(keep_alive=True)

    arriving = asyncio.ensure_future(arrive())
    try:
        first = await asyncio.wait_for(_until_output(upstream), 5)
        await arriving
        rest = b"" if upstream.at_end else await upstream.read_chunk()
        return first, rest
    finally:
        upstream.release()


def test_a_streams_opening_events_are_held_until_the_first_that_carries_output() -> None:
    first, rest = asyncio.run(held([ROLE, b": keep-alive\n\n", HELLO, WORLD]))
    assert (first, rest) == (ROLE + b": keep-alive\n\n" + HELLO, WORLD)


def test_output_in_the_first_chunk_is_let_go_at_once() -> None:
    first, rest = asyncio.run(held([ROLE + HELLO, WORLD]))
    assert (first, rest) == (ROLE + HELLO, WORLD)


def test_an_output_event_cut_across_chunks_is_held_until_it_is_whole() -> None:
    cut = len(HELLO) // 2
    first, rest = asyncio.run(held([ROLE + HELLO[:cut], HELLO[cut:], WORLD]))
    assert (first, rest) == (ROLE + HELLO, WORLD)


def test_a_stream_that_ends_before_any_output_is_held_whole() -> None:
    first, rest = asyncio.run(held([ROLE, b": keep-alive\n\n"]))
    assert (first, rest) == (ROLE + b": keep-alive\n\n", b"")


def test_an_empty_stream_is_held_as_nothing() -> None:
    assert asyncio.run(held([])) == (b"", b"")


# -- _Relay.watch ---------------------------------------------------------------------------------------


def relay(state: GatewayState, *, strip: bool = False, scan: bool = False, answering: str = "a") -> _Relay:
    """A relay of one stream, routed to every replica of `state` in id order and answered by
    `answering` (the first choice, or one tried after it), none of its chunks sent yet."""
    answerer = state.replicas.get(answering)
    assert answerer is not None
    order = [r.id for r in state.replicas.all()]
    return _Relay(
        state,
        decided(order, route="responses" if scan else "chat"),
        web.StreamResponse(),
        _Attempt(answerer, 1, None),
        UsageStrip() if strip else None,
        None,
        None,
        ResponseIdScan() if scan else None,
    )


def test_a_relayed_streams_head_goes_out_with_its_first_chunk() -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        response = _Stream(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.4)
        await response.write(b"data: one\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", stream)
    server = ServerThread(app)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as client:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            client.settimeout(0.2)
            with pytest.raises(TimeoutError):  # prepared, but nothing sent until there is a chunk
                client.recv(65536)
            client.settimeout(5)
            first = client.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK") and b"data: one" in first
    finally:
        server.stop()


def test_the_tail_kept_of_a_stream_is_its_last_tail_bytes() -> None:
    watching = relay(bare_state(replica("a")))
    chunks = [bytes([ord("a") + i]) * (TAIL_BYTES // 2 + 100) for i in range(3)]
    assert watching.watch(chunks[0]) == chunks[0]
    assert watching.tail == chunks[0]  # shorter than the bound: all of it
    for data in chunks[1:]:
        assert watching.watch(data) == data  # nothing asked of it: passed as it came
    assert watching.tail == b"".join(chunks)[-TAIL_BYTES:]


USAGE_ONLY = sse(
    {
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": 32,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
    }
)


def test_a_usage_event_the_client_did_not_ask_for_is_left_out_but_kept_in_the_tail() -> None:
    """Left out of what the client gets; read from the tail for what the replica cached."""
    watching = relay(bare_state(replica("a")), strip=True)
    stream = HELLO + USAGE_ONLY + sse(b"[DONE]")
    cut = len(HELLO) + len(USAGE_ONLY) // 2  # the usage event split across two reads
    sent = watching.watch(stream[:cut]) + watching.watch(stream[cut:])
    assert sent == HELLO + sse(b"[DONE]")
    assert watching.tail == stream


def test_a_usage_event_the_client_asked_for_passes_as_it_came() -> None:
    watching = relay(bare_state(replica("a")))
    stream = HELLO + USAGE_ONLY + sse(b"[DONE]")
    assert watching.watch(stream) == stream


def responses_event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\n" + sse({"type": kind, **fields})


def test_the_response_id_a_stream_names_is_remembered_once_with_the_replica_answering() -> None:
    async def watched() -> tuple[list[str | None], int]:
        state = bare_state(replica("a"), replica("b"))
        state.response_owners = ResponseOwners(ttl_s=60, max_entries=10)
        watching = relay(state, scan=True, answering="b")  # "a", the first choice, refused
        created = responses_event("response.created", response={"id": "resp_7", "status": "in_progress"})
        completed = responses_event("response.completed", response={"id": "resp_7", "status": "completed"})
        delta = responses_event("response.output_text.delta", delta="hi")
        cut = len(created) // 2  # the id's event split across two reads
        for data in (created[:cut], created[cut:], delta, completed):
            assert watching.watch(data) == data
        await asyncio.gather(*watching.remembered)
        owners = [await state.response_owners.owner(rid) for rid in ("resp_7", "resp_8")]
        return owners, len(watching.remembered)

    owners, remembered = asyncio.run(watched())
    assert owners == ["b", None]
    assert remembered == 1  # found once: the completed event's id is not looked for


def test_a_stream_that_is_not_a_responses_one_remembers_nothing() -> None:
    state = bare_state(replica("a"))
    watching = relay(state)
    created = responses_event("response.created", response={"id": "resp_7"})
    assert watching.watch(created) == created
    assert watching.remembered == []


# -- forward: no replica ----------------------------------------------------------------------------------


@pytest.mark.parametrize("order", [[], ["gone"]], ids=["empty-order", "replica-gone"])
def test_no_replica_left_in_the_order_is_503_no_replica_available_with_retry_after(order: list[str]) -> None:
    """Refused before anything is sent: nothing to try (the one chosen may have left since)."""
    state = bare_state(replica("a", healthy=False))

    async def forwarded() -> web.StreamResponse:
        return await forward(state, make_mocked_request("POST", "/v1/chat/completions"), decided(order))

    with pytest.raises(ApiError) as refused:
        asyncio.run(forwarded())
    error = refused.value
    assert (error.status, error.code, error.headers) == (503, "no_replica_available", {"Retry-After": "1"})
    assert "no healthy replica serves 'm'" in error.message


# -- forward: the retry order, against replicas over loopback HTTP ----------------------------------------


@dataclass(frozen=True)
class Answer:
    """How a scripted replica answers a completion: `status` (a completion naming the replica when
    200, an error otherwise), with `headers`, after `delay_s`."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


REFUSE_429 = Answer(429, {"Retry-After": "7"})
REFUSE_503 = Answer(503, {"Retry-After": "3"})
SERVE = Answer()
SILENT = Answer(delay_s=3.0)


@dataclass
class Scripted:
    """A foreign replica that gives `answer` to every completion, counting them. `reachable=False`:
    it is up while the gateway discovers it, then stopped (its port refuses connections)."""

    name: str
    answer: Answer = SERVE
    reachable: bool = True
    received: int = 0
    url: str = ""
    id: str = ""

    async def complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.received += 1
        answer = self.answer
        if answer.delay_s:
            await asyncio.sleep(answer.delay_s)
        if answer.status == 200:
            body: dict[str, Any] = {"object": "text_completion", "choices": [{"index": 0, "text": self.name}]}
        else:
            body = {"error": {"message": f"{self.name} says {answer.status}", "type": "overloaded"}}
        return web.json_response(body, status=answer.status, headers=answer.headers)


Fleet = Callable[..., RunningGateway]


@pytest.fixture
def fleet(start_gateway: Callable[..., RunningGateway]) -> Iterator[Fleet]:
    """A gateway in front of scripted replicas (`fleet(*replicas, **limits)`), each replica's `id`
    filled in as the gateway knows it."""
    with ExitStack() as stack:

        def start(*replicas: Scripted, **limits: Any) -> RunningGateway:
            servers = {}
            for r in replicas:
                servers[r.name] = stack.enter_context(ExitStack())
                r.url = servers[r.name].enter_context(foreign_backend(MODEL, r.complete))
            gateway = gateway_for(start_gateway, [r.url for r in replicas], **limits)
            for r in replicas:
                known = state_of(gateway).replicas.by_url(r.url)
                assert known is not None, f"{r.name} was not discovered"
                r.id = known.id
                if not r.reachable:
                    servers[r.name].close()
            return gateway

        yield start


def forwarded(gateway: RunningGateway, *order: Scripted) -> web.Response:
    """`forward` of one completion the policy ranked `order`, on the gateway's own loop (where its
    state and upstream connections live); raises the ApiError the client would get."""
    state = state_of(gateway)
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 1}
    request = decided(
        [r.id for r in order],
        body,
        route="completions",
        model=MODEL,
        target="/v1/completions",
        raw=orjson.dumps(body),
        arrival=time.monotonic(),
    )

    async def go() -> web.StreamResponse:
        # The client's request is only read if the client leaves: this one stays.
        return await forward(state, make_mocked_request("POST", "/v1/completions"), request)

    response = asyncio.run_coroutine_threadsafe(go(), gateway.server.loop).result(15)
    assert isinstance(response, web.Response)
    return response


def served_by(response: web.Response) -> str:
    assert response.body is not None
    return orjson.loads(response.body)["choices"][0]["text"]


def retries(state: GatewayState, reason: str) -> float | None:
    return metric(state, "prefixgate_gateway_retries_total", model=MODEL, reason=reason)


def upstream_errors(state: GatewayState, replica: Scripted, kind: str) -> float | None:
    return metric(state, "prefixgate_gateway_upstream_errors_total", replica=replica.id, kind=kind)


def requests(state: GatewayState, replica_id: str, status: int) -> float | None:
    labels = {"model": MODEL, "replica": replica_id, "policy": "prefix_aware", "route": "completions"}
    return metric(state, "prefixgate_gateway_requests_total", status=str(status), **labels)


def test_a_refusal_is_retried_on_the_next_replica_and_counted_as_a_retry(fleet: Fleet) -> None:
    full, free = Scripted("full", REFUSE_429), Scripted("free")
    gateway = fleet(full, free)
    state = state_of(gateway)
    response = forwarded(gateway, full, free)
    assert (response.status, served_by(response)) == (200, "free")
    assert response.headers["x-prefixgate-replica"] == free.id
    assert (full.received, free.received) == (1, 1)
    assert retries(state, "http_429") == 1
    assert upstream_errors(state, full, "http_429") == 1
    # Counted as answered by the one that served; the refusal is no request answered.
    assert (requests(state, free.id, 200), requests(state, full.id, 429)) == (1, None)
    # A refusal is an answer: the refusing replica is up, not failing; nothing is left in flight.
    for r in (full, free):
        known = state.replicas.get(r.id)
        assert known is not None and (known.failures, known.inflight) == (0, {})


def test_when_every_replica_refuses_the_client_gets_the_last_refusal_with_its_retry_after(
    fleet: Fleet,
) -> None:
    """The last choice's refusal is relayed as it came; only the refusals that led to another try are
    retries."""
    first, last = Scripted("first", REFUSE_429), Scripted("last", REFUSE_503)
    gateway = fleet(first, last)
    state = state_of(gateway)
    response = forwarded(gateway, first, last)
    assert (response.status, response.headers["Retry-After"]) == (503, "3")
    assert response.headers["x-prefixgate-replica"] == last.id
    assert response.body is not None and b"last says 503" in response.body
    assert (retries(state, "http_429"), retries(state, "http_503")) == (1, None)


def test_a_refusal_outranks_an_unreachable_last_choice_and_keeps_its_retry_after(fleet: Fleet) -> None:
    """The fleet is full, not broken: the client is told when to come back, not 502."""
    full, dead = Scripted("full", REFUSE_429), Scripted("dead", reachable=False)
    gateway = fleet(full, dead)
    state = state_of(gateway)
    with pytest.raises(ApiError) as refused:
        forwarded(gateway, full, dead)
    error = refused.value
    assert (error.status, error.code, error.headers) == (429, "queue_full", {"Retry-After": "7"})
    assert upstream_errors(state, dead, "connect_failed") == 1
    # Nothing came after the last choice: its failure is no retry.
    assert (retries(state, "http_429"), retries(state, "connect_failed")) == (1, None)


def test_a_replica_that_cannot_be_reached_is_passed_over_for_the_next(fleet: Fleet) -> None:
    dead, alive = Scripted("dead", reachable=False), Scripted("alive")
    gateway = fleet(dead, alive)
    state = state_of(gateway)
    response = forwarded(gateway, dead, alive)
    assert (response.status, served_by(response)) == (200, "alive")
    assert (retries(state, "connect_failed"), upstream_errors(state, dead, "connect_failed")) == (1, 1)
    unreachable = state.replicas.get(dead.id)
    assert unreachable is not None and unreachable.inflight == {}


def test_when_no_replica_can_be_reached_the_client_gets_502_naming_the_last(fleet: Fleet) -> None:
    one, other = Scripted("one", reachable=False), Scripted("other", reachable=False)
    gateway = fleet(one, other)
    with pytest.raises(ApiError) as failed:
        forwarded(gateway, one, other)
    error = failed.value
    assert (error.status, error.code) == (502, "upstream_unavailable")
    assert f"replica {other.id} could not be reached" in error.message
    assert retries(state_of(gateway), "connect_failed") == 1


def test_a_replica_silent_past_the_request_timeout_is_replaced(fleet: Fleet) -> None:
    silent, alive = Scripted("silent", SILENT), Scripted("alive")
    gateway = fleet(silent, alive, request_timeout_s=0.3)
    response = forwarded(gateway, silent, alive)
    assert (response.status, served_by(response)) == (200, "alive")
    assert retries(state_of(gateway), "timeout") == 1


def test_when_the_last_choice_timed_out_the_client_gets_504(fleet: Fleet) -> None:
    dead, silent = Scripted("dead", reachable=False), Scripted("silent", SILENT)
    gateway = fleet(dead, silent, request_timeout_s=0.3)
    with pytest.raises(ApiError) as failed:
        forwarded(gateway, dead, silent)
    error = failed.value
    assert (error.status, error.code) == (504, "upstream_timeout")
    assert "request_timeout_s 0.3" in error.message and f"replica {silent.id} gave no answer" in error.message


def test_no_more_than_max_attempts_replicas_are_tried(fleet: Fleet) -> None:
    """The order is cut at limits.max_attempts: the last one tried is the final choice, its refusal the
    answer, and a replica past the cut is never asked."""
    one, two, three = Scripted("one", REFUSE_429), Scripted("two", REFUSE_429), Scripted("three")
    gateway = fleet(one, two, three, max_attempts=2)
    response = forwarded(gateway, one, two, three)
    assert (response.status, response.headers["x-prefixgate-replica"]) == (429, two.id)
    assert (one.received, two.received, three.received) == (1, 1, 0)


def test_a_replica_gone_since_the_decision_takes_no_attempt(fleet: Fleet) -> None:
    """Ids that left the replica set are dropped before the order is cut at max_attempts."""
    gone, full, free = Scripted("gone"), Scripted("full", REFUSE_429), Scripted("free")
    gateway = fleet(full, free, max_attempts=2)
    gone.id = "gone:1"
    response = forwarded(gateway, gone, full, free)
    assert (response.status, served_by(response)) == (200, "free")
    assert (full.received, free.received) == (1, 1)


def test_a_server_error_is_the_answer_and_not_retried(fleet: Fleet) -> None:
    """Only a refusal (429, 503) or a failure to answer moves the request on: a 500 is the replica's
    answer, relayed as it came."""
    broken, free = Scripted("broken", Answer(500)), Scripted("free")
    gateway = fleet(broken, free)
    state = state_of(gateway)
    response = forwarded(gateway, broken, free)
    assert (response.status, response.headers["x-prefixgate-replica"]) == (500, broken.id)
    assert (broken.received, free.received) == (1, 0)
    assert retries(state, "http_500") is None
    assert requests(state, broken.id, 500) == 1
