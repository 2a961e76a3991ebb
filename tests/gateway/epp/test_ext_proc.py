"""The picker's ext_proc stream spoken to directly, as Envoy speaks it, over gRPC on loopback: the
headers phase's answer, the body sent back in chunks, and what it refuses and how."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

import grpc
import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from gateway.epp.endpoints import DESTINATION, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE
from gateway.epp.ext_proc import CHUNK_BYTES, body_replies, header_dict, subset_hint
from tests.support.gateways import SIM_MODEL, WORD_WORKER, SimWorker, foreign_entries


def _headers(path: str = "/v1/chat/completions", **extra: str) -> HeaderMap:
    pairs = {":method": "POST", ":path": path, "content-type": "application/json", **extra}
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def _request(
    body: bytes, *, chunks: int = 1, subset: list[str] | None = None, **headers: str
) -> list[pb.ProcessingRequest]:
    metadata = Metadata()
    if subset is not None:
        hint = Struct()
        hint.update({SUBSET_KEY: subset})
        metadata.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    messages = [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=_headers(**headers)), metadata_context=metadata
        )
    ]
    size = -(-len(body) // chunks)
    for k in range(chunks):
        part = body[k * size : (k + 1) * size]
        messages.append(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=part, end_of_stream=k == chunks - 1))
        )
    return messages


def _chat(content: str = "Which hammers are in stock?") -> bytes:
    return orjson.dumps({"model": SIM_MODEL, "messages": [{"role": "user", "content": content}]})


def _process(port: int, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """Send the request phase and read the picker's answers to it (Envoy then waits for the replica)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        replies = pb_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10)
        return list(replies)


def _destination(reply: pb.ProcessingResponse) -> str:
    return reply.request_headers.response.header_mutation.set_headers[0].header.raw_value.decode()


def _streamed(replies: list[pb.ProcessingResponse]) -> list[pb.StreamedBodyResponse]:
    return [r.request_body.response.body_mutation.streamed_response for r in replies]


def test_the_headers_phase_names_the_endpoints_and_the_body_comes_back_whole(
    start_sim_worker: Callable[..., SimWorker], start_gateway
) -> None:
    workers = [start_sim_worker(f"w{i}", *WORD_WORKER) for i in range(2)]
    picker = start_gateway([], picker=True, wait_for=2, replicas=foreign_entries(workers))
    body = _chat("screws " * 30_000)
    replies = _process(picker.grpc_port, _request(body, chunks=3))
    headers, *bodies = replies
    common = headers.request_headers.response
    assert common.clear_route_cache
    (option,) = common.header_mutation.set_headers
    assert option.header.key == DESTINATION
    endpoints = option.header.raw_value.decode().split(",")
    assert sorted(endpoints) == sorted(f"127.0.0.1:{w.port}" for w in workers), "first choice, then fallback"
    assert headers.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
        DESTINATION
    ].string_value == ",".join(endpoints)
    sent = [b.request_body.response.body_mutation.streamed_response for b in bodies]
    assert all(len(s.body) <= CHUNK_BYTES for s in sent)
    assert b"".join(s.body for s in sent) == body
    assert [s.end_of_stream for s in sent] == [False] * (len(sent) - 1) + [True]


def test_a_subset_hint_confines_the_choice_and_an_empty_one_is_a_503(
    start_sim_worker: Callable[..., SimWorker], start_gateway
) -> None:
    workers = [start_sim_worker(f"w{i}", *WORD_WORKER) for i in range(2)]
    picker = start_gateway([], picker=True, wait_for=2, replicas=foreign_entries(workers))
    allowed = f"127.0.0.1:{workers[1].port}"
    for _ in range(3):
        headers = _process(picker.grpc_port, _request(_chat(), subset=[allowed]))[0]
        assert (
            headers.request_headers.response.header_mutation.set_headers[0].header.raw_value
            == allowed.encode()
        )
    (refused,) = _process(picker.grpc_port, _request(_chat(), subset=["10.9.9.9:8000"]))
    assert refused.immediate_response.status.code == 503
    assert orjson.loads(refused.immediate_response.body)["error"]["code"] == "no_replica_available"


def test_what_the_picker_refuses_it_answers_itself(
    start_sim_worker: Callable[..., SimWorker], start_gateway
) -> None:
    worker = start_sim_worker("w0", *WORD_WORKER)
    entries = foreign_entries([worker])
    picker = start_gateway([], picker=True, wait_for=1, replicas=entries, limits={"max_body_bytes": 4096})
    cases = {
        400: _request(b"{not json"),
        404: _request(orjson.dumps({"model": "no-such-model", "messages": []})),
        413: _request(_chat("nails " * 2000), chunks=4),
    }
    for status, messages in cases.items():
        (reply,) = _process(picker.grpc_port, messages)
        answer = reply.immediate_response
        assert answer.status.code == status, answer.body
        assert "error" in orjson.loads(answer.body)
        assert (
            header_dict(HeaderMap(headers=[o.header for o in answer.headers.set_headers]))["content-type"]
            == "application/json"
        )
    assert picker.state.inflight == 0


def test_a_key_is_asked_for_where_the_gateway_has_keys(
    start_sim_worker: Callable[..., SimWorker], start_gateway, monkeypatch
) -> None:
    monkeypatch.setenv("EPP_TEST_KEYS", "k1")
    worker = start_sim_worker("w0", *WORD_WORKER)
    entries = foreign_entries([worker])
    keys = {"api_keys_env": "EPP_TEST_KEYS"}
    picker = start_gateway([], picker=True, wait_for=1, replicas=entries, auth=keys)
    (refused,) = _process(picker.grpc_port, _request(_chat()))
    assert refused.immediate_response.status.code == 401
    allowed = _process(picker.grpc_port, _request(_chat(), authorization="Bearer k1"))
    assert allowed[0].request_headers.response.header_mutation.set_headers


def test_past_the_in_flight_limit_the_picker_sheds_with_429(
    start_sim_worker: Callable[..., SimWorker], start_gateway
) -> None:
    worker = start_sim_worker("w0", *WORD_WORKER)
    entries = foreign_entries([worker])
    picker = start_gateway([], picker=True, wait_for=1, replicas=entries, limits={"max_inflight": 1})
    pending: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()

    def held() -> Iterator[pb.ProcessingRequest]:
        while (message := pending.get()) is not None:
            yield message

    with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        first = pb_grpc.ExternalProcessorStub(channel).Process(held(), timeout=20)
        for message in _request(_chat()):
            pending.put(message)
        assert next(first).request_headers.response.clear_route_cache, "the first request is admitted"
        (shed,) = _process(picker.grpc_port, _request(_chat()))
        assert shed.immediate_response.status.code == 429
        pending.put(None)
        list(first)
    assert picker.state.inflight == 0, "an exchange Envoy ended gives its place back"


def test_a_subset_hint_may_come_as_a_list_or_as_text() -> None:
    def hint(value: object) -> frozenset[str] | None:
        metadata = Metadata()
        struct = Struct()
        struct.update({SUBSET_KEY: value})
        metadata.filter_metadata[SUBSET_NAMESPACE].CopyFrom(struct)
        return subset_hint(metadata)

    assert subset_hint(Metadata()) is None
    assert hint(["10.0.0.1:80", "10.0.0.2:80"]) == {"10.0.0.1:80", "10.0.0.2:80"}
    assert hint("10.0.0.1:80, 10.0.0.2:80") == {"10.0.0.1:80", "10.0.0.2:80"}
    assert hint([]) == frozenset(), "an empty hint allows nothing"


def test_a_body_goes_back_in_chunks_under_envoys_limit() -> None:
    for size in (0, 1, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES + 7):
        raw = bytes(range(256)) * (size // 256) + bytes(size % 256)
        replies = body_replies("request_body", raw, last=True)
        sent = _streamed(replies)
        assert b"".join(s.body for s in sent) == raw
        assert all(len(s.body) <= CHUNK_BYTES for s in sent)
        assert [s.end_of_stream for s in sent][-1] and not any(s.end_of_stream for s in sent[:-1])
        assert not any(s.end_of_stream for s in _streamed(body_replies("request_body", raw, last=False)))


def test_header_values_keep_their_bytes_and_repeats_join() -> None:
    headers = HeaderMap(headers=[
        HeaderValue(key="X-Session", raw_value=b"\xff\xfeid"),
        HeaderValue(key="cookie", raw_value=b"a=1"),
        HeaderValue(key="Cookie", raw_value=b"b=2"),
        HeaderValue(key="x-old", value="text"),
    ])  # fmt: skip
    found = header_dict(headers)
    assert found["x-session"].encode("utf-8", "surrogateescape") == b"\xff\xfeid"
    assert found["cookie"] == "a=1,b=2"
    assert found["x-old"] == "text"
