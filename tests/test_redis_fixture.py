"""The Redis fixture gives a real, private server: the shared index and registry tests stand on it."""

import asyncio

import redis.asyncio as aioredis


def test_redis_fixture_serves_streams(redis_url: str) -> None:
    async def roundtrip() -> list:
        client = aioredis.from_url(redis_url)
        try:
            await client.delete("kv:test")
            first = await client.xadd("kv:test", {"seq": 1}, maxlen=10)
            await client.xadd("kv:test", {"seq": 2}, maxlen=10)
            rows = await client.xrange("kv:test", min=first)
            return [int(fields[b"seq"]) for _, fields in rows]
        finally:
            await client.aclose()

    assert asyncio.run(roundtrip()) == [1, 2]
