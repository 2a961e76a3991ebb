"""Approximate mode (docs/design.md §4): predicted cache entries for backends that publish no KV events.

A foreign backend (vLLM, SGLang) tells nobody what it caches, so the gateway assumes that a replica
holds a request's prefix for `ttl_s` after it routed the request there, and lets the replica's
capacity bound in the index (LRU) stand in for evictions. With several gateways each would only know
its own decisions, so each one also publishes them to the Redis stream `prefixgate:predictions`
(protocol.redis_keys) and inserts the others' with the same absolute expiry: all of them then predict
the same cache. Expiry times are Unix seconds, comparable across gateways as far as their clocks agree.
The processes of one `serve --workers N` without Redis share the same entries through
gateway.sync.siblings (`share`) instead.

Publishing never delays a request: `record` only queues, and a background task writes in batches.
Predictions are worth little once old, so when Redis is down a full queue drops new ones, and those
that expire before Redis takes them are never sent. A gateway that starts reads the stream from
`ttl_s` ago, so it begins with the predictions still alive rather than with none.

Expiry: the index keeps expired entries until `expire(now)` runs (matching never looks at the
clock), so a sweep task here runs it every `sweep_s`; a stale prediction outlives its expiry by at most
that. The index is touched only from the event loop, like everything else that uses it.

Predictions correct themselves (`learn`): what a replica reports it reused of a request's prompt
(`usage.prompt_tokens_details.cached_tokens`) evicts the predicted blocks it turned out not to hold
and corrects the replica's capacity bound in the index (RadixIndex.correct), so the configured
capacity is only a prior. A capacity learned here is published on the same stream, and the other
gateways take it.

What the stream holds is another process's word: each entry is validated (hashes unsigned 64-bit and
bounded in number, an expiry that is a finite time no further off than CLOCK_SKEW_S past this
gateway's own TTL, a positive bounded capacity) and one that fails is skipped and counted
(gateway.rejections); the cursor moves past it whatever it held.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec
from redis.asyncio import Redis

from gateway.rejections import Rejections
from gateway.sync.bundled_wire import MALFORMED, BlockHash, checked_hashes
from gateway.sync.redis_streams import BLOCK_MS, READ_COUNT, read_stream
from protocol.backoff import RETRY_MAX_S, Backoff
from protocol.cancellation import check_cancelled
from protocol.redis_keys import PREDICTIONS
from radix.capacity import Predicted
from radix.index import RadixIndex

log = logging.getLogger("prefixgate.gateway.predictions")

# About this many entries stay in the stream: one per routed request, a few KB each at most.
STREAM_MAXLEN = 10_000
QUEUE_SIZE = 10_000
# Entries per XADD pipeline.
PUBLISH_BATCH = 256
SWEEP_S = 1.0
# An entry's hashes, at most: a request's prompt of a million tokens in 16-token blocks.
MAX_PREDICTED_HASHES = 1 << 16
MAX_CAPACITY_BLOCKS = 1 << 32
# Another gateway's clock may run ahead of this one's by this much: an expiry further off than that
# past this gateway's TTL is held to it.
CLOCK_SKEW_S = 60.0

_HASHES = msgspec.json.Decoder(Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_PREDICTED_HASHES)])

Clock = Callable[[], float]


@dataclass(slots=True)
class PredictionStats:
    """Counters for metrics and the admin API."""

    recorded: int = 0
    # Reports of what a replica reused, applied to the index.
    learned: int = 0
    published: int = 0
    # Never published: the queue was full, or they expired while Redis was unreachable.
    dropped: int = 0
    # Other gateways' entries inserted into the index, and those skipped: this gateway's own, for a
    # replica it does not know, or expired on arrival.
    received: int = 0
    own: int = 0
    unknown_replica: int = 0
    expired: int = 0
    errors: int = 0
    last_error: str | None = None


class Predictions:
    """This gateway's routing decisions as TTL'd index entries, shared with the other gateways."""

    def __init__(
        self,
        index: RadixIndex,
        *,
        ttl_s: float,
        redis: Redis | None = None,
        gateway_id: str | None = None,
        clock: Clock = time.time,
        stream: str = PREDICTIONS,
        stream_maxlen: int = STREAM_MAXLEN,
        block_ms: int = BLOCK_MS,
        sweep_s: float = SWEEP_S,
        retry_max_s: float = RETRY_MAX_S,
        rejections: Rejections | None = None,
    ) -> None:
        if ttl_s <= 0 or sweep_s <= 0 or stream_maxlen < 1:
            raise ValueError(
                f"ttl_s, sweep_s and stream_maxlen must be positive: {ttl_s}, {sweep_s}, {stream_maxlen}"
            )
        self.index = index
        self.ttl_s = ttl_s
        self.redis = redis
        # Only needs to differ between the gateways sharing the stream: a fresh one per process will do.
        self.gateway_id = gateway_id or secrets.token_hex(6)
        self.clock = clock
        self.stream = stream
        self.stream_maxlen = stream_maxlen
        self.block_ms = block_ms
        self.sweep_s = sweep_s
        self.retry_max_s = retry_max_s
        self.stats = PredictionStats()
        self.rejections = rejections or Rejections()
        # (expiry, stream entry): predictions, and learned capacities.
        self._queue: asyncio.Queue[tuple[float, dict[str, str]]] = asyncio.Queue(QUEUE_SIZE)
        self._tasks: list[asyncio.Task[None]] = []
        # Without Redis, where this process's entries go to its siblings (set by gateway.sync.siblings).
        self.share: Callable[[dict[str, str]], None] | None = None

    def start(self) -> None:
        """Start the expiry sweep and, with Redis, the publisher and the follower (on the running loop)."""
        self._tasks = [asyncio.create_task(self._sweep(), name="predictions:sweep")]
        if self.redis is not None:
            self._tasks += [
                asyncio.create_task(self._publish(self.redis), name="predictions:publish"),
                asyncio.create_task(self._follow(self.redis), name="predictions:follow"),
            ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def record(self, replica_id: str, hashes: Sequence[int], now: float | None = None) -> None:
        """The gateway routed a request with these block hashes to `replica_id` (in the index): predict
        that the replica caches them until now + ttl_s, here at once and, through Redis, everywhere."""
        if not hashes:
            return
        expires_at = (self.clock() if now is None else now) + self.ttl_s
        self.index.insert(replica_id, hashes, expires_at=expires_at)
        self.stats.recorded += 1
        if self.redis is not None or self.share is not None:  # costly to encode for no one
            encoded = msgspec.json.encode(hashes).decode()
            self._publish_later(
                expires_at, {"replica": replica_id, "expires_at": repr(expires_at), "hashes": encoded}
            )

    def released(self, replica_id: str, hashes: Sequence[int]) -> None:
        """A request with these block hashes ended on `replica_id`: an engine's cache orders blocks by
        when their sequence let go of them, so they are touched again here (not shared: each gateway
        sees its own requests end)."""
        self.index.insert(replica_id, hashes, expires_at=self.clock() + self.ttl_s)

    def learn(self, replica_id: str, predicted: Predicted, realised: int) -> None:
        """The replica reused the first `realised` blocks of a request `predicted` there (taken before
        the request was recorded): correct the index, and share a capacity that changed."""
        before = self.index.capacity_of(replica_id)
        self.index.correct(replica_id, predicted, realised)
        self.stats.learned += 1
        after = self.index.capacity_of(replica_id)
        if after is not None and after != before:
            self._publish_later(self.clock() + self.ttl_s, {"replica": replica_id, "capacity": str(after)})

    def take(self, fields: Mapping[str, str]) -> None:
        """A sibling process's entry, checked as one from Redis."""
        self._take("sibling", fields, set(self.index.replicas), self.clock())

    def _publish_later(self, expires_at: float, fields: dict[str, str]) -> None:
        if self.redis is None:
            if self.share is not None:
                self.share({"gateway": self.gateway_id, **fields})
            return
        try:
            self._queue.put_nowait((expires_at, {"gateway": self.gateway_id, **fields}))
        except asyncio.QueueFull:
            self.stats.dropped += 1

    # -- background tasks ------------------------------------------------------------------------

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            self.index.expire(self.clock())

    def _failed(self, what: str, backoff: Backoff, error: Exception) -> float:
        if not backoff.failing:
            log.warning("predictions: %s failed: %r; retrying with backoff", what, error)
        self.stats.errors += 1
        self.stats.last_error = f"{what}: {type(error).__name__}: {error}"
        return backoff.failed()

    async def _publish(self, redis: Redis) -> None:
        backoff = Backoff(most_s=self.retry_max_s)
        pending: list[tuple[float, dict[str, str]]] = []
        while True:
            check_cancelled()
            if not pending:
                pending.append(await self._queue.get())
            while len(pending) < PUBLISH_BATCH and not self._queue.empty():
                pending.append(self._queue.get_nowait())
            now = self.clock()
            live = [p for p in pending if p[0] > now]
            self.stats.dropped += len(pending) - len(live)
            pending = live
            if not pending:
                continue
            try:
                async with redis.pipeline(transaction=False) as pipe:
                    for _, fields in pending:
                        pipe.xadd(self.stream, fields, maxlen=self.stream_maxlen, approximate=True)
                    await pipe.execute()
            except Exception as error:
                await asyncio.sleep(self._failed("publishing", backoff, error))
                continue
            backoff.succeeded()
            self.stats.published += len(pending)
            pending = []

    async def _follow(self, redis: Redis) -> None:
        backoff = Backoff(most_s=self.retry_max_s)
        # The entries that may still be alive; ids are Redis's clock in milliseconds.
        after = f"{max(0, int((self.clock() - self.ttl_s) * 1000))}-0"
        while True:
            check_cancelled()
            try:
                entries = await read_stream(redis, self.stream, after, READ_COUNT, self.block_ms)
            except Exception as error:
                await asyncio.sleep(self._failed("reading", backoff, error))
                continue
            backoff.succeeded()
            known = set(self.index.replicas)
            now = self.clock()
            for entry_id, fields in entries:
                after = entry_id
                self._take(entry_id, fields, known, now)

    def _take(self, entry_id: str, fields: Mapping[str, str], known: set[str], now: float) -> None:
        try:
            gateway, replica = fields["gateway"], fields["replica"]
            capacity = int(fields["capacity"]) if "capacity" in fields else None
            if capacity is None:
                expires_at = float(fields["expires_at"])
                if not math.isfinite(expires_at):
                    raise ValueError(f"expires_at {expires_at} is no time")
                # Held to what this gateway would predict itself, so none outlives the TTL for long.
                expires_at = min(expires_at, now + self.ttl_s + CLOCK_SKEW_S)
                hashes = _HASHES.decode(fields["hashes"])
                checked_hashes(hashes)
            elif not 0 < capacity <= MAX_CAPACITY_BLOCKS:
                raise ValueError(f"capacity {capacity} is not in 1..{MAX_CAPACITY_BLOCKS}")
        except MALFORMED as error:
            self.stats.errors += 1
            self.stats.last_error = f"malformed entry {entry_id}: {error!r}"
            self.rejections.reject("predictions", f"{self.stream} entry {entry_id}", error)
            return
        if gateway == self.gateway_id:
            self.stats.own += 1
        elif replica not in known or (capacity is not None and not self.index.learns(replica)):
            self.stats.unknown_replica += 1
        elif capacity is not None:
            self.index.set_capacity(replica, capacity)
            self.stats.received += 1
        elif expires_at <= now:
            self.stats.expired += 1
        else:
            self.index.insert(replica, hashes, expires_at=expires_at)
            self.stats.received += 1
