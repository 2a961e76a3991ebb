"""The gateway's HTTP surface: the OpenAI API in front, admin and debug routes behind a token.

In front of its replicas the gateway is transparent (docs/design.md §2): it judges only what is its own to
judge — a body that is not JSON where a route needs one, a body too big, a model no replica serves,
auth, its own in-flight limit — and forwards everything else as the client sent it, every OpenAI
field and vendor extension included, to be judged by the replica that serves it. Chat, completion and
Responses requests are routed by their prompt's prefix; a Responses request that continues an earlier
response goes to the replica holding it; every other route (embeddings, scoring, tokenize, any /v1
path a replica serves) by load, never to a prefill replica (it answers no client).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import logging
import os
import re
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict

from gateway.config import GatewayConfig, ReplicaEntry, load_config
from gateway.gateway import Gateway
from gateway.internal_fields import INTERNAL_HEADER_PREFIX
from gateway.openapi import OPENAPI
from gateway.pd_legs import PAIRED_ROUTES
from gateway.proxy import ACCOUNTED, HOP_BY_HOP, connection_named, forward
from gateway.replicas import Replica
from gateway.request_view import PREFIX_ROUTES, RequestView, Route, read_request
from gateway.routed import Routed
from gateway.router import Decision, decide
from policies import ConfigError
from protocol.errors import CLIENT_GONE, RETRY_AFTER_S, ApiError
from protocol.openai_api import parse_json
from protocol.serving import METRICS_CONTENT_TYPE

log = logging.getLogger("prefixgate.gateway")

GATEWAY = web.AppKey("gateway", Gateway)
CONFIG_PATH = web.AppKey("config_path", Path)
# The request content codings aiohttp decodes (br and zstd only with optional packages, not installed:
# its parser refuses those itself).
DECODED_CODINGS = frozenset({"identity", "gzip", "deflate"})
# Routes the gateway serves by name (everything else under /v1 is "other"), and what it reads of them.
NAMED_ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/v1/score": "score",
    "/score": "score",
    "/v1/rerank": "score",
    "/rerank": "score",
    "/v2/rerank": "score",
    "/classify": "score",
    "/pooling": "score",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
# A Responses API object by id (GET, DELETE, /cancel, /input_items): served where it was produced.
_RESPONSE_PATH = re.compile(r"^/v1/responses/([^/]+)")
PROXIED_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
# Client headers that describe the client's connection to the gateway, or that the gateway sets itself
# upstream: never forwarded. The body arrives decoded, hence Content-Encoding; Accept-Encoding too, so
# that replicas answer uncompressed and the gateway can read the usage it learns from.
_NOT_FORWARDED = HOP_BY_HOP | {
    "host",
    "content-length",
    "content-encoding",
    "accept-encoding",
    "expect",
    "authorization",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
}
# Admin routes that act on what their body says, and the one content type they take.
_JSON = "application/json"
_MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


# -- the OpenAI API -------------------------------------------------------------------------------


def _model_of(gw: Gateway, name: str | None, required: bool) -> str | None:
    """The model a request is for: the one it names, else the default one (the configured default, or
    the only one). Naming a model no replica serves is a 404. A route that needs a model (`required`)
    and names none when several are served is a 400; any other is then served by any replica."""
    models = gw.replicas.models()
    if name is None:
        if gw.config.model is not None and gw.config.model in models:
            return gw.config.model
        if len(models) == 1:
            return models[0]
        if not required:
            return None
        raise ApiError(
            400, f"model is required: this gateway serves {models}", param="model", code="model_required"
        )
    if name not in models:
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this gateway serves {models}",
            param="model",
            code="model_not_found",
        )
    return name


def _session_key(gw: Gateway, request: web.Request, view: RequestView) -> str | None:
    """The session header, else the `user` field. A header is bytes, whatever it holds: one that is not
    UTF-8 (aiohttp's surrogate escapes) is a key as good as any, its bytes written as escapes."""
    header = request.headers.get(gw.config.routing.session_affinity.header)
    if header:
        return header.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return view.user


def forwarded_headers(request: web.Request) -> CIMultiDict[str]:
    """The client's end-to-end headers, as they go upstream (Authorization by the config's rule), each
    repeat kept (Cookie): less the hop-by-hop ones, those the client's Connection header names included.
    The gateway records its hop as a reverse proxy does: X-Forwarded-For gains the client's address
    after any the client sent (a replica trusts only the last one); X-Forwarded-Proto and
    X-Forwarded-Host, how the client reached the gateway, replace any the client sent. A `Forwarded`
    header goes as sent. `x-prefixgate-*` headers are the gateway's and its workers' alone (as the
    body's fields: gateway.internal_fields), so a client's never go upstream."""
    dropped = _NOT_FORWARDED | connection_named(request.headers)
    headers = CIMultiDict(
        (k, v)
        for k, v in request.headers.items()
        if k.lower() not in dropped and not k.lower().startswith(INTERNAL_HEADER_PREFIX)
    )
    chain = [v for v in request.headers.getall("X-Forwarded-For", ()) if v.strip()]
    if request.remote:
        chain.append(request.remote)
    if chain:
        headers["X-Forwarded-For"] = ", ".join(chain)
    headers["X-Forwarded-Proto"] = request.scheme
    host = request.headers.get("Host")
    if host:
        headers["X-Forwarded-Host"] = host
    return headers


async def read_body(gw: Gateway, request: web.Request) -> bytes:
    """The request body, decoded. A content coding aiohttp does not decode would otherwise be read as
    if there were none; a body that does not arrive in time would hold its connection for ever."""
    coding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if coding not in DECODED_CODINGS:
        raise ApiError(
            415,
            f"Content-Encoding {coding!r} is not supported: send the body as is, gzip or deflate",
            code="unsupported_content_encoding",
        )
    if request.content.is_eof():  # all there already, as small bodies are: no timer to arm
        return await request.read()
    timeout_s = gw.config.limits.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from None


def _json_body(request: web.Request, route: Route, raw: bytes) -> dict[str, Any] | None:
    """The body as a JSON object. The named routes take nothing else (400); the others may carry any
    content (a file upload), and are then routed without reading it."""
    if route != "other":
        return parse_json(raw)
    if not raw or not request.content_type.endswith("json"):
        return None
    try:
        return parse_json(raw)
    except ApiError:
        return None


def _proxy(route: Route | None) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of a proxied route (None: any /v1 path; a named one with another method than POST,
    such as a GET of stored chat completions, is "other" too)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _proxied(request, route or "other")

    return handle


def _route_of(request: web.Request) -> Route:
    return NAMED_ROUTES.get(request.path, "other") if request.method == "POST" else "other"


def _proxied_path(path: str) -> bool:
    """The API routes: keys apply, and their outcomes are counted."""
    return path.startswith("/v1/") or path in NAMED_ROUTES


async def _proxied(request: web.Request, route: Route) -> web.StreamResponse:
    """One proxied request, counted in the gateway's in-flight total once its body has arrived until
    its response ends (or its client leaves). Past `limits.max_inflight` it is refused with 429: at
    once when the gateway is full as it arrives (its body unread: what bounds the gateway's memory
    under a burst), else once its body is in. Its body is read outside the total, under its own
    budget (`limits.body_timeout_s`), so that clients sending theirs slowly hold no slot that others'
    requests need."""
    gw = request.app[GATEWAY]
    arrival = time.monotonic()
    _admissible(gw)
    raw = await read_body(gw, request) if request.body_exists else b""
    _admissible(gw)
    gw.inflight += 1
    try:
        return await _route_and_forward(gw, request, route, raw, arrival)
    finally:
        gw.inflight -= 1


def _admissible(gw: Gateway) -> None:
    limit = gw.config.limits.max_inflight
    if gw.inflight >= limit:
        raise ApiError(
            429,
            f"the gateway is at its limit of {limit} requests in flight; retry shortly",
            code="gateway_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


async def _route_and_forward(
    gw: Gateway, request: web.Request, route: Route, raw: bytes, arrival: float
) -> web.StreamResponse:
    body = _json_body(request, route, raw)
    view = read_request(route, body)
    model = _model_of(gw, view.model, required=route in PREFIX_ROUTES)
    replicas = gw.replicas.serving(model) if model is not None else gw.replicas.all()
    prompt = await gw.tokenizers.prompt(view, model, gw.config.limits) if model is not None else None
    tokens = prompt.ids if prompt is not None else None
    decision = await _decide(gw, request, route, view, replicas, tokens)
    predicted = recorded_tick = in_flight = None
    if route in PREFIX_ROUTES:
        gw.metrics.child(gw.metrics.decision, decision.policy).observe(decision.seconds)
        chosen = gw.replicas.get(decision.order[0]) if decision.order else None
        hashes = decision.hashes.get(chosen.block_size) if chosen is not None else None
        if chosen is not None and hashes and not gw.precise(chosen):
            # What the chosen replica was predicted to hold, as it was before this request: the
            # reuse it reports is checked against it (Predictions.learn).
            predicted = gw.index.predicted(chosen.id, hashes, chosen.pending_horizon())
            recorded_tick = gw.index.tick_now(chosen.id)
            gw.predictions.record(chosen.id, hashes, time.time())
        elif chosen is not None and hashes:
            # An exact replica holds the prompt once it has computed it, which its events will say; a
            # request sent there meanwhile waits for that prefill anyway and then reuses it. So until
            # this request ends its prompt counts as held there (RadixIndex.settle).
            in_flight = (chosen.id, hashes)
            gw.index.insert(chosen.id, hashes, expires_at=time.time() + gw.config.limits.request_timeout_s)
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
        predicted=predicted,
        recorded_tick=recorded_tick,
    )
    try:
        return await forward(gw, request, routed)
    finally:
        if in_flight is not None:
            gw.index.settle(*in_flight)


async def _decide(
    gw: Gateway,
    request: web.Request,
    route: Route,
    view: RequestView,
    replicas: list[Replica],
    tokens: list[int] | None,
) -> Decision:
    """The policy's choice by prefix, or by load; a stored response's own replica first and alone, when
    it can take the request (no other replica holds that response)."""
    if route in PREFIX_ROUTES:
        session = _session_key(gw, request, view)
        decision = decide(gw.policy, gw.index, replicas, tokens, session, gw.pd, route in PAIRED_ROUTES)
    else:
        decision = decide(gw.by_load, gw.index, [r for r in replicas if r.role != "prefill"], None)
    found = _RESPONSE_PATH.match(request.path)
    response_id = view.previous_response_id or (found.group(1) if found else None)
    if response_id is not None:
        owner = gw.replicas.get(await gw.response_owners.owner(response_id) or "")
        if owner is not None and owner.routable and owner in replicas:
            return dataclasses.replace(decision, order=[owner.id])
    return decision


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    data = []
    for name in gw.replicas.models():
        replicas = gw.replicas.serving(name)
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
    replicas = gw.replicas.all()
    routable = sum(r.routable and r.role != "prefill" for r in replicas)
    degraded = gw.redis_ok is False
    body = {
        "status": ("degraded" if degraded else "ok") if routable else "unavailable",
        "gateway_id": gw.gateway_id,
        "replicas": {"routable": routable, "total": len(replicas), "pending": len(gw.pending)},
        "models": gw.replicas.models(),
        "tokenizers": gw.tokenizers.status(),
        "policy": gw.policy.name,
        "redis": {"configured": gw.redis is not None, "ok": gw.redis_ok},
        "degraded": degraded,
    }
    return web.json_response(body, status=200 if routable else 503)


async def live(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP (whether or not any replica can take a request)."""
    return web.json_response({"status": "alive", "gateway_id": request.app[GATEWAY].gateway_id})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    gw.refresh_metrics()
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(OPENAPI)


# -- admin ----------------------------------------------------------------------------------------


def _replica_or_404(gw: Gateway, replica_id: str) -> Any:
    replica = gw.replicas.get(replica_id)
    if replica is None:
        raise ApiError(404, f"no replica {replica_id!r}", param="id", code="replica_not_found")
    return replica


async def list_replicas(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    sync = gw.sync.states | gw.zmq_sync.states
    rows = []
    for r in gw.replicas.all():
        row = r.to_json() | {
            "index_blocks": gw.index.blocks_of(r.id),
            "index_capacity_blocks": gw.index.capacity_of(r.id),
        }
        if r.id in sync:
            row["kv_sync"] = sync[r.id].to_json()
        rows.append(row)
    pending = [{"url": url, "source": source} for url, (_, source) in gw.pending.items()]
    return web.json_response({"replicas": rows, "pending": pending})


async def add_replica(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = parse_json(await read_body(gw, request))
    try:
        entry = ReplicaEntry.model_validate(body, strict=True)  # JSON types as they are: no "16", no true
    except ValueError as error:
        raise ApiError(400, f"invalid replica: {error}", code="invalid_value") from None
    replica = await gw.add_entry(entry, "admin")
    if replica is None:
        return web.json_response({"status": "pending", "url": entry.url}, status=202)
    return web.json_response({"status": "active", "replica": replica.to_json()}, status=201)


async def drain_replica(request: web.Request) -> web.Response:
    replica = _replica_or_404(request.app[GATEWAY], request.match_info["id"])
    replica.draining = request.match_info["action"] == "drain"
    return web.json_response(replica.to_json())


async def remove_replica(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    replica = _replica_or_404(gw, request.match_info["id"])
    await gw.deactivate(replica.id)
    return web.json_response({"status": "removed", "id": replica.id, "inflight": len(replica.inflight)})


async def debug_route(request: web.Request) -> web.Response:
    """Explain a decision without sending anything: GET ?prompt=...&model=..., or POST an OpenAI body
    (`messages` makes it a chat request, `input` a Responses one)."""
    gw = request.app[GATEWAY]
    if request.method == "POST":
        body = parse_json(await read_body(gw, request))
    else:
        body = {k: request.query[k] for k in ("model", "prompt", "user") if k in request.query}
    route: Route = "chat" if "messages" in body else "responses" if "input" in body else "completions"
    view = read_request(route, body)
    model = _model_of(gw, view.model, required=True)
    assert model is not None
    if not view.has_prompt:
        raise ApiError(
            400, "nothing to route: give a prompt, messages or input", param="prompt", code="invalid_value"
        )
    prompt = await gw.tokenizers.prompt(view, model, gw.config.limits)
    tokens = prompt.ids if prompt is not None else None
    session = _session_key(gw, request, view)
    replicas = gw.replicas.serving(model)
    decision = decide(gw.policy, gw.index, replicas, tokens, session, gw.pd, route in PAIRED_ROUTES)
    return web.json_response(
        {
            "model": model,
            "policy": decision.policy,
            "prompt_tokens": decision.prompt_tokens,
            "tokenized": tokens is not None,
            "order": decision.order,
            "decision_us": round(decision.seconds * 1e6, 1),
            "replicas": decision.explain(),
        }
    )


# -- middleware -----------------------------------------------------------------------------------


def _bearer(request: web.Request) -> bytes | None:
    """The bearer token's bytes, as the client sent them (aiohttp hands header values over as UTF-8
    with surrogate escapes, which give them back), or None when there is none."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("utf-8", "surrogateescape")


def _matches(token: bytes | None, secrets: Iterable[str]) -> bool:
    """Whether `token` is one of `secrets`, compared as bytes in constant time: a token of any bytes is
    a wrong one (401), never an error."""
    return token is not None and any(hmac.compare_digest(token, s.encode()) for s in secrets)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _authorize(gw: Gateway, request: web.Request) -> None:
    """API keys on the API routes; on the admin and debug routes, the admin token, or none at all.

    What the admin API trusts: with a token, whoever sends it. Without one (allowed only on a loopback
    listener), whoever can open a connection to that listener: every local user and process. A web
    page the operator visits can make the browser send requests there too; these are refused: a
    request from another origin (its Origin, or Sec-Fetch-Site other than same-origin or none), a Host
    that is not a loopback name or address with the listener's port (a page's own name, which DNS
    rebinding points at 127.0.0.1), and a mutating request whose body is not JSON (the forms and plain
    text a page may send without asking first: 415)."""
    path = request.path
    if _proxied_path(path):
        keys = gw.config.api_keys()
        if keys and not _matches(_bearer(request), keys):
            raise ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY)",
                code="invalid_api_key",
                type="authentication_error",
            )
    elif path.startswith(("/admin/", "/debug/")):
        admin = gw.config.admin_token()
        if admin is None:
            if not _is_loopback(gw.config.listen.host):
                raise ApiError(
                    403,
                    "admin routes are off: set auth.admin_token_env to enable them",
                    code="admin_disabled",
                    type="permission_error",
                )
            _loopback_host(request)
        _same_origin(request)
        if admin is not None and not _matches(_bearer(request), [admin]):
            raise ApiError(
                401, "the admin token is required", code="invalid_admin_token", type="authentication_error"
            )
        _json_only(request)


def _authority(value: str) -> tuple[str, int | None] | None:
    """A Host header's or an origin's host (lower case) and port (None: the scheme's default), or None
    when it is none."""
    try:
        parts = urlsplit(f"//{value}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host or parts.path or parts.query or parts.fragment or parts.username is not None:
        return None
    return host, port


def _forbidden(message: str, code: str) -> ApiError:
    return ApiError(403, message, code=code, type="permission_error")


def _loopback_host(request: web.Request) -> None:
    """A tokenless admin API answers only requests addressed to it by a loopback name or address and its
    own port, in origin form."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    port = sockname[1] if sockname else None
    found = _authority(request.headers.get("Host", ""))
    default = 443 if request.secure else 80
    if (
        not request.raw_path.startswith("/")
        or found is None
        or not _is_loopback(found[0])
        or (found[1] or default) != port
    ):
        raise _forbidden(
            f"without an admin token, admin routes answer only requests to localhost or a loopback address "
            f"on port {port} (Host: {request.headers.get('Host', '')!r})",
            "admin_host_refused",
        )


def _same_origin(request: web.Request) -> None:
    """Admin requests from a web page of another origin are refused: the browser says where it sends
    them from (Origin on any but a simple GET, Sec-Fetch-Site on every request)."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site.lower() not in ("same-origin", "none"):
        raise _forbidden(
            f"admin routes refuse cross-origin requests (Sec-Fetch-Site: {site})", "cross_origin"
        )
    origin = request.headers.get("Origin")
    if origin is None:
        return
    scheme, _, rest = origin.partition("://")
    default = {"http": 80, "https": 443}.get(scheme.lower())
    theirs = _authority(rest) if default is not None else None
    ours = _authority(request.headers.get("Host", ""))
    if theirs is None or ours is None or (theirs[0], theirs[1] or default) != (ours[0], ours[1] or default):
        raise _forbidden(f"admin routes refuse cross-origin requests (Origin: {origin})", "cross_origin")


def _json_only(request: web.Request) -> None:
    """A mutating admin request's body, if it has one, is JSON: a browser sends no other type cross-site
    without asking first (CORS), and this API answers no such question."""
    given = request.headers.get("Content-Type")
    has_body = request.body_exists or given is not None
    if request.method in _MUTATING and has_body and request.content_type.lower() != _JSON:
        raise ApiError(
            415,
            f"admin routes take a JSON body (Content-Type: {_JSON}), not {given or 'none'!r}",
            code="unsupported_media_type",
        )


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every refusal as OpenAI's error JSON, aiohttp's own 404/405/413 included; never a bare 500."""
    gw = request.app[GATEWAY]
    try:
        _authorize(gw, request)
        return await handler(request)
    except ApiError as error:
        if _proxied_path(request.path):
            gw.metrics.requests.labels("", "", gw.policy.name, str(error.status), _route_of(request)).inc()
        response = web.json_response(error.to_json(), status=error.status, headers=error.headers)
        if error.headers.get("Connection") == "close":
            # A client whose body did not arrive in time gets its answer, then its connection closed:
            # no more of the gateway's time (aiohttp would read what is left, for 10 s).
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
        return response
    except RequestPayloadError as error:
        # A body aiohttp could not read: a corrupt gzip or deflate stream, a broken chunked encoding.
        detail = getattr(error.__cause__, "message", None) or str(error.__cause__ or error)
        api = ApiError(400, f"the body could not be read: {detail}", code="invalid_body")
        return web.json_response(api.to_json(), status=400)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        code = error.reason.lower().replace(" ", "_")
        api = ApiError(error.status, error.text or error.reason, code=code)
        return web.json_response(api.to_json(), status=error.status)
    except asyncio.CancelledError:
        if _proxied_path(request.path) and not request.get(ACCOUNTED):
            gw.metrics.requests.labels("", "", gw.policy.name, str(CLIENT_GONE), _route_of(request)).inc()
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        api = ApiError(500, "internal error in the gateway", code="internal_error")
        return web.json_response(api.to_json(), status=500)


# -- the app --------------------------------------------------------------------------------------


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    await gw.start()
    path = app.get(CONFIG_PATH)
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Future[None]] = set()
    if path is not None:

        def on_sighup() -> None:
            async def reload() -> None:
                try:
                    await gw.reload(load_config(path))
                except ConfigError as error:
                    log.error("reload refused, keeping the running configuration: %s", error)

            reloads.add(task := asyncio.ensure_future(reload()))
            task.add_done_callback(reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, on_sighup)
    yield
    if path is not None:
        loop.remove_signal_handler(signal.SIGHUP)
    await gw.close()


def create_app(
    config: GatewayConfig, *, config_path: Path | None = None, gateway_id: str | None = None
) -> web.Application:
    # Unique per instance: gateways sharing Redis tell their own predictions from the others' by it.
    default_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    gw = Gateway(config, gateway_id or config.gateway_id or default_id)
    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=[_errors])
    app[GATEWAY] = gw
    if config_path is not None:
        app[CONFIG_PATH] = config_path
    for path, route in NAMED_ROUTES.items():
        app.router.add_post(path, _proxy(route))
    app.router.add_get("/v1/models", models)
    for method in PROXIED_METHODS:
        app.router.add_route(method, "/v1/{tail:.*}", _proxy(None))
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/admin/replicas", list_replicas)
    app.router.add_post("/admin/replicas", add_replica)
    app.router.add_post("/admin/replicas/{id}/{action:drain|undrain}", drain_replica)
    app.router.add_delete("/admin/replicas/{id}", remove_replica)
    app.router.add_get("/debug/route", debug_route)
    app.router.add_post("/debug/route", debug_route)
    app.cleanup_ctx.append(_lifecycle)
    return app
