"""The OpenAI API's handlers and the gateway's own public routes (health, liveness, metrics, OpenAPI).

A proxied request goes read → decide → forward: its body read under the gateway's limits
(gateway.http.reading), the policy's choice made by prefix or by load (gateway.forward.router), what the
chosen replica is then expected to hold recorded (gateway.fleet.expectations), and the request forwarded
(gateway.forward.proxy).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.fleet.expectations import NOTHING, expect, settle
from gateway.fleet.replicas import Replica
from gateway.forward.pd_legs import PAIRED_ROUTES
from gateway.forward.proxy import forward
from gateway.forward.request_view import PREFIX_ROUTES, RequestView, Route, read_request
from gateway.forward.routed import Routed
from gateway.forward.router import Decision, decide
from gateway.gateway_state import GatewayState
from gateway.http.keys import GATEWAY, STATE
from gateway.http.openapi import OPENAPI
from gateway.http.reading import forwarded_headers, json_body, model_of, read_body, session_key
from protocol.errors import RETRY_AFTER_S, ApiError
from protocol.serving import METRICS_CONTENT_TYPE

# A Responses API object by id (GET, DELETE, /cancel, /input_items): served where it was produced.
_RESPONSE_PATH = re.compile(r"^/v1/responses/([^/]+)")
PROXIED_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def proxy_handler(route: Route | None) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of a proxied route (None: any /v1 path; a named one with another method than POST,
    such as a GET of stored chat completions, is "other" too)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _proxied(request, route or "other")

    return handle


async def _proxied(request: web.Request, route: Route) -> web.StreamResponse:
    """One proxied request, counted in the gateway's in-flight total once its body has arrived until
    its response ends (or its client leaves). Past `limits.max_inflight` it is refused with 429: at
    once when the gateway is full as it arrives (its body unread: what bounds the gateway's memory
    under a burst), else once its body is in. Its body is read outside the total, under its own
    budget (`limits.body_timeout_s`), so that clients sending theirs slowly hold no slot that others'
    requests need."""
    state = request.app[STATE]
    arrival = time.monotonic()
    _admissible(state)
    raw = await read_body(state, request) if request.body_exists else b""
    _admissible(state)
    state.inflight += 1
    try:
        return await _route_and_forward(state, request, route, raw, arrival)
    finally:
        state.inflight -= 1


def _admissible(state: GatewayState) -> None:
    limit = state.config.limits.max_inflight
    if state.inflight >= limit:
        raise ApiError(
            429,
            f"the gateway is at its limit of {limit} requests in flight; retry shortly",
            code="gateway_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


async def _route_and_forward(
    state: GatewayState, request: web.Request, route: Route, raw: bytes, arrival: float
) -> web.StreamResponse:
    body = json_body(request, route, raw)
    view = read_request(route, body)
    model = model_of(state, view.model, required=route in PREFIX_ROUTES)
    replicas = state.replicas.serving(model) if model is not None else state.replicas.all()
    prompt = await state.tokenizers.prompt(view, model, state.config.limits) if model is not None else None
    tokens = prompt.ids if prompt is not None else None
    decision = await _decide(state, request, route, view, replicas, tokens)
    expectation = NOTHING
    if route in PREFIX_ROUTES:
        state.metrics.child(state.metrics.decision, decision.policy).observe(decision.seconds)
        chosen = state.replicas.get(decision.order[0]) if decision.order else None
        hashes = decision.hashes.get(chosen.block_size) if chosen is not None else None
        if chosen is not None and hashes:
            expectation = expect(
                state.index,
                state.predictions,
                chosen,
                hashes,
                precise=chosen.precise,
                now=time.time(),
                request_timeout_s=state.config.limits.request_timeout_s,
            )
    routed = Routed(
        route=route,
        model=model or "",
        method=request.method,
        target=request.rel_url.raw_path_qs,  # origin-form: an absolute-form target names no host upstream
        raw=raw,
        body=body,
        headers=forwarded_headers(request),
        tokens=tokens,
        tokenized=prompt is not None and prompt.tokenized,
        decision=decision,
        arrival=arrival,
        authorization=request.headers.get("Authorization"),
        predicted=expectation.predicted,
        recorded_tick=expectation.recorded_tick,
    )
    try:
        return await forward(state, request, routed)
    finally:
        settle(state.index, expectation)


async def _decide(
    state: GatewayState,
    request: web.Request,
    route: Route,
    view: RequestView,
    replicas: list[Replica],
    tokens: list[int] | None,
) -> Decision:
    """The policy's choice by prefix, or by load; a stored response's own replica first and alone, when
    it can take the request (no other replica holds that response)."""
    if route in PREFIX_ROUTES:
        session = session_key(state, request, view)
        paired = route in PAIRED_ROUTES
        decision = decide(
            state.policy, state.index, replicas, tokens, session, state.pd, paired, state.chains
        )
    else:
        decision = decide(state.by_load, state.index, [r for r in replicas if r.role != "prefill"], None)
    found = _RESPONSE_PATH.match(request.path)
    response_id = view.previous_response_id or (found.group(1) if found else None)
    if response_id is not None:
        owner = state.replicas.get(await state.response_owners.owner(response_id) or "")
        if owner is not None and owner.routable and owner in replicas:
            return dataclasses.replace(decision, order=[owner.id])
    return decision


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = []
    for name in state.replicas.models():
        replicas = state.replicas.serving(name)
        data.append(
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "prefixgate",
                "max_model_len": min(r.max_context_len for r in replicas),
                "replicas": sum(r.routable for r in replicas),
            }
        )
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """Readiness: 200 only while a request could be served now (a routable replica that answers
    clients, which a prefill replica does not; and the gateway started: it listens only once the
    tokenizers of the models it knows are loaded)."""
    gw = request.app[GATEWAY]
    state = gw.state
    replicas = state.replicas.all()
    routable = sum(r.routable and r.role != "prefill" for r in replicas)
    degraded = gw.redis_ok is False
    body = {
        "status": ("degraded" if degraded else "ok") if routable else "unavailable",
        "gateway_id": state.gateway_id,
        "replicas": {"routable": routable, "total": len(replicas), "pending": len(gw.pending)},
        "models": state.replicas.models(),
        "tokenizers": state.tokenizers.status(),
        "policy": state.policy.name,
        "redis": {"configured": gw.redis is not None, "ok": gw.redis_ok},
        "degraded": degraded,
    }
    return web.json_response(body, status=200 if routable else 503)


async def live(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP (whether or not any replica can take a request)."""
    return web.json_response({"status": "alive", "gateway_id": request.app[STATE].gateway_id})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    gw.refresh_metrics()
    return web.Response(body=gw.state.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(OPENAPI)
