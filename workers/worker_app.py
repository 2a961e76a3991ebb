"""The bundled worker's aiohttp app: its route table and its lifecycle (docs/design.md §4).

The app is built from a `Worker` and owns its lifecycle: it starts the event feed on its loop and
shuts the engine down when it stops. Other transports (Redis registry, heartbeats, event stream)
plug in as extra aiohttp cleanup contexts that find everything under `app[RUNTIME]`.

The app must run with `handler_cancellation=True` (protocol.serving.serve): a client that goes away then
cancels its handler, which closes its generation stream, which aborts the request (all of its n
choices) and frees its KV blocks at once instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from workers.admission import Admission
from workers.app_state import RUNTIME, Context, Runtime
from workers.bundled_worker import Worker
from workers.disaggregation_routes import kv_prefill, transfer_context
from workers.error_middleware import errors_and_metrics
from workers.event_feed import EventFeed
from workers.event_routes import kv_events, kv_snapshot
from workers.openai_routes import chat_completions, completions
from workers.status_routes import health, load, metrics, models
from workers.worker_metrics import WorkerMetrics

log = logging.getLogger("prefixgate.worker")


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    rt.feed.start()
    info = rt.worker.info
    log.info(
        "worker %s serving %s as %s (block size %d, %d blocks, %s: %s), incarnation %s",
        info.worker_id,
        info.model,
        info.role,
        info.block_size,
        info.num_blocks,
        info.backend,
        info.backend_reason,
        rt.worker.events.incarnation,
    )
    yield
    rt.feed.close()
    rt.tokenize_pool.shutdown(wait=False)
    await asyncio.get_running_loop().run_in_executor(None, rt.worker.front.shutdown)


async def _release_pollers(app: web.Application) -> None:
    app[RUNTIME].feed.close()


def create_app(worker: Worker, *, contexts: Sequence[Context] = ()) -> web.Application:
    """The worker app. `contexts` are aiohttp cleanup contexts run after the worker's own start-up
    (the feed is live) and torn down before the engine stops: where a Redis registry or event
    publisher hooks in, reading `app[RUNTIME]`."""
    app = web.Application(client_max_size=worker.max_body_bytes, middlewares=[errors_and_metrics])
    app[RUNTIME] = Runtime(
        worker=worker,
        metrics=WorkerMetrics(worker.info.model),
        feed=EventFeed(worker.events),
        admission=Admission(worker.max_waiting),
    )
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv/snapshot", kv_snapshot)
    app.router.add_get("/kv/events", kv_events)
    app.router.add_post("/kv/prefill", kv_prefill)
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(transfer_context)
    app.cleanup_ctx.extend(contexts)
    app.on_shutdown.append(_release_pollers)
    return app
