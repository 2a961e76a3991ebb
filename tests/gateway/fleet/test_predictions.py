"""Approximate mode against a real redis-server: two gateways, each with its own index, predict the same
cache entries with the same expiry, each skipping its own entries and replicas it does not know."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from bench.probes import wait_for_async
from gateway.fleet.predictions import Predictions
from protocol.redis_keys import PREDICTIONS
from radix.index import RadixIndex

TTL_S = 30.0


def index_of(*replicas: str) -> RadixIndex:
    index = RadixIndex()
    for replica in replicas:
        index.add_replica(replica)
    return index


def holds_all(index: RadixIndex, replica: str, hashes: list[int]) -> bool:
    return all(index.holds(replica, h) for h in hashes)


def test_gateways_share_their_predictions_through_redis(redis_url: str) -> None:
    async def main() -> None:
        # One client decodes responses and the other does not: both shapes must work.
        async with (
            aioredis.from_url(redis_url, decode_responses=True) as redis_a,
            aioredis.from_url(redis_url) as redis_b,
        ):
            await redis_a.delete(PREDICTIONS)
            index_a, index_b = index_of("r1", "r2"), index_of("r1")
            a = Predictions(index_a, ttl_s=TTL_S, redis=redis_a, gateway_id="A", block_ms=100)
            b = Predictions(index_b, ttl_s=TTL_S, redis=redis_b, gateway_id="B", block_ms=100)
            a.start()
            b.start()
            try:
                now = time.time()
                shared = [11, 12, 13]
                a.record("r1", shared, now)
                assert holds_all(index_a, "r1", shared)  # locally at once
                await wait_for_async(
                    lambda: holds_all(index_b, "r1", shared), "B to receive A's prediction", timeout=5
                )
                assert b.stats.received == 1 and a.stats.published == 1

                b.record("r1", [21, 22])
                index_b.remove("r1", [21, 22])  # were B to re-insert its own entry, they would be back
                await wait_for_async(
                    lambda: b.stats.own == 1 and holds_all(index_a, "r1", [21, 22]), "B's echo", timeout=5
                )
                assert not index_b.holds("r1", 21) and not index_b.holds("r1", 22)

                before = len(index_b)
                a.record("r2", [31, 32])
                await wait_for_async(
                    lambda: b.stats.unknown_replica == 1, "B to skip a replica it lacks", timeout=5
                )
                assert len(index_b) == before and holds_all(index_a, "r2", [31, 32])

                # A gateway that starts now still gets the predictions that are alive.
                index_c = index_of("r1", "r2")
                c = Predictions(index_c, ttl_s=TTL_S, redis=redis_a, gateway_id="C", block_ms=100)
                c.start()
                await wait_for_async(lambda: c.stats.received == 3, "C to catch up", timeout=5)
                await c.close()
                assert holds_all(index_c, "r1", [*shared, 21, 22]) and holds_all(index_c, "r2", [31, 32])

                # The same expiry everywhere: just before it nothing goes; at it, A's first three go (the
                # later predictions expire later).
                for index in (index_a, index_b, index_c):
                    assert index.expire(now + TTL_S - 0.001) == 0
                    assert index.expire(now + TTL_S) == len(shared)
                    assert index is index_b or holds_all(index, "r1", [21, 22])
            finally:
                await a.close()
                await b.close()

    asyncio.run(main())


def test_predictions_expire_by_the_sweep_and_need_no_redis() -> None:
    now = [1000.0]
    index = index_of("r1")

    async def main() -> None:
        predictions = Predictions(index, ttl_s=5.0, clock=lambda: now[0], sweep_s=0.01)
        predictions.start()
        predictions.record("r1", [1, 2, 3])
        assert holds_all(index, "r1", [1, 2, 3])
        now[0] = 1004.9
        await asyncio.sleep(0.05)
        assert holds_all(index, "r1", [1, 2, 3])
        now[0] = 1005.0
        await wait_for_async(lambda: len(index) == 0, "the sweep", timeout=5)
        assert predictions.stats.recorded == 1 and predictions.stats.published == 0
        await predictions.close()

    asyncio.run(main())


def test_a_request_that_ends_last_is_what_a_full_replica_keeps_whenever_it_was_sent() -> None:
    """An engine's cache orders blocks by when their sequence let go of them: a long answer sent first
    and ended last keeps its prompt past a short one sent after it, and the index must say the same
    (else a correction or a capacity bound drops the history a conversation comes back to)."""
    now = [1000.0]
    index = RadixIndex()
    index.add_replica("r1", learn=True)
    predictions = Predictions(index, ttl_s=TTL_S, clock=lambda: now[0])
    long_answer, short_answer = [1, 2, 3], [4, 5, 6]
    predictions.record("r1", long_answer)
    predictions.record("r1", short_answer)
    now[0] += 1.0
    predictions.released("r1", short_answer)
    now[0] += 1.0
    predictions.released("r1", long_answer)
    index.set_capacity("r1", 3)
    assert holds_all(index, "r1", long_answer)
    assert not any(index.holds("r1", h) for h in short_answer)
    # Touched, not predicted anew: the expiry runs from the end, and nothing more was recorded.
    assert predictions.stats.recorded == 2
    assert index.expire(now[0] + TTL_S - 0.5) == 0
