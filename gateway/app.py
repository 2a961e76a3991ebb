"""The gateway's HTTP surface: the OpenAI API in front, admin and debug routes behind a token.

Validation reuses the workers' OpenAI parsing (workers.openai_api), so a request the gateway accepts
is one a bundled worker accepts, and every refusal has the same shape and status on both.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from gateway.config import GatewayConfig, ReplicaEntry, load_config
from gateway.gateway import Gateway
from gateway.metrics import CONTENT_TYPE
from gateway.openapi import OPENAPI
from gateway.proxy import ACCOUNTED, Routed, forward
from gateway.router import decide
from policies import ConfigError
from workers.openai_api import (
    CLIENT_GONE,
    RETRY_AFTER_S,
    ApiError,
    GenerationRequest,
    ServedModel,
    parse_chat,
    parse_completion,
    parse_json,
    sampling_params,
)

log = logging.getLogger("prefixgate.gateway")

GATEWAY = web.AppKey("gateway", Gateway)
CONFIG_PATH = web.AppKey("config_path", Path)
# Token ids are packed as uint32 for hashing: the widest vocabulary a model without tokenizer may use.
UNKNOWN_VOCAB = 2**32
# The request content codings aiohttp decodes (br and zstd only with optional packages, not installed:
# its parser refuses those itself).
DECODED_CODINGS = frozenset({"identity", "gzip", "deflate"})


# -- the OpenAI API -------------------------------------------------------------------------------


def _model_of(gw: Gateway, body: dict[str, Any]) -> str:
    name = body.get("model")
    models = gw.replicas.models()
    if name is None:
        if gw.config.model is not None and gw.config.model in models:
            return gw.config.model
        if len(models) == 1:
            return models[0]
        raise ApiError(
            400, f"model is required: this gateway serves {models}", param="model", code="model_required"
        )
    if not isinstance(name, str):
        raise ApiError(400, "model must be a string", param="model", code="invalid_value")
    if name not in models:
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this gateway serves {models}",
            param="model",
            code="model_not_found",
        )
    return name


async def _served(gw: Gateway, model: str) -> ServedModel:
    replicas = gw.replicas.serving(model)
    tokenizer = await gw.tokenizers.load(model)
    return ServedModel(
        name=model,
        vocab_size=len(tokenizer) if tokenizer is not None else UNKNOWN_VOCAB,  # type: ignore[arg-type]
        max_context_len=min(r.max_context_len for r in replicas),
        kv_capacity_tokens=max(r.block_size * r.capacity_blocks for r in replicas),
    )


def _session_key(gw: Gateway, request: web.Request, body: dict[str, Any]) -> str | None:
    value = request.headers.get(gw.config.routing.session_affinity.header)
    user = body.get("user")
    return value or (user if isinstance(user, str) else None)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    """One generation request, counted in the gateway's in-flight total from before its body is read
    until its response ends (or its client leaves): past `limits.max_inflight` it is refused with 429
    before it costs anything, which is what bounds the gateway's memory under a burst."""
    gw = request.app[GATEWAY]
    limit = gw.config.limits.max_inflight
    if gw.inflight >= limit:
        raise ApiError(
            429,
            f"the gateway is at its limit of {limit} requests in flight; retry shortly",
            code="gateway_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    gw.inflight += 1
    try:
        return await _route_and_forward(gw, request, chat)
    finally:
        gw.inflight -= 1


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


async def _route_and_forward(gw: Gateway, request: web.Request, chat: bool) -> web.StreamResponse:
    arrival = time.monotonic()
    raw = await read_body(gw, request)
    body = parse_json(raw)
    model = _model_of(gw, body)
    served = await _served(gw, model)
    gen: GenerationRequest = (parse_chat if chat else parse_completion)({**body, "model": model}, served)
    tokens = await gw.tokenizers.token_ids(gen, model)
    if tokens is not None:
        sampling_params(gen, len(tokens), served)  # the context-window checks, before any forwarding
    decision = decide(
        gw.policy, gw.index, gw.replicas.serving(model), tokens, _session_key(gw, request, body)
    )
    gw.metrics.child(gw.metrics.decision, gw.policy.name).observe(decision.seconds)
    if decision.order:
        chosen = gw.replicas.get(decision.order[0])
        if chosen is not None and not gw.precise(chosen) and decision.hashes.get(chosen.block_size):
            gw.predictions.record(chosen.id, decision.hashes[chosen.block_size], time.time())
    routed = Routed(
        model=model,
        path=request.path,
        raw=raw,
        body=body,
        tokens=tokens,
        tokenized=gen.token_ids is None,
        stream=gen.stream,
        decision=decision,
        arrival=arrival,
        authorization=request.headers.get("Authorization"),
    )
    return await forward(gw, request, routed)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


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
    gw = request.app[GATEWAY]
    replicas = gw.replicas.all()
    routable = sum(r.routable for r in replicas)
    degraded = gw.redis_ok is False
    body = {
        "status": ("degraded" if degraded else "ok") if routable else "unavailable",
        "gateway_id": gw.gateway_id,
        "replicas": {"routable": routable, "total": len(replicas), "pending": len(gw.pending)},
        "models": gw.replicas.models(),
        "policy": gw.policy.name,
        "redis": {"configured": gw.redis is not None, "ok": gw.redis_ok},
        "degraded": degraded,
    }
    return web.json_response(body, status=200 if routable else 503)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    gw.refresh_metrics()
    return web.Response(body=gw.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


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
    sync = gw.sync.states
    rows = []
    for r in gw.replicas.all():
        row = r.to_json() | {"index_blocks": gw.index.blocks_of(r.id)}
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
    (`messages` makes it a chat request)."""
    gw = request.app[GATEWAY]
    if request.method == "POST":
        body = parse_json(await read_body(gw, request))
    else:
        body = {k: request.query[k] for k in ("model", "prompt", "user") if k in request.query}
    chat = "messages" in body
    model = _model_of(gw, body)
    served = await _served(gw, model)
    gen = (parse_chat if chat else parse_completion)({**body, "model": model}, served)
    tokens = await gw.tokenizers.token_ids(gen, model)
    decision = decide(
        gw.policy, gw.index, gw.replicas.serving(model), tokens, _session_key(gw, request, body)
    )
    return web.json_response(
        {
            "model": model,
            "policy": gw.policy.name,
            "prompt_tokens": decision.prompt_tokens,
            "tokenized": tokens is not None,
            "order": decision.order,
            "decision_us": round(decision.seconds * 1e6, 1),
            "replicas": decision.explain(),
        }
    )


# -- middleware -----------------------------------------------------------------------------------


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _authorize(gw: Gateway, request: web.Request) -> None:
    path = request.path
    if path.startswith("/v1/"):
        keys = gw.config.api_keys()
        token = _bearer(request)
        if keys and not (token and any(hmac.compare_digest(token, k) for k in keys)):
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
            return
        token = _bearer(request)
        if not (token and hmac.compare_digest(token, admin)):
            raise ApiError(
                401, "the admin token is required", code="invalid_admin_token", type="authentication_error"
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
        if request.path.startswith("/v1/") and request.method == "POST":
            gw.metrics.requests.labels("", "", gw.policy.name, str(error.status)).inc()
        response = web.json_response(error.to_json(), status=error.status, headers=error.headers)
        if error.headers.get("Connection") == "close":
            response.force_close()  # no keep-alive (aiohttp still reads what is left, for 10 s at most)
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
        if request.path.startswith("/v1/") and not request.get(ACCOUNTED):
            gw.metrics.requests.labels("", "", gw.policy.name, str(CLIENT_GONE)).inc()
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
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
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
