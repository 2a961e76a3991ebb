"""How both servers run: aiohttp's run_app with the settings the request paths rely on, and the
latency buckets both export, so a dashboard reads a worker's and a gateway's histograms alike."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from typing import Any, Literal

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("prefixgate")

# The Content-Type of a /metrics answer.
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
# From a few ms (a cached prompt on a GPU) to minutes (a long queue on a laptop CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


EventLoop = Literal["auto", "uvloop", "asyncio"]
EVENT_LOOPS: tuple[EventLoop, ...] = ("auto", "uvloop", "asyncio")


def new_event_loop(kind: EventLoop = "auto") -> asyncio.AbstractEventLoop:
    """uvloop's loop (libuv: its sockets, timers and callbacks cost a fraction of asyncio's pure-Python
    ones, which a proxy pays several times a request) where asked for or, with `auto`, installed (the
    `fast` extra); asyncio's otherwise. Asking for uvloop where it is missing is an error, not a
    silent fallback."""
    if kind == "uvloop" or (kind == "auto" and importlib.util.find_spec("uvloop") is not None):
        try:
            import uvloop
        except ImportError as error:
            raise SystemExit(
                f"--event-loop uvloop: uvloop is not installed ({error}); pip install 'prefixgate[fast]'"
            ) from None
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def serve(app: web.Application, event_loop: EventLoop = "auto", **where: Any) -> None:
    """Run until interrupted, on `event_loop` (new_event_loop), with handler cancellation on: a client
    that leaves cancels its handler, which aborts its work upstream (a worker's sequence, a gateway's
    upstream request). `where` is run_app's host and port, or sock."""
    loop = new_event_loop(event_loop)
    log.info("event loop: %s", type(loop).__module__.split(".")[0])
    web.run_app(app, handler_cancellation=True, access_log=None, print=log.info, loop=loop, **where)
