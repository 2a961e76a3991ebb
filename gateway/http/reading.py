"""What the gateway reads of a client's HTTP request before routing it: which route it is, its body
(decoded, bounded in size and in time) and the headers that go upstream (its model and session key:
gateway.forward.choice)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.forward.internal_fields import INTERNAL_HEADER_PREFIX
from gateway.forward.relay_headers import HOP_BY_HOP, connection_named
from gateway.forward.request_view import Route
from gateway.gateway_state import GatewayState
from protocol.errors import ApiError
from protocol.openai_api import parse_json

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


def route_of(request: web.Request) -> Route:
    return NAMED_ROUTES.get(request.path, "other") if request.method == "POST" else "other"


def proxied_path(path: str) -> bool:
    """The API routes: keys apply, and their outcomes are counted."""
    return path.startswith("/v1/") or path in NAMED_ROUTES


def forwarded_headers(
    received: CIMultiDictProxy[str] | CIMultiDict[str], remote: str | None, scheme: str
) -> CIMultiDict[str]:
    """The client's end-to-end headers (`received`, from `remote` over `scheme`), as they go upstream
    (Authorization by the config's rule), each repeat kept (Cookie): less the hop-by-hop ones, those the
    client's Connection header names included.
    The gateway records its hop as a reverse proxy does: X-Forwarded-For gains the client's address
    after any the client sent (a replica trusts only the last one); X-Forwarded-Proto and
    X-Forwarded-Host, how the client reached the gateway, replace any the client sent. A `Forwarded`
    header goes as sent. `x-prefixgate-*` headers are the gateway's and its workers' alone (as the
    body's fields: gateway.forward.internal_fields), so a client's never go upstream."""
    named = connection_named(received)
    headers: CIMultiDict[str] = CIMultiDict()
    add = headers.add
    for k, v in received.items():
        low = k.lower()
        if low not in _NOT_FORWARDED and low not in named and not low.startswith(INTERNAL_HEADER_PREFIX):
            add(k, v)
    chain = [v for v in received.getall("X-Forwarded-For", ()) if v.strip()]
    if remote:
        chain.append(remote)
    if chain:
        headers["X-Forwarded-For"] = ", ".join(chain)
    headers["X-Forwarded-Proto"] = scheme
    host = received.get("Host")
    if host:
        headers["X-Forwarded-Host"] = host
    return headers


async def read_body(state: GatewayState, request: web.Request) -> bytes:
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
    timeout_s = state.config.limits.body_timeout_s
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


def json_body(request: web.Request, route: Route, raw: bytes) -> dict[str, Any] | None:
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
