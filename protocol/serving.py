"""How both servers run: aiohttp's run_app with the settings the request paths rely on, and the
latency buckets both export, so a dashboard reads a worker's and a gateway's histograms alike."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("prefixgate")

# The Content-Type of a /metrics answer.
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
# From a few ms (a cached prompt on a GPU) to minutes (a long queue on a laptop CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def serve(app: web.Application, **where: Any) -> None:
    """Run until interrupted, with handler cancellation on: a client that leaves cancels its handler,
    which aborts its work upstream (a worker's sequence, a gateway's upstream request). `where` is
    run_app's host and port, or sock."""
    web.run_app(app, handler_cancellation=True, access_log=None, print=log.info, **where)
