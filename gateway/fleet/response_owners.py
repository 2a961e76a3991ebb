"""Which replica produced which response, for the Responses API's `previous_response_id`.

A stored response lives on the replica that produced it: a request that continues it (or GETs,
DELETEs or cancels it) can only be served there, whatever its prefix or the replica's load says. So
the gateway remembers the owner of every response it relays, in a bounded local map and, when Redis
is configured, under `prefixgate:response:{id}` (protocol.redis_keys) with the same expiry, so that a
client may continue a conversation through any gateway of the fleet. Without Redis, the processes of
one `serve --workers N` tell each other instead (`share`, gateway.sync.siblings).

The owner is written to Redis before the client has the response (inline, under a short timeout):
a client that sends its follow-up to another gateway the moment it reads the answer must find it
there. Redis being down only narrows this back to the gateway that saw the response; it never fails
or slows a request by more than the timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from protocol.redis_keys import response_key

log = logging.getLogger("prefixgate.gateway.responses")

# The most a request waits on Redis to record or find an owner.
REDIS_WAIT_S = 0.25


class ResponseOwners:
    def __init__(
        self,
        *,
        ttl_s: float,
        max_entries: int,
        redis: Redis | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.redis = redis
        self.clock = clock
        # response id -> (replica id, expiry in Unix seconds), least recently used first.
        self._owners: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.redis_errors = 0
        # Without Redis: tells the sibling processes (response id, replica id, expiry).
        self.share: Callable[[str, str, float], None] | None = None

    def __len__(self) -> int:
        return len(self._owners)

    async def remember(self, response_id: str, replica_id: str) -> None:
        expires_at = self.clock() + self.ttl_s
        self.keep(response_id, replica_id, expires_at)
        if self.redis is None:
            if self.share is not None:
                self.share(response_id, replica_id, expires_at)
            return
        try:
            async with asyncio.timeout(REDIS_WAIT_S):
                await self.redis.set(response_key(response_id), replica_id, ex=max(1, round(self.ttl_s)))
        except (TimeoutError, RedisError, OSError) as error:
            self._failed("recording", error)

    async def owner(self, response_id: str) -> str | None:
        """The replica holding `response_id`, from this gateway's map, else from Redis."""
        now = self.clock()
        found = self._owners.get(response_id)
        if found is not None:
            if found[1] > now:
                self._owners.move_to_end(response_id)
                return found[0]
            del self._owners[response_id]
        if self.redis is None:
            return None
        key = response_key(response_id)
        try:
            async with asyncio.timeout(REDIS_WAIT_S):
                async with self.redis.pipeline(transaction=False) as pipe:
                    replica, ttl = await pipe.get(key).ttl(key).execute()
        except (TimeoutError, RedisError, OSError) as error:
            self._failed("reading", error)
            return None
        if replica is None:
            return None
        replica = replica.decode() if isinstance(replica, bytes) else str(replica)
        self.keep(response_id, replica, now + (ttl if isinstance(ttl, int) and ttl > 0 else self.ttl_s))
        return replica

    def keep(self, response_id: str, replica_id: str, expires_at: float) -> None:
        self._owners[response_id] = (replica_id, expires_at)
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def _failed(self, what: str, error: BaseException) -> None:
        if self.redis_errors == 0:
            log.warning("response owners: %s in Redis failed: %r (logged once)", what, error)
        self.redis_errors += 1
