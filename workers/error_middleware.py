"""The middleware every worker request passes: any failure becomes OpenAI's error JSON (aiohttp's own
404/405/413 included, and a crash a 500 that says nothing of it), and every request is counted by
its route and status (499 for a client that left)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from protocol.errors import CLIENT_GONE, ApiError
from workers.app_state import RUNTIME

log = logging.getLogger("prefixgate.worker")


def endpoint_label(request: web.Request) -> str:
    """The route's template as the metrics label; never the raw path, whose values are unbounded."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.to_json(), status=error.status, headers=error.headers)


@web.middleware
async def errors_and_metrics(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure as OpenAI's error JSON (aiohttp's own 404/405/413 included), every request counted."""
    metrics = request.app[RUNTIME].metrics
    try:
        response = await handler(request)
    except ApiError as error:
        response = _error_response(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        code = error.reason.lower().replace(" ", "_")
        response = _error_response(ApiError(error.status, error.text or error.reason, code=code))
    except asyncio.CancelledError:
        metrics.observe_request(endpoint_label(request), CLIENT_GONE)
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        response = _error_response(ApiError(500, "internal error in the worker", code="internal_error"))
    metrics.observe_request(endpoint_label(request), response.status)
    return response
