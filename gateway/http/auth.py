"""Who may call which route: API keys on the API routes; the admin token, or loopback only, on the admin
and debug routes, with what a tokenless admin API trusts (docs/security.md)."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from aiohttp import web

from gateway.gateway_state import GatewayState
from gateway.http.reading import proxied_path
from protocol.errors import ApiError

# Admin routes that act on what their body says, and the one content type they take.
_JSON = "application/json"
_MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _bearer(header: str) -> bytes | None:
    """The bearer token's bytes of an Authorization header, as the client sent them (aiohttp hands
    header values over as UTF-8 with surrogate escapes, which give them back), or None when there is
    none."""
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


def authorize(state: GatewayState, request: web.Request) -> None:
    """API keys on the API routes; on the admin and debug routes, the admin token, or none at all.

    What the admin API trusts: with a token, whoever sends it. Without one (allowed only on a loopback
    listener), whoever can open a connection to that listener: every local user and process. A web
    page the operator visits can make the browser send requests there too; these are refused: a
    request from another origin (its Origin, or Sec-Fetch-Site other than same-origin or none), a Host
    that is not a loopback name or address with the listener's port (a page's own name, which DNS
    rebinding points at 127.0.0.1), and a mutating request whose body is not JSON (the forms and plain
    text a page may send without asking first: 415)."""
    path = request.path
    if proxied_path(path):
        check_api_key(state, request.headers.get("Authorization", ""))
    elif path.startswith(("/admin/", "/debug/")):
        admin = state.config.admin_token()
        if admin is None:
            if not _is_loopback(state.config.listen.host):
                raise ApiError(
                    403,
                    "admin routes are off: set auth.admin_token_env to enable them",
                    code="admin_disabled",
                    type="permission_error",
                )
            _loopback_host(request)
        _same_origin(request)
        if admin is not None and not _matches(_bearer(request.headers.get("Authorization", "")), [admin]):
            raise ApiError(
                401, "the admin token is required", code="invalid_admin_token", type="authentication_error"
            )
        _json_only(request)


def check_api_key(state: GatewayState, authorization: str) -> None:
    """A 401 unless the Authorization header holds one of the API keys (where any are configured)."""
    keys = state.config.api_keys()
    if keys and not _matches(_bearer(authorization), keys):
        raise ApiError(
            401,
            "a valid API key is required (Authorization: Bearer KEY)",
            code="invalid_api_key",
            type="authentication_error",
        )


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
