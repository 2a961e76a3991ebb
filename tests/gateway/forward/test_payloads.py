"""What goes to a replica: the client's bytes unless the gateway must add to them, never a field of
the gateway's own from the client, and usage asked for only where it is learned from."""

from __future__ import annotations

from array import array

import orjson
import pytest

from gateway.forward.payloads import continuation, payload, reads_ids
from gateway.gateway_config import GatewayConfig
from protocol.errors import ApiError
from tests.support.replicas import MODEL, replica, routed

STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_a_foreign_replica_gets_the_clients_bytes_unchanged() -> None:
    # Key order and spacing the gateway would not write: any re-encoding would show.
    raw = b'{"stream": false,  "model": "m", "messages": []}'
    request = routed(orjson.loads(raw), raw=raw)
    sent, strip = payload(request, replica("a", kind="openai"), learns_usage=True)
    assert sent is raw
    assert strip is False


def test_a_bundled_worker_gets_the_gateways_token_ids() -> None:
    request = routed(STREAM, tokens=[5, 6, 7])
    sent, strip = payload(request, replica("a"), learns_usage=True)
    assert orjson.loads(sent) == {**STREAM, "prefixgate_token_ids": [5, 6, 7]}
    assert strip is False
    # Ids the gateway did not compute (the client sent token ids itself) are not attached.
    untokenized = routed(STREAM, tokens=[5, 6, 7], tokenized=False)
    assert payload(untokenized, replica("a"), learns_usage=True)[0] is untokenized.raw
    # Packed ids (a conversation turn from the prefix cache) go as the same JSON list.
    packed = routed(STREAM, tokens=array("I", [5, 6, 7]))
    sent = payload(packed, replica("a"), learns_usage=True)[0]
    assert orjson.loads(sent)["prefixgate_token_ids"] == [5, 6, 7]


def test_a_foreign_stream_asks_for_usage_only_where_it_is_learned_from() -> None:
    request = routed({**STREAM, "stream_options": {"continuous_usage_stats": False}})
    sent, strip = payload(request, replica("a", kind="openai"), learns_usage=True)
    assert orjson.loads(sent)["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert strip is True  # the client did not ask: the usage event is left out of its stream
    assert payload(request, replica("a", kind="openai"), learns_usage=False) == (request.raw, False)
    # A client that asked gets its usage, and nothing is stripped.
    asked = routed({**STREAM, "stream_options": {"include_usage": True}})
    assert payload(asked, replica("a", kind="openai"), learns_usage=True) == (asked.raw, False)
    # A paired decode replica gets the prefill side's fields, and no usage request.
    sent, strip = payload(request, replica("a", kind="openai"), True, {"kv_transfer_params": {"x": 1}})
    assert orjson.loads(sent)["kv_transfer_params"] == {"x": 1}
    assert "include_usage" not in orjson.loads(sent)["stream_options"]
    assert strip is False


def test_the_gateways_own_fields_are_not_the_clients_to_send() -> None:
    with pytest.raises(ApiError) as refused:
        payload(routed({**STREAM, "prefixgate_prefill": {}}), replica("a"), learns_usage=True)
    assert refused.value.status == 400
    # A pairing field of vLLM's is dropped, on a route with no token ids too.
    request = routed({"model": MODEL, "input": "x", "kv_transfer_params": {"remote": 1}}, route="embeddings")
    sent, strip = payload(request, replica("a", kind="openai"), learns_usage=True)
    assert orjson.loads(sent) == {"model": MODEL, "input": "x"}
    assert strip is False


def test_a_body_that_is_no_json_object_goes_as_it_came() -> None:
    request = routed(None, route="other", raw=b"--boundary\r\nfile")
    assert payload(request, replica("a"), learns_usage=True) == (b"--boundary\r\nfile", False)


def test_only_a_bundled_workers_stream_names_its_ids() -> None:
    assert reads_ids(routed(STREAM), replica("a"))
    assert not reads_ids(routed(STREAM), replica("a", kind="openai"))
    assert not reads_ids(routed({**STREAM, "stream": False}), replica("a"))
    assert not reads_ids(routed(STREAM, route="responses"), replica("a"))


def test_how_a_stream_continues_elsewhere() -> None:
    config = GatewayConfig.model_validate({"models": {MODEL: {"foreign_continuation": "completions"}}})
    foreign = replica("a", kind="openai")
    assert continuation(config, routed(STREAM, tokens=[1]), replica("a")) == "bundled"
    assert continuation(config, routed(STREAM), replica("a")) is None  # no ids to continue from
    assert continuation(config, routed(STREAM), foreign) == "completions"
    assert continuation(GatewayConfig(), routed(STREAM), foreign) is None  # not configured
    # Several choices in one stream cannot be carried on as one.
    assert continuation(config, routed({**STREAM, "n": 2}, tokens=[1]), replica("a")) is None
