"""The Redis client both sides use for shared state (docs/design.md §4; key names in protocol.redis_keys)."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def connect(url: str, timeout_s: float, *, decode_responses: bool = False) -> Redis:
    """A client that fails fast instead of retrying on its own: the caller's tasks do the retrying,
    with backoff, and a call must never hang on a dead server for longer than `timeout_s`."""
    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=decode_responses,
        # A value that is not UTF-8 reads as text with U+FFFD in it, which fails validation as that one
        # value; the default ("strict") failed the whole reply: a pipeline, or every read of a stream.
        encoding_errors="replace",
    )
