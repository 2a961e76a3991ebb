"""Publishes a worker to Redis (docs/design.md §4 "Shared state in Redis"): its registry entry with a
heartbeat, its KV event batches on a stream, and its load; key names in protocol.redis_keys.

Redis is a side channel, never a dependency of serving: every write runs in a background task that
logs, backs off and retries, so a Redis that is down or slow neither crashes nor stalls the worker.
The heartbeat rewrites the whole entry each time, so a Redis that comes back (even empty, after a
restart) sees the worker again within one period. Event batches are published in order from the
worker's event ring, so those sealed while Redis was down are still sent once it returns, unless the
ring overflowed meanwhile: then the stream skips the lost numbers and consumers, seeing the gap,
resync from /kv/snapshot. A batch may also be sent twice (a pipeline cut mid-way is retried whole);
consumers skip the numbers they already applied.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web
from redis.asyncio import Redis
from redis.exceptions import RedisError

from protocol.backoff import Backoff
from protocol.cancellation import check_cancelled
from protocol.kv_events import EventBatch
from protocol.redis_client import connect
from protocol.redis_keys import WORKERS, kv_stream_key, load_key, worker_key
from workers.app_state import RUNTIME, Context, Runtime
from workers.kv_event_log import EventsGone

log = logging.getLogger("prefixgate.worker.redis")

# What a failed Redis call raises: redis-py's own errors, and socket errors (TimeoutError included).
REDIS_DOWN = (RedisError, OSError)
# Batches per XADD pipeline: bounds one round trip's size after an outage.
MAX_BATCHES_PER_WRITE = 256
# Time allowed at shutdown for the last batches and the unregistration, so a dead Redis cannot hold
# the worker's exit.
SHUTDOWN_TIMEOUT_S = 2.0

# Deletes the entry only if it is still this incarnation's: a restarted worker with the same id may
# already have registered, and its entry must survive the old process's exit.
_UNREGISTER = """
if redis.call('HGET', KEYS[1], 'incarnation') == ARGV[1] then
    redis.call('DEL', KEYS[1], KEYS[2])
    redis.call('SREM', KEYS[3], ARGV[2])
    return 1
end
return 0
"""


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    redis_url: str
    # Where gateways reach this worker; what it binds to (0.0.0.0, say) is not an address.
    advertise_url: str
    heartbeat_s: float = 1.0
    load_period_s: float = 0.2
    stream_maxlen: int = 10_000

    def __post_init__(self) -> None:
        if min(self.heartbeat_s, self.load_period_s) <= 0 or self.stream_maxlen < 1:
            raise ValueError(f"periods and stream length must be positive: {self}")

    @property
    def registry_ttl_s(self) -> float:
        """Three missed heartbeats: one late beat on a busy machine must not drop the worker."""
        return 3 * self.heartbeat_s

    @property
    def load_ttl_s(self) -> float:
        """A load report older than a few periods (at least a second) is worse than none."""
        return max(1.0, 5 * self.load_period_s)


def _failed(what: str, backoff: Backoff, error: BaseException) -> float:
    """The delay before a background task's next attempt; one log line per outage, not per attempt."""
    if not backoff.failing:
        log.warning("redis: %s failed (%s); retrying with backoff", what, str(error) or type(error).__name__)
    return backoff.failed()


def _succeeded(what: str, backoff: Backoff) -> None:
    if backoff.failing:
        log.info("redis: %s works again", what)
    backoff.succeeded()


class RedisPublisher:
    """Three background tasks (heartbeat, load, events), each retrying on its own, so that one kind of
    write that fails or lags never delays the others."""

    def __init__(self, redis: Redis, runtime: Runtime, config: PublisherConfig) -> None:
        self.redis = redis
        self.runtime = runtime
        self.config = config
        self.worker_id = worker_id = runtime.worker.info.worker_id
        self.keys = (worker_key(worker_id), kv_stream_key(worker_id), load_key(worker_id))
        # The last batch the stream holds (or that was skipped as lost).
        self.published_seq = 0
        self._tasks: list[asyncio.Task[None]] = []

    def registry_entry(self) -> dict[str, str | int]:
        info = self.runtime.worker.info
        return {
            "id": info.worker_id,
            "url": self.config.advertise_url,
            "model": info.model,
            "block_size": info.block_size,
            "num_blocks": info.num_blocks,
            "max_context_len": info.max_context_len,
            "backend": info.backend,
            "role": info.role,
            "incarnation": self.runtime.worker.events.incarnation,
        }

    def _backoff(self) -> Backoff:
        """Retries at most a heartbeat apart, so that a Redis that returns sees the worker again soon."""
        return Backoff(first_s=min(0.1, self.config.heartbeat_s), most_s=self.config.heartbeat_s)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._every("heartbeat", self.config.heartbeat_s, self._heartbeat)),
            asyncio.create_task(self._every("load report", self.config.load_period_s, self._report_load)),
            asyncio.create_task(self._stream_events()),
        ]

    async def stop(self) -> None:
        """Stop the tasks, send the batches still unsent, and leave the registry (best effort)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            async with asyncio.timeout(SHUTDOWN_TIMEOUT_S):
                await self._send_the_rest()
                registry, _, load = self.keys
                incarnation = self.runtime.worker.events.incarnation
                await self.redis.eval(_UNREGISTER, 3, registry, load, WORKERS, incarnation, self.worker_id)
        except REDIS_DOWN as error:
            log.warning("redis: could not unregister worker %s cleanly (%s)", self.worker_id, error)

    # -- registry and load -----------------------------------------------------------------------

    async def _every(self, what: str, period_s: float, action: Callable[[], Awaitable[None]]) -> None:
        backoff = self._backoff()
        while True:
            check_cancelled()
            try:
                await action()
            except REDIS_DOWN as error:
                await asyncio.sleep(_failed(what, backoff, error))
                continue
            _succeeded(what, backoff)
            await asyncio.sleep(period_s)

    async def _heartbeat(self) -> None:
        registry = self.keys[0]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(registry, mapping=self.registry_entry())
            pipe.pexpire(registry, int(self.config.registry_ttl_s * 1000))
            pipe.sadd(WORKERS, self.worker_id)
            await pipe.execute()

    async def _report_load(self) -> None:
        stats = await self.runtime.worker.front.stats()
        report = {
            "running": stats.running,
            "waiting": stats.waiting,
            "queued_prefill_tokens": stats.queued_prefill_tokens,
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_total": stats.kv_blocks_total,
            "ts": round(time.time(), 3),
        }
        await self.redis.set(self.keys[2], json.dumps(report), px=int(self.config.load_ttl_s * 1000))

    # -- KV events ---------------------------------------------------------------------------------

    def _unsent(self) -> list[EventBatch]:
        return self.runtime.worker.events.after(self.published_seq, MAX_BATCHES_PER_WRITE)

    async def _stream_events(self) -> None:
        backoff = self._backoff()
        feed = self.runtime.feed
        loop = asyncio.get_running_loop()
        while True:
            check_cancelled()
            asked = loop.time()
            try:
                batches = await feed.wait_after(
                    self.published_seq, self.config.heartbeat_s, MAX_BATCHES_PER_WRITE
                )
            except EventsGone as gone:
                log.warning(
                    "redis: batches %d..%d left the event ring unsent; consumers resync from /kv/snapshot",
                    self.published_seq + 1,
                    gone.seq,
                )
                self.published_seq = gone.seq
                continue
            if not batches:
                if loop.time() - asked < self.config.heartbeat_s / 2:
                    return  # the feed closed early: the worker is stopping, and stop() sends the rest
                continue
            try:
                await self._append(batches)
            except REDIS_DOWN as error:
                await asyncio.sleep(_failed("event stream", backoff, error))
                continue
            _succeeded("event stream", backoff)

    async def _send_the_rest(self) -> None:
        self.runtime.feed.flush()
        try:
            while batches := self._unsent():
                await self._append(batches)
        except EventsGone:
            log.warning("redis: the last batches left the event ring unsent")

    async def _append(self, batches: list[EventBatch]) -> None:
        stream = self.keys[1]
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch in batches:
                fields = {
                    "incarnation": batch.incarnation,
                    "seq": batch.seq,
                    "events": orjson.dumps([event.to_json() for event in batch.events]),
                }
                pipe.xadd(stream, fields, maxlen=self.config.stream_maxlen, approximate=True)
            await pipe.execute()
        self.published_seq = batches[-1].seq


def redis_context(config: PublisherConfig) -> Context:
    """The aiohttp cleanup context that runs a publisher for the app's worker."""

    async def publish(app: web.Application) -> AsyncIterator[None]:
        redis = connect(config.redis_url, timeout_s=max(0.5, config.heartbeat_s))
        publisher = RedisPublisher(redis, app[RUNTIME], config)
        log.info(
            "redis: publishing worker %s at %s to %s",
            publisher.worker_id,
            config.advertise_url,
            config.redis_url,
        )
        publisher.start()
        yield
        await publisher.stop()
        await redis.aclose()

    return publish
