"""The bridge between the engine thread's KV event log and the event loop's readers: batches are
sealed on the loop and long-polls wake when one is (the /kv/events feed and the publishers)."""

from __future__ import annotations

import asyncio

from protocol.kv_events import EventBatch
from workers.kv_event_log import KVEventLog


class EventFeed:
    """Seals the log's pending events on the event loop and wakes the readers waiting for them.

    The log calls `_kick` on the engine thread when a burst of events begins; the seal then runs on
    the loop, so readers and sealing never race with each other, only (under the log's lock) with
    the engine appending.
    """

    def __init__(self, events: KVEventLog) -> None:
        self.events = events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._new: asyncio.Event | None = None
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._new = asyncio.Event()
        self.events.on_pending = self._kick
        self.flush()

    def close(self) -> None:
        """Stop sealing and release every waiting reader (the worker is going away)."""
        self.events.on_pending = None
        self._closed = True
        if self._new is not None:
            self._new.set()

    def _kick(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self.flush)
        except RuntimeError:  # the loop closed under us: nobody is left to read
            self.events.on_pending = None

    def flush(self) -> EventBatch | None:
        batch = self.events.seal()
        if batch is not None and self._new is not None:
            self._new.set()
            self._new = asyncio.Event()
        return batch

    async def wait_after(self, seq: int, timeout: float, limit: int | None = None) -> list[EventBatch]:
        """The batches after `seq`, waiting up to `timeout` seconds for one when there are none yet."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.flush()
            batches = self.events.after(seq, limit)
            remaining = deadline - loop.time()
            if batches or remaining <= 0 or self._closed or self._new is None:
                return batches
            try:
                async with asyncio.timeout(remaining):
                    await self._new.wait()
            except TimeoutError:
                return []
