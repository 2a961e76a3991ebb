"""Redis dies under load and comes back empty: two gateways keep routing on their local index, no
request fails, /health and /metrics say degraded; once Redis is back on its port the gateways
reconnect, the workers re-register, and every gateway's index is again exactly each worker's cache."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.chaos_traffic import Traffic, completion, family_prompt
from bench.probes import wait_for
from protocol.redis_keys import WORKERS, worker_key
from tests.support.gateways import RunningGateway, SimWorker
from tests.support.redis import start_redis_server
from tests.support.servers import free_port


class PrivateRedis:
    """A redis-server of this test's own, to kill and restart on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = start_redis_server(self.port, self.workdir)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def registered(self) -> set[str]:
        """Worker ids with a live registry entry."""
        with redis.Redis(port=self.port, decode_responses=True, socket_timeout=1) as client:
            return {wid for wid in client.smembers(WORKERS) if client.exists(worker_key(wid))}


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.kill()


def health(gateway: RunningGateway) -> dict[str, Any]:
    return httpx.get(f"{gateway.url}/health", timeout=5).json()


def redis_up(gateway: RunningGateway) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    return next(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("prefixgate_gateway_redis_up ")
    )


def on_loop(gateway: RunningGateway, read: Callable[[], Any]) -> Any:
    """`read()` run on the gateway's own event loop, between two of its steps (the index is consistent)."""

    async def call() -> Any:
        return read()

    return asyncio.run_coroutine_threadsafe(call(), gateway.server.loop).result(5)


def index_matches(gateway: RunningGateway, worker: SimWorker) -> bool:
    """The gateway's index holds exactly the worker's cached blocks (its /kv/snapshot)."""
    snapshot = set(httpx.get(f"{worker.url}/kv/snapshot", timeout=5).json()["hashes"])
    index = gateway.state.index
    return on_loop(
        gateway,
        lambda: (
            index.blocks_of(worker.id) == len(snapshot) and all(index.holds(worker.id, h) for h in snapshot)
        ),
    )


@pytest.mark.timeout(120)
def test_gateways_route_through_a_redis_outage_and_resync_after_it(
    private_redis: PrivateRedis,
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    flags = ("--redis", private_redis.url, "--heartbeat", "0.2", "--load-period", "0.05")
    workers = [start_sim_worker(f"rd-w{i}", *flags) for i in range(2)]
    gateways = [
        start_gateway([], wait_for=2, redis={"url": private_redis.url, "poll_interval_s": 0.05})
        for _ in range(2)
    ]
    body = lambda i: completion(family_prompt(i), max_tokens=4)  # noqa: E731
    with Traffic([g.url for g in gateways], body, concurrency=3) as traffic:
        traffic.wait_for_requests(20)
        private_redis.kill()
        killed = time.monotonic()
        for gateway in gateways:
            wait_for(lambda g=gateway: health(g)["degraded"], "the gateways to see Redis gone", timeout=5)
            assert redis_up(gateway) == 0
            assert health(gateway)["status"] == "degraded"
        # Routing carries on from the local index, on prefixes the workers cache meanwhile.
        traffic.wait_for_requests(len(traffic.outcomes) + 30)
        private_redis.start()
        back = time.monotonic()
        for gateway in gateways:
            wait_for(lambda g=gateway: not health(g)["degraded"], "the gateways to reconnect", timeout=10)
            assert redis_up(gateway) == 1
        wait_for(
            lambda: private_redis.registered() == {w.id for w in workers},
            "the workers to re-register",
            timeout=5,
        )
        traffic.wait_for_requests(len(traffic.outcomes) + 20)
    outcomes = traffic.outcomes
    during = traffic.between(killed, back)
    print(f"\n{len(outcomes)} requests, {len(during)} while Redis was down; reconnected "
          f"{time.monotonic() - back:.2f} s after the restart")  # fmt: skip
    assert len(during) >= 30
    assert [o for o in outcomes if o.status != 200] == []
    # Both gateways kept their replicas through it (no re-joining from scratch) and routed to both.
    for gateway in gateways:
        assert sorted(r.id for r in gateway.state.replicas.all()) == sorted(w.id for w in workers)
        assert all(r.routable for r in gateway.state.replicas.all())
    assert {o.replica for o in during} == {w.id for w in workers}
    # The KV followers caught up: every index is exact again, with nothing pending or failing.
    for gateway in gateways:
        for worker in workers:
            wait_for(
                lambda g=gateway, w=worker: index_matches(g, w), f"{worker.id}'s index to be exact", timeout=5
            )
            state = gateway.gw.sync.states[worker.id]
            # A follower may still be backing off from a stale pooled connection: at most RETRY_MAX_S.
            wait_for(
                lambda s=state: s.last_error is None and s.lag_s() == 0, f"{worker.id}'s follower", timeout=5
            )
            print(f"{worker.id}: {state.batches_applied} batches applied, {state.resyncs} snapshot loads")
        assert not any(task.done() for task in gateway.gw._tasks), "a background task died"
    assert all(httpx.get(f"{w.url}/health", timeout=5).status_code == 200 for w in workers)


@pytest.mark.timeout(60)
def test_a_hung_redis_reads_as_down_and_costs_no_request(
    private_redis: PrivateRedis,
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    flags = ("--redis", private_redis.url, "--heartbeat", "0.2", "--load-period", "0.05")
    workers = [start_sim_worker(f"hung-w{i}", *flags) for i in range(2)]
    gateway = start_gateway([], wait_for=2, redis={"url": private_redis.url, "poll_interval_s": 0.05})
    assert private_redis.proc is not None
    with Traffic([gateway.url], concurrency=2) as traffic:
        traffic.wait_for_requests(10)
        private_redis.proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            stalled = time.monotonic()
            wait_for(lambda: health(gateway)["degraded"], "the gateway to see Redis hang", timeout=15)
            print(f"\ndegraded {time.monotonic() - stalled:.2f} s after Redis hung")
            traffic.wait_for_requests(len(traffic.outcomes) + 20)
        finally:
            private_redis.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: not health(gateway)["degraded"], "the gateway to reconnect", timeout=15)
        traffic.wait_for_requests(len(traffic.outcomes) + 10)
    assert [o for o in traffic.outcomes if o.status != 200] == []
    for worker in workers:
        wait_for(lambda w=worker: index_matches(gateway, w), f"{worker.id}'s index to be exact", timeout=5)
