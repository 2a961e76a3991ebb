"""The admin and debug routes: the replica set listed, added to, drained and pruned, and a routing
decision explained without sending anything. Who may call them is gateway.http.auth's to say."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.forward.choice import model_of, session_key
from gateway.forward.pd_legs import PAIRED_ROUTES
from gateway.forward.request_view import Route, read_request
from gateway.forward.router import decide
from gateway.gateway_config import ReplicaEntry
from gateway.gateway_state import GatewayState
from gateway.http.keys import GATEWAY, STATE
from gateway.http.reading import read_body
from protocol.errors import ApiError
from protocol.openai_api import parse_json


def _replica_or_404(state: GatewayState, replica_id: str) -> Any:
    replica = state.replicas.get(replica_id)
    if replica is None:
        raise ApiError(404, f"no replica {replica_id!r}", param="id", code="replica_not_found")
    return replica


async def list_replicas(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    sync = gw.sync.states | gw.zmq_sync.states
    rows = []
    for r in gw.state.replicas.all():
        row = r.to_json() | {
            "index_blocks": gw.state.index.blocks_of(r.id),
            "index_capacity_blocks": gw.state.index.capacity_of(r.id),
        }
        if r.id in sync:
            row["kv_sync"] = sync[r.id].to_json()
        rows.append(row)
    pending = [{"url": url, "source": source} for url, (_, source) in gw.pending.items()]
    return web.json_response({"gateway_id": gw.state.gateway_id, "replicas": rows, "pending": pending})


async def add_replica(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = parse_json(await read_body(gw.state, request))
    try:
        entry = ReplicaEntry.model_validate(body, strict=True)  # JSON types as they are: no "16", no true
    except ValueError as error:
        raise ApiError(400, f"invalid replica: {error}", code="invalid_value") from None
    replica = await gw.add_entry(entry, "admin")
    if gw.siblings is not None:
        gw.siblings.send(("admin", gw.siblings.index, "add", body))
    if replica is None:
        return web.json_response({"status": "pending", "url": entry.url}, status=202)
    return web.json_response({"status": "active", "replica": replica.to_json()}, status=201)


async def drain_replica(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    replica = _replica_or_404(gw.state, request.match_info["id"])
    replica.draining = request.match_info["action"] == "drain"
    if gw.siblings is not None:
        gw.siblings.send(("admin", gw.siblings.index, "drain", replica.id, replica.draining))
    return web.json_response(replica.to_json())


async def remove_replica(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    replica = _replica_or_404(gw.state, request.match_info["id"])
    await gw.deactivate(replica.id)
    if gw.siblings is not None:
        gw.siblings.send(("admin", gw.siblings.index, "remove", replica.id))
    return web.json_response({"status": "removed", "id": replica.id, "inflight": len(replica.inflight)})


async def debug_route(request: web.Request) -> web.Response:
    """Explain a decision without sending anything: GET ?prompt=...&model=..., or POST an OpenAI body
    (`messages` makes it a chat request, `input` a Responses one)."""
    state = request.app[STATE]
    if request.method == "POST":
        body = parse_json(await read_body(state, request))
    else:
        body = {k: request.query[k] for k in ("model", "prompt", "user") if k in request.query}
    route: Route = "chat" if "messages" in body else "responses" if "input" in body else "completions"
    view = read_request(route, body)
    model = model_of(state, view.model, required=True)
    assert model is not None
    if not view.has_prompt:
        raise ApiError(
            400, "nothing to route: give a prompt, messages or input", param="prompt", code="invalid_value"
        )
    prompt = await state.tokenizers.prompt(view, model, state.config.limits)
    tokens = prompt.ids if prompt is not None else None
    session = session_key(state, request.headers, view)
    replicas = state.replicas.serving(model)
    paired = route in PAIRED_ROUTES
    decision = decide(state.policy, state.index, replicas, tokens, session, state.pd, paired, state.chains)
    return web.json_response(
        {
            "gateway_id": state.gateway_id,
            "model": model,
            "policy": decision.policy,
            "prompt_tokens": decision.prompt_tokens,
            "tokenized": tokens is not None,
            "order": decision.order,
            "decision_us": round(decision.seconds * 1e6, 1),
            "replicas": decision.explain(),
        }
    )
