"""The event feed between the engine thread's KV event log and the loop's long-polls
(workers.event_feed): readers get what is there at once, wait for what is not, and are all let go
when the worker closes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

from workers.event_feed import EventFeed
from workers.kv_event_log import KVEventLog


def on_a_started_feed(check: Callable[[KVEventLog, EventFeed], Awaitable[None]]) -> None:
    """Run `check` on its own loop against a fresh log's feed, started there and closed after."""

    async def main() -> None:
        events = KVEventLog()
        feed = EventFeed(events)
        feed.start()
        try:
            await check(events, feed)
        finally:
            feed.close()

    asyncio.run(main())


def test_what_is_already_there_comes_at_once_and_sealed_on_the_way() -> None:
    async def check(events: KVEventLog, feed: EventFeed) -> None:
        events.on_stored([11], None)
        started = time.monotonic()
        batches = await feed.wait_after(1, timeout=5)
        assert time.monotonic() - started < 1
        assert [b.seq for b in batches] == [2] and batches[0].events[0].type == "stored"

    on_a_started_feed(check)


def test_a_reader_waits_until_the_engine_thread_stores_a_block() -> None:
    async def check(events: KVEventLog, feed: EventFeed) -> None:
        reader = asyncio.create_task(feed.wait_after(1, timeout=10))
        await asyncio.sleep(0.05)
        assert not reader.done()
        engine = threading.Thread(target=events.on_stored, args=([21, 22], None))
        engine.start()
        engine.join()
        batches = await asyncio.wait_for(reader, 5)
        assert [b.seq for b in batches] == [2] and events.num_cached == 2

    on_a_started_feed(check)


def test_a_quiet_wait_ends_empty_at_its_timeout_and_the_limit_caps_a_reply() -> None:
    async def check(events: KVEventLog, feed: EventFeed) -> None:
        started = time.monotonic()
        assert await feed.wait_after(1, timeout=0.1) == []
        assert 0.1 <= time.monotonic() - started < 2
        for block in range(3):
            events.on_stored([100 + block], None)
            feed.flush()
        assert [b.seq for b in await feed.wait_after(0, timeout=0, limit=2)] == [1, 2]

    on_a_started_feed(check)


def test_closing_the_feed_releases_every_waiting_reader_and_stops_sealing() -> None:
    async def check(events: KVEventLog, feed: EventFeed) -> None:
        readers = [asyncio.create_task(feed.wait_after(1, timeout=30)) for _ in range(3)]
        await asyncio.sleep(0.05)
        feed.close()
        assert await asyncio.wait_for(asyncio.gather(*readers), 5) == [[], [], []]
        assert events.on_pending is None

    on_a_started_feed(check)


def test_a_feed_not_started_reads_without_waiting() -> None:
    async def main() -> None:
        feed = EventFeed(KVEventLog())
        started = time.monotonic()
        assert await feed.wait_after(1, timeout=30) == []
        assert time.monotonic() - started < 1

    asyncio.run(main())
