"""Body fields that are the gateway's alone: how it pairs replicas and moves KV between them
(docs/design.md §4).

A client that could set them would steer a worker: name the URL a decode worker pulls from (a request
to any host, its answer read back, and KV blocks of the client's making cached for every tenant), or
join another request's vLLM or SGLang transfer. So on every route, paired or not, nothing of them goes
upstream from a client:

- `prefixgate_*` fields other than the public `prefixgate_token_ids` (gateway.http.openapi) are refused with
  a 400 that names the field: they are prefixgate's own protocol, so a client sending one is mistaken,
  and a refusal says so where dropping it would leave the client guessing.
- vLLM's `kv_transfer_params` and SGLang's `bootstrap_host`, `bootstrap_port` and `bootstrap_room` are
  dropped: clients written for those servers may send them as a matter of course (a proxy's copy of
  the body, an SDK default), and the request is still served; a paired request carries the gateway's
  own values instead.
"""

from __future__ import annotations

from typing import Any

from protocol.errors import ApiError

PREFIX = "prefixgate_"
# Headers of the same kind (a worker's ids stream, its cached-token count): a client's never go upstream.
INTERNAL_HEADER_PREFIX = "x-prefixgate-"
PUBLIC = frozenset({"prefixgate_token_ids"})
DROPPED = frozenset({"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"})


def client_body(body: dict[str, Any]) -> dict[str, Any]:
    """`body` with none of the gateway's fields: the same object when it had none (so that it can go
    upstream byte for byte), a copy without the dropped ones otherwise; a 400 for a `prefixgate_*` one."""
    for key in body:
        if key.startswith(PREFIX) and key not in PUBLIC:
            raise ApiError(
                400,
                f"{key[:64]} is the gateway's own field, which a client may not send (of the prefixgate_* "
                "fields only prefixgate_token_ids is public)",
                param=key[:64],
                code="internal_field",
            )
    if DROPPED.isdisjoint(body):
        return body
    return {key: value for key, value in body.items() if key not in DROPPED}
