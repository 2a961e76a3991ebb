"""What goes to a replica for one routed request, and what its stream is asked to carry.

The client's body goes as it came, byte for byte, save what the gateway needs of the answer: a bundled
worker's chat or completion gets the token ids the gateway computed (no second tokenization), and a
stream to a foreign replica whose cache is predicted asks for the usage the client did not, to learn
from (`approximate.request_usage`). On every route the gateway's own fields are not the client's to
send (gateway.forward.internal_fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.fleet.replicas import Replica
from gateway.forward.internal_fields import client_body
from gateway.forward.migration import Continuation
from gateway.forward.routed import Routed
from gateway.gateway_config import GatewayConfig

# Routes whose bodies a bundled worker reads with the gateway's token ids attached, and whose streams
# a foreign one is asked to end with their usage.
ID_ROUTES = frozenset({"chat", "completions"})


def payload(
    routed: Routed, replica: Replica, learns_usage: bool, fields: Mapping[str, Any] | None = None
) -> tuple[bytes, bool]:
    """What goes to `replica`, and whether a usage event the client did not ask for will come back.

    `learns_usage`: whether the gateway learns from this replica's reported usage and is configured to
    ask for it. A paired decode replica gets the prefill side's `fields` (and is not asked for usage:
    what it reuses says nothing of what it held). A `prefixgate_*` field is refused, a vLLM or SGLang
    pairing one dropped (gateway.forward.internal_fields.client_body)."""
    if routed.body is None:
        return routed.raw, False
    body = client_body(routed.body)
    cleaned = body is not routed.body
    if routed.route not in ID_ROUTES:
        return (orjson.dumps(body) if cleaned else routed.raw), False
    added = dict(fields or {})
    strip_usage = False
    if replica.kind == "bundled":
        if routed.tokenized and routed.tokens is not None and "prefixgate_token_ids" not in body:
            tokens = routed.tokens
            # JSON has no packed ids (the prefix cache's array('I')): a list, for this worker alone.
            added["prefixgate_token_ids"] = tokens if isinstance(tokens, list) else list(tokens)
    elif not added and learns_usage and _streams_without_usage(body):
        options = body.get("stream_options")
        added["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        strip_usage = True
    return (orjson.dumps({**body, **added}) if added or cleaned else routed.raw), strip_usage


def _streams_without_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    wants_usage = isinstance(options, dict) and options.get("include_usage") is True
    return body.get("stream") is True and not wants_usage


def reads_ids(routed: Routed, replica: Replica) -> bool:
    """Whether a bundled worker is asked to name its tokens' ids in its stream (protocol.stream_ids)."""
    body = routed.body
    return (
        replica.kind == "bundled"
        and routed.route in ID_ROUTES
        and body is not None
        and body.get("stream") is True
    )


def continuation(config: GatewayConfig, routed: Routed, replica: Replica) -> Continuation | None:
    """How a stream from `replica` can be continued elsewhere (gateway.forward.migration), or None: a
    bundled worker's from the token ids, a foreign one's as its model's entry says it can."""
    body = routed.body
    if body is None or routed.route not in ID_ROUTES or body.get("n") not in (None, 1):
        return None
    if replica.kind == "bundled":
        return "bundled" if routed.tokens is not None else None
    entry = config.models.get(routed.model)
    how = entry.foreign_continuation if entry is not None else "none"
    return None if how == "none" else how
