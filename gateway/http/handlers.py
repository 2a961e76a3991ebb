"""The OpenAI API's handlers and the gateway's own public routes (health, liveness, metrics, OpenAPI).

A proxied request goes read → decide → forward: its body read under the gateway's limits
(gateway.http.reading), the policy's choice made by prefix or by load and what the chosen replica is
then expected to hold recorded (gateway.forward.choice), and the request forwarded
(gateway.forward.proxy).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.fleet.expectations import settle
from gateway.forward.choice import choose, expect_first, model_of, record_first
from gateway.forward.proxy import forward
from gateway.forward.request_view import PREFIX_ROUTES, Route, read_request
from gateway.forward.routed import Routed
from gateway.gateway_state import GatewayState
from gateway.http.keys import GATEWAY, STATE
from gateway.http.openapi import OPENAPI
from gateway.http.reading import forwarded_headers, json_body, read_body
from gateway.metrics_merge import merge_expositions
from protocol.serving import METRICS_CONTENT_TYPE

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
    state.admit()
    raw = await read_body(state, request) if request.body_exists else b""
    state.admit()
    state.inflight += 1
    try:
        return await _route_and_forward(state, request, route, raw, arrival)
    finally:
        state.inflight -= 1


async def _route_and_forward(
    state: GatewayState, request: web.Request, route: Route, raw: bytes, arrival: float
) -> web.StreamResponse:
    body = json_body(request, route, raw)
    view = read_request(route, body)
    model = model_of(state, view.model, required=route in PREFIX_ROUTES)
    replicas = state.replicas.serving(model) if model is not None else state.replicas.all()
    prompt = await state.tokenizers.prompt(view, model, state.config.limits) if model is not None else None
    tokens = prompt.ids if prompt is not None else None
    decision = await choose(state, request.path, request.headers, route, view, replicas, tokens)
    expectation = expect_first(state, route, decision)
    routed = Routed(
        route=route,
        model=model or "",
        method=request.method,
        target=request.rel_url.raw_path_qs,  # origin-form: an absolute-form target names no host upstream
        raw=raw,
        body=body,
        headers=forwarded_headers(request.headers, request.remote, request.scheme),
        tokens=prompt.token_ids if prompt is not None else None,
        tokenized=prompt is not None and prompt.tokenized,
        decision=decision,
        arrival=arrival,
        authorization=request.headers.get("Authorization"),
        predicted=expectation.predicted,
        recorded_tick=expectation.recorded_tick,
        leaving=functools.partial(record_first, state, expectation),
    )
    try:
        return await forward(state, request, routed)
    finally:
        settle(state.index, expectation)


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
    if gw.siblings is not None:
        body["siblings"] = gw.siblings.stats()
    return web.json_response(body, status=200 if routable else 503)


async def live(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP (whether or not any replica can take a request)."""
    return web.json_response({"status": "alive", "gateway_id": request.app[STATE].gateway_id})


async def metrics(request: web.Request) -> web.Response:
    """This process's metrics; with `serve --workers N`, every process's, labelled by `process`."""
    gw = request.app[GATEWAY]
    gw.refresh_metrics()
    body = gw.state.metrics.render()
    if gw.siblings is not None:
        parts = {gw.siblings.index: body, **await gw.siblings.scrape()}
        body = merge_expositions((str(k), parts[k]) for k in sorted(parts))
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(OPENAPI)
