"""Index synchronisation against real parts: simulated workers served over loopback HTTP, publishing to a
real redis-server. Through either transport the index holds exactly the worker's cached set (its
/kv/snapshot) after evicting workloads, late starts, missed ranges, worker restarts and outages."""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import redis

from bench.probes import wait_for_async
from gateway.sync.bundled_events import IndexSync, follow_http, follow_redis
from gateway.sync.state import SyncState, Transport
from protocol.redis_keys import kv_stream_key
from radix.index import RadixIndex
from tests.support.publishers import BLOCK_SIZE, PublishedWorker, StartWorker
from tests.support.redis import start_redis_server
from tests.support.servers import ServerThread, free_port
from workers.bundled_worker import Worker
from workers.kv_event_log import KVEventLog
from workers.redis_publisher import PublisherConfig, connect, redis_context
from workers.sim.profiles import CPU_SMOLLM2
from workers.sim.runner import VirtualClock
from workers.sim.sim_engine import SimEngine
from workers.worker_app import create_app

TRANSPORTS: tuple[Transport, ...] = ("http", "redis")


@pytest.fixture
def start(redis_url: str) -> Iterator[StartWorker]:
    """Simulated workers on a small pool (so that they evict), publishing to Redis unless `publish` is
    False; each stopped after the test."""
    servers: list[ServerThread] = []

    def make(
        worker_id: str,
        *,
        publish: bool = True,
        port: int = 0,
        num_blocks: int = 24,
        event_capacity: int = 4096,
        url: str = redis_url,
        **settings: Any,
    ) -> PublishedWorker:
        events = KVEventLog(capacity=event_capacity)
        profile = replace(CPU_SMOLLM2, block_size=BLOCK_SIZE, kv_capacity_tokens=num_blocks * BLOCK_SIZE)
        sim = SimEngine(profile, clock=VirtualClock(), **events.callbacks())
        worker = Worker.around(sim, events, worker_id=worker_id, backend="sim")
        config = PublisherConfig(redis_url=url, advertise_url=f"http://{worker_id}.test:1", **settings)
        server = ServerThread(create_app(worker, contexts=[redis_context(config)] if publish else []), port)
        servers.append(server)
        return PublishedWorker(server.start(), worker_id, sim, events, server)

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def small_stream_nodes(redis_url: str) -> Iterator[None]:
    """Radix-tree nodes of 4 entries, so that `MAXLEN ~ N` trims at about N even for a small N."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    before = r.config_get("stream-node-max-entries")["stream-node-max-entries"]
    r.config_set("stream-node-max-entries", 4)
    yield
    r.config_set("stream-node-max-entries", before)
    r.close()


@asynccontextmanager
async def gateway(redis_url: str, transport: Transport) -> AsyncIterator[IndexSync]:
    """A gateway's index and its sync, with short waits so that the tests see failures quickly."""
    async with aiohttp.ClientSession() as session:
        client = connect(redis_url, timeout_s=2.0) if transport == "redis" else None
        sync = IndexSync(RadixIndex(), session, client, poll_timeout_s=1.0, block_ms=200, retry_max_s=0.2)
        try:
            yield sync
        finally:
            await sync.close()
            if client is not None:
                await client.aclose()


def follow(sync: IndexSync, worker: PublishedWorker) -> SyncState:
    sync.index.add_replica(worker.worker_id)
    return sync.start(worker.worker_id, worker.url)


async def converged(state: SyncState, worker: PublishedWorker, timeout: float = 10.0) -> dict[str, Any]:
    """The worker's snapshot, once the follower has applied everything up to it."""
    snap = await asyncio.to_thread(worker.snapshot)
    await wait_for_async(
        lambda: state.incarnation == snap["incarnation"] and state.seq >= snap["seq"],
        f"{state.replica} to reach seq {snap['seq']} of {snap['incarnation']}",
        timeout=timeout,
    )
    return snap


def assert_holds_exactly(index: RadixIndex, replica: str, hashes: Iterable[int]) -> None:
    expected = set(hashes)
    assert index.blocks_of(replica) == len(expected)
    assert all(index.holds(replica, h) for h in expected)


def workload(worker: PublishedWorker, requests: int, seed: int) -> None:
    """Shared-prefix prompts, four at a time, on one client (a client per request costs more than the
    simulated engine's work)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(16)] for _ in range(4)]
    with httpx.Client(base_url=worker.url, timeout=30) as client:

        def one(i: int) -> None:
            local = random.Random(seed * 1000 + i)
            ids = local.choice(prefixes)[: local.randrange(4, 17)]
            ids += [local.randrange(1000, 40000) for _ in range(local.randrange(0, 24))]
            body = {"prompt": ids, "max_tokens": local.randrange(1, 8), "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(requests)))


def evicted(worker: PublishedWorker) -> bool:
    return any(e.type == "removed" for b in worker.events.after(0) for e in b.events)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_index_holds_exactly_the_workers_cached_set(
    start: StartWorker, redis_url: str, transport: Transport
) -> None:
    worker = start(f"g-exact-{transport}", publish=transport == "redis")

    async def main() -> None:
        async with gateway(redis_url, transport) as live:
            state = follow(live, worker)
            await asyncio.to_thread(workload, worker, 60, 11)
            snap = await converged(state, worker)
            assert evicted(worker), "the pool was meant to evict"
            assert_holds_exactly(live.index, worker.worker_id, snap["hashes"])
            assert snap["hashes"] and state.batches_applied > 0
            assert (state.resyncs, state.lag_s(), state.last_error) == (1, 0.0, None)
            async with gateway(redis_url, transport) as late:
                late_state = follow(late, worker)
                await converged(late_state, worker)
                assert_holds_exactly(late.index, worker.worker_id, snap["hashes"])
                assert (late_state.resyncs, late_state.batches_applied) == (1, 0)

    asyncio.run(main())


@pytest.mark.usefixtures("small_stream_nodes")
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_follower_that_missed_a_range_resyncs_and_is_exact_again(
    start: StartWorker, redis_url: str, transport: Transport
) -> None:
    """A follower stops; the worker's event ring (HTTP) or stream (Redis) then moves past what it
    applied; once resumed it finds the hole, resyncs once, and then follows without another."""
    if transport == "http":
        worker = start("g-missed-http", publish=False, event_capacity=8)
    else:
        worker = start("g-missed-redis", stream_maxlen=8)

    async def main() -> None:
        async with aiohttp.ClientSession() as session, connect(redis_url, timeout_s=2.0) as client:
            index = RadixIndex()
            index.add_replica(worker.worker_id)
            state = SyncState(worker.worker_id, worker.url, transport)

            def resume() -> asyncio.Task[None]:
                """A follower on the same state: it goes on from where the previous one stopped."""
                if transport == "http":
                    return asyncio.create_task(follow_http(state, index, session, poll_timeout_s=1.0))
                return asyncio.create_task(follow_redis(state, index, client, session, block_ms=200))

            task = resume()
            await asyncio.to_thread(worker.complete, list(range(500, 511)), 2)
            await converged(state, worker)
            assert state.resyncs == 1
            task.cancel()
            await asyncio.to_thread(workload, worker, 30, 12)
            task = resume()
            snap = await converged(state, worker)
            assert state.resyncs == 2
            assert_holds_exactly(index, worker.worker_id, snap["hashes"])
            await asyncio.to_thread(worker.complete, list(range(600, 613)), 2)
            await asyncio.to_thread(worker.complete, list(range(700, 709)), 2)
            snap = await converged(state, worker)
            assert state.resyncs == 2
            assert_holds_exactly(index, worker.worker_id, snap["hashes"])
            task.cancel()

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_restarted_worker_leaves_only_its_new_blocks(
    start: StartWorker, redis_url: str, transport: Transport
) -> None:
    """The worker stops (unreachable a while), then comes back on the same port as a new incarnation:
    over HTTP a 410 resyncs; through Redis the new incarnation's batch 1 clears, with no resync."""
    worker_id, port, publish = f"g-restart-{transport}", free_port(), transport == "redis"
    first = start(worker_id, publish=publish, port=port)

    async def main() -> None:
        async with gateway(redis_url, transport) as gw:
            state = follow(gw, first)
            await asyncio.to_thread(workload, first, 20, 13)
            old = set((await converged(state, first))["hashes"])
            await asyncio.to_thread(first.server.stop)
            if transport == "http":
                await wait_for_async(lambda: state.errors > 0, "the follower to fail")
                assert state.last_error and state.lag_s() > 0
            second = await asyncio.to_thread(start, worker_id, publish=publish, port=port)
            await asyncio.to_thread(second.complete, list(range(2000, 2010)), 2)
            snap = await converged(state, second)
            new = set(snap["hashes"])
            assert second.events.incarnation != first.events.incarnation and new and old - new
            assert_holds_exactly(gw.index, worker_id, new)
            assert state.resyncs == (2 if transport == "http" else 1)
            await wait_for_async(lambda: state.last_error is None, "the follower to recover")
            if gw.redis is not None:
                # A late batch of the ended incarnation is skipped, and so is a malformed entry.
                stream = kv_stream_key(worker_id)
                await gw.redis.xadd(
                    stream, {"incarnation": first.events.incarnation, "seq": 99, "events": "[]"}
                )
                await gw.redis.xadd(stream, {"junk": 1})
                await asyncio.to_thread(second.complete, list(range(2100, 2113)), 2)
                snap = await converged(state, second)
                assert_holds_exactly(gw.index, worker_id, snap["hashes"])
                assert state.resyncs == 1 and state.errors == 1

    asyncio.run(main())


def test_a_redis_follower_rides_out_a_redis_restart(start: StartWorker, tmp_path: Path) -> None:
    """Redis goes away and comes back empty: the worker sends the batches its ring kept, and the
    follower, having retried meanwhile, takes them up where it stopped."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    servers = [start_redis_server(port, tmp_path)]
    worker = start("g-outage", url=url, heartbeat_s=0.2)

    async def main() -> None:
        async with gateway(url, "redis") as gw:
            state = follow(gw, worker)
            await asyncio.to_thread(workload, worker, 10, 14)
            await converged(state, worker)
            servers[0].terminate()
            servers[0].wait(5)
            await asyncio.to_thread(workload, worker, 20, 15)
            await wait_for_async(lambda: state.errors > 0, "the follower to fail")
            assert state.lag_s() > 0
            servers.append(start_redis_server(port, tmp_path))
            snap = await converged(state, worker)
            assert_holds_exactly(gw.index, worker.worker_id, snap["hashes"])
            assert state.resyncs == 1
            await wait_for_async(lambda: state.last_error is None, "the follower to recover")

    try:
        asyncio.run(main())
    finally:
        for server in servers:
            server.terminate()
            try:
                server.wait(5)
            except subprocess.TimeoutExpired:
                server.kill()
