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
import logging
import os
import secrets
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from gateway.gateway import Gateway
from gateway.gateway_config import GatewayConfig, load_config
from gateway.http.admin import add_replica, debug_route, drain_replica, list_replicas, remove_replica
from gateway.http.handlers import PROXIED_METHODS, health, live, metrics, models, openapi, proxy_handler
from gateway.http.keys import CONFIG_PATH, GATEWAY, STATE
from gateway.http.middleware import errors
from gateway.http.reading import NAMED_ROUTES
from gateway.sync.siblings import Siblings
from policies import ConfigError

log = logging.getLogger("prefixgate.gateway")


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
    config: GatewayConfig,
    *,
    config_path: Path | None = None,
    gateway_id: str | None = None,
    siblings: Siblings | None = None,
) -> web.Application:
    # Unique per instance: gateways sharing Redis tell their own predictions from the others' by it.
    default_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    gw = Gateway(config, gateway_id or config.gateway_id or default_id, siblings)
    app = web.Application(client_max_size=config.limits.max_body_bytes, middlewares=[errors])
    app[GATEWAY] = gw
    app[STATE] = gw.state
    if config_path is not None:
        app[CONFIG_PATH] = config_path
    for path, route in NAMED_ROUTES.items():
        app.router.add_post(path, proxy_handler(route))
    app.router.add_get("/v1/models", models)
    for method in PROXIED_METHODS:
        app.router.add_route(method, "/v1/{tail:.*}", proxy_handler(None))
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
