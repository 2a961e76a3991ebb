"""Reading a Redis stream from a cursor, as both stream followers do (the KV events of bundled workers,
gateway.sync.bundled_events; the shared predictions, gateway.fleet.predictions)."""

from __future__ import annotations

from collections.abc import Mapping

from redis.asyncio import Redis

from protocol.cancellation import check_cancelled

# XREAD BLOCK per call; must stay below the Redis client's socket timeout, or an idle stream reads as
# an outage.
BLOCK_MS = 1000
# Stream entries per XREAD: bounds one read's work on the event loop after a backlog.
READ_COUNT = 256


def _text(value: str | bytes) -> str:
    """Clients with and without decode_responses both work."""
    return value.decode() if isinstance(value, bytes) else value


def entry_time(entry_id: str) -> float:
    """When Redis added a stream entry (its id's millisecond part), in Unix seconds."""
    return int(entry_id.split("-", 1)[0]) / 1000


async def stream_tail(redis: Redis, key: str) -> str:
    """The id of the stream's newest entry ("0-0" when it has none). Reading after it misses nothing
    added from now on, unlike XREAD's "$", which means "newest" anew at every call."""
    newest = await redis.xrevrange(key, count=1)
    check_cancelled()
    return _text(newest[0][0]) if newest else "0-0"


async def read_stream(
    redis: Redis, key: str, after: str, count: int, block_ms: int
) -> list[tuple[str, Mapping[str, str]]]:
    """Up to `count` entries after `after`, waiting up to `block_ms` for one; ids and fields as text."""
    reply = await redis.xread({key: after}, count=count, block=block_ms)
    check_cancelled()
    return [
        (_text(entry_id), {_text(k): _text(v) for k, v in fields.items()})
        for _, entries in reply
        for entry_id, fields in entries
    ]
