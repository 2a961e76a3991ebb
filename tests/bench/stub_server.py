"""A stub HTTP server for the harness's and the chaos clients' tests: a few aiohttp routes served on
loopback for one `with` block, standing in for a gateway or a worker that would take seconds to start."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web

from tests.support.servers import ServerThread

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.contextmanager
def serving(*routes: tuple[str, str, Handler]) -> Iterator[str]:
    """The base URL of a server answering each (method, path, handler), stopped after the block."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    server = ServerThread(app)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()
