"""Loopback servers for tests: an aiohttp app served in a thread of its own, and free ports."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from protocol.loopback_ports import distinct_ports, free_port

__all__ = ["ServerThread", "distinct_ports", "free_port"]


class ServerThread:
    """An aiohttp app served on 127.0.0.1 by an event loop of its own, in a background thread, with
    the settings `prefixgate worker` uses (handler cancellation on disconnect). `port` 0 picks a free
    one; a fixed one lets a test restart a worker where its clients expect it."""

    def __init__(self, app: web.Application, port: int = 0, host: str = "127.0.0.1") -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="test-server", daemon=True)
        self._error: BaseException | None = None
        self.port = port
        # Another loopback address (127.0.0.2, ...) lets servers share a port, as pods of one pool do.
        self.host = host

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port)
            self.loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
        except BaseException as error:
            self._error = error
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._runner.cleanup())
        self.loop.close()

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(60):
            raise TimeoutError("the test server did not start")
        if self._error is not None:
            raise self._error
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
