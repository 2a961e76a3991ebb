"""The headers of a relayed request and of its answer (docs/design.md §2 step 6).

Both directions pass the other side's end-to-end headers, repeats kept (Cookie, Set-Cookie), and never
those of one connection (RFC 9110 §7.6.1). Going up, the upstream key (or, when configured, the
client's) is the Authorization; coming back, the gateway's routing headers say where the request went
and what the routing model expected there, so that a client can check the model against what it saw.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict, MultiMapping

from gateway.forward.routed import Routed
from gateway.forward.router import Decision
from gateway.gateway_config import GatewayConfig
from policies.prefix_aware import prefill_wait_s

REPLICA_HEADER = "x-prefixgate-replica"
MATCHED_BLOCKS_HEADER = "x-prefixgate-matched-blocks"
PREDICTED_CACHED_HEADER = "x-prefixgate-predicted-cached-tokens"
# The routing model's wait for the first token on the chosen replica (policies.prefix_aware
# prefill_wait_s), in ms: beside the TTFT a client sees, whether the model holds on this fleet.
PREDICTED_TTFT_HEADER = "x-prefixgate-predicted-ttft-ms"
POLICY_HEADER = "x-prefixgate-policy"
PREFILL_REPLICA_HEADER = "x-prefixgate-prefill-replica"
# Headers that describe one connection, not the content (RFC 9110 §7.6.1), in either direction; with
# those a message's Connection header names (connection_named).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# A replica's answer headers that are not relayed: its connection's, and those the gateway's own server
# writes.
_NOT_RELAYED = HOP_BY_HOP | {"content-length", "date", "server"}


def connection_named(headers: Mapping[str, str]) -> frozenset[str]:
    """The headers a message's Connection headers name (lower case): hop-by-hop too, never forwarded,
    whichever direction the message goes."""
    values = (
        headers.getall("Connection", ())
        if isinstance(headers, MultiMapping)
        else [headers.get("Connection", "")]
    )
    names = (token.strip().lower() for value in values for token in value.split(","))
    return frozenset(name for name in names if name)


def upstream_headers(
    config: GatewayConfig, routed: Routed, payload: bytes, extra: Mapping[str, str] | None = None
) -> CIMultiDict[str]:
    """The headers of `payload` to a replica: the client's, repeats kept, with `extra` (a prefill
    leg's) and the upstream Authorization replacing any of the same name."""
    headers = routed.headers.copy()
    if payload is not routed.raw:  # re-encoded: JSON, whatever the client called it
        headers["Content-Type"] = "application/json"
    headers.update(extra or {})
    key = config.upstream_key()
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    elif config.auth.forward_client_key and routed.authorization:
        headers["Authorization"] = routed.authorization
    return headers


def response_headers(
    upstream: Mapping[str, str], decision: Decision, replica_id: str, prefill_id: str | None = None
) -> CIMultiDict[str]:
    """The replica's answer headers, repeats kept (Set-Cookie), less its connection's, plus the
    gateway's routing headers (which replace any the replica sent of those names)."""
    view = decision.view_of(replica_id)
    dropped = _NOT_RELAYED | connection_named(upstream)
    headers = CIMultiDict((k, v) for k, v in upstream.items() if k.lower() not in dropped)
    headers[REPLICA_HEADER] = replica_id
    headers[MATCHED_BLOCKS_HEADER] = str(view.matched_blocks)
    headers[PREDICTED_CACHED_HEADER] = str(min(view.cached_tokens, decision.prompt_tokens))
    headers[PREDICTED_TTFT_HEADER] = str(round(1000 * prefill_wait_s(decision.prompt_tokens, view)))
    headers[POLICY_HEADER] = decision.policy
    if prefill_id is not None:
        headers[PREFILL_REPLICA_HEADER] = prefill_id
    return headers
