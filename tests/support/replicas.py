"""Replica and routed-request values for tests of the gateway's pure parts (no server, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from multidict import CIMultiDict

from gateway.fleet.replicas import Replica
from gateway.forward.request_view import Route
from gateway.forward.routed import Routed
from gateway.forward.router import Decision
from policies.view import ReplicaView

MODEL = "m"


def replica(rid: str, block_size: int = 4, **kwargs: object) -> Replica:
    fields: dict[str, object] = {
        "id": rid,
        "url": f"http://{rid}",
        "kind": "bundled",
        "model": MODEL,
        "block_size": block_size,
        "capacity_blocks": 100,
        "max_context_len": 1000,
        "source": "config",
        "prefill_rate": 1000.0,
    }
    return Replica(**(fields | kwargs))  # type: ignore[arg-type]


def routed(
    body: dict[str, Any] | None,
    route: Route = "chat",
    tokens: Sequence[int] | None = None,
    views: list[ReplicaView] | None = None,
    **kwargs: Any,
) -> Routed:
    """A request as the gateway routed it: `body` as the client sent it (raw bytes included), decided
    for `views` in their order."""
    views = views if views is not None else [ReplicaView(id="a")]
    decision = Decision(
        order=[v.id for v in views],
        views=views,
        hashes={},
        prompt_tokens=len(tokens) if tokens is not None else 0,
        seconds=0.0,
        policy="prefix_aware",
    )
    fields: dict[str, Any] = {
        "route": route,
        "model": MODEL,
        "method": "POST",
        "target": "/v1/chat/completions",
        "raw": orjson.dumps(body) if body is not None else b"",
        "body": body,
        "headers": CIMultiDict(),
        "tokens": tokens,
        "tokenized": tokens is not None,
        "decision": decision,
        "arrival": 0.0,
        "authorization": None,
    }
    return Routed(**(fields | kwargs))
