"""The gateway's one middleware: authorization first, then every refusal as OpenAI's error JSON,
aiohttp's own 404/405/413 included, and never a bare 500."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from gateway.forward.outcome import ACCOUNTED
from gateway.http.auth import authorize
from gateway.http.keys import STATE
from gateway.http.reading import proxied_path, route_of
from protocol.errors import CLIENT_GONE, ApiError

log = logging.getLogger("prefixgate.gateway")


@web.middleware
async def errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every refusal as OpenAI's error JSON, aiohttp's own 404/405/413 included; never a bare 500."""
    state = request.app[STATE]
    try:
        authorize(state, request)
        return await handler(request)
    except ApiError as error:
        if proxied_path(request.path):
            state.metrics.requests.labels(
                "", "", state.policy.name, str(error.status), route_of(request)
            ).inc()
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
        if proxied_path(request.path) and not request.get(ACCOUNTED):
            state.metrics.requests.labels(
                "", "", state.policy.name, str(CLIENT_GONE), route_of(request)
            ).inc()
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        api = ApiError(500, "internal error in the gateway", code="internal_error")
        return web.json_response(api.to_json(), status=500)
