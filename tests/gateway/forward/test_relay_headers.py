"""Headers both ways: end-to-end ones pass with their repeats, a connection's never do, and the
routing headers say what the gateway decided."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from gateway.forward.relay_headers import (
    MATCHED_BLOCKS_HEADER,
    POLICY_HEADER,
    PREDICTED_CACHED_HEADER,
    PREDICTED_TTFT_HEADER,
    PREFILL_REPLICA_HEADER,
    REPLICA_HEADER,
    connection_named,
    response_headers,
    upstream_headers,
)
from gateway.gateway_config import GatewayConfig
from policies.view import ReplicaView
from tests.support.replicas import routed


def test_connection_names_every_header_it_lists_across_repeats() -> None:
    headers = CIMultiDict([("Connection", "keep-alive, X-Trace"), ("connection", " Upgrade ,")])
    assert connection_named(headers) == {"keep-alive", "x-trace", "upgrade"}
    assert connection_named({"Connection": "close"}) == {"close"}
    assert connection_named({}) == frozenset()


def test_an_answer_keeps_its_repeats_and_loses_its_connections_headers() -> None:
    views = [ReplicaView(id="b", block_size=4, matched_blocks=3, prefill_rate=1000.0), ReplicaView(id="a")]
    request = routed({}, tokens=list(range(10)), views=views)
    upstream = CIMultiDict(
        [
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
            ("Connection", "X-Hop"),
            ("X-Hop", "secret"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "5"),
            (REPLICA_HEADER, "forged"),
            ("X-Request-Id", "r1"),
        ]
    )
    headers = response_headers(upstream, request.decision, "b", prefill_id="p")
    assert headers.getall("Set-Cookie") == ["a=1", "b=2"]
    assert headers["X-Request-Id"] == "r1"
    for dropped in ("Connection", "X-Hop", "Transfer-Encoding", "Content-Length"):
        assert dropped not in headers
    assert headers.getall(REPLICA_HEADER) == ["b"]  # the replica's own is replaced
    assert headers[MATCHED_BLOCKS_HEADER] == "3"
    # 12 tokens held, never more than the prompt's 10.
    assert headers[PREDICTED_CACHED_HEADER] == "10"
    assert int(headers[PREDICTED_TTFT_HEADER]) >= 0
    assert headers[POLICY_HEADER] == "prefix_aware"
    assert headers[PREFILL_REPLICA_HEADER] == "p"
    assert PREFILL_REPLICA_HEADER not in response_headers(upstream, request.decision, "a")


@pytest.mark.parametrize("forward_client_key", [False, True])
def test_upstream_authorization_is_the_gateways_or_else_the_clients_when_asked(
    forward_client_key: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = routed(
        {}, headers=CIMultiDict([("Cookie", "a"), ("Cookie", "b")]), authorization="Bearer client"
    )
    config = GatewayConfig.model_validate({"auth": {"forward_client_key": forward_client_key}})
    headers = upstream_headers(config, request, request.raw)
    assert headers.getall("Cookie") == ["a", "b"]
    assert headers.get("Authorization") == ("Bearer client" if forward_client_key else None)
    assert "Content-Type" not in headers  # the client's bytes, described by the client's headers
    monkeypatch.setenv("UPSTREAM_KEY", "k1")
    keyed = config.model_copy(
        update={"auth": config.auth.model_copy(update={"upstream_key_env": "UPSTREAM_KEY"})}
    )
    headers = upstream_headers(keyed, request, b"{}", extra={"Authorization": "Bearer leg", "X-Leg": "1"})
    assert headers["Authorization"] == "Bearer k1"
    assert headers["X-Leg"] == "1"
    assert headers["Content-Type"] == "application/json"  # re-encoded by the gateway
