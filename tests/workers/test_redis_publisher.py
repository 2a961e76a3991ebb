"""The Redis publisher against a real redis-server: a consumer of the stream holds exactly the worker's
cached set (resyncing from /kv/snapshot on gaps), restarts show a new incarnation, the registry entry
lives and dies with the worker, load reports follow the requests, and Redis outages cost nothing but
the outage."""

from __future__ import annotations

import json
import logging
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.probes import wait_for
from protocol.kv_events import EventBatch, apply_batches
from protocol.redis_keys import WORKERS, kv_stream_key, load_key, worker_key
from tests.support.publishers import BLOCK_SIZE, PublishedWorker, StartWorker
from tests.support.redis import start_redis_server
from tests.support.servers import ServerThread, free_port
from workers.bundled_worker import Worker
from workers.kv_event_log import KVEventLog
from workers.redis_publisher import PublisherConfig, redis_context
from workers.sim.profiles import CPU_SMOLLM2
from workers.sim.runner import RealClock, SimClock, VirtualClock
from workers.sim.sim_engine import SimEngine
from workers.worker_app import create_app

# The publisher's background tasks, as its log lines name them.
TASKS = ("heartbeat", "load report", "event stream")


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def start(redis_url: str) -> Iterator[StartWorker]:
    """Simulated workers publishing to Redis, served in-process; each stopped (gracefully) after the test."""
    servers: list[ServerThread] = []

    def make(
        worker_id: str,
        *,
        num_blocks: int = 64,
        clock: SimClock | None = None,
        url: str = redis_url,
        **settings: Any,
    ) -> PublishedWorker:
        events = KVEventLog()
        profile = replace(CPU_SMOLLM2, block_size=BLOCK_SIZE, kv_capacity_tokens=num_blocks * BLOCK_SIZE)
        sim = SimEngine(profile, clock=clock or VirtualClock(), **events.callbacks())
        worker = Worker.around(sim, events, worker_id=worker_id, backend="sim")
        config = PublisherConfig(redis_url=url, advertise_url=f"http://{worker_id}.test:1", **settings)
        server = ServerThread(create_app(worker, contexts=[redis_context(config)]))
        servers.append(server)
        return PublishedWorker(server.start(), worker_id, sim, events, server)

    yield make
    for server in servers:
        server.stop()


class StreamConsumer:
    """What a gateway does with a worker's stream: apply the batches in order, start afresh on a new
    incarnation's first batch, skip what it already holds, and resync from /kv/snapshot on a gap."""

    def __init__(self, r: redis.Redis, worker: PublishedWorker) -> None:
        self.r = r
        self.worker = worker
        self.cached: set[int] = set()
        self.incarnation: str | None = None
        self.seq = 0
        self.last_id = "-"
        self.resyncs = 0

    def poll(self) -> None:
        start = "-" if self.last_id == "-" else f"({self.last_id}"
        for entry_id, fields in self.r.xrange(kv_stream_key(self.worker.worker_id), min=start):
            self.last_id = entry_id
            batch = EventBatch.from_json(
                {**fields, "seq": int(fields["seq"]), "events": json.loads(fields["events"])}
            )
            if batch.incarnation != self.incarnation and batch.seq == 1:
                self.incarnation, self.seq = batch.incarnation, 0
            elif batch.incarnation != self.incarnation or batch.seq > self.seq + 1:
                self.resync()
            if batch.incarnation == self.incarnation and batch.seq == self.seq + 1:
                apply_batches(self.cached, [batch])
                self.seq = batch.seq

    def resync(self) -> None:
        snap = self.worker.snapshot()
        self.cached, self.incarnation, self.seq = set(snap["hashes"]), snap["incarnation"], snap["seq"]
        self.resyncs += 1


def published_seqs(r: redis.Redis, worker_id: str) -> list[int]:
    return [int(fields["seq"]) for _, fields in r.xrange(kv_stream_key(worker_id))]


def caught_up(r: redis.Redis, worker: PublishedWorker) -> int:
    """The worker's latest seq, once the stream holds it."""
    seq = worker.snapshot()["seq"]
    wait_for(
        lambda: (published_seqs(r, worker.worker_id) or [0])[-1] >= seq, f"seq {seq} in the stream", timeout=5
    )
    return seq


def workload(worker: PublishedWorker, requests: int, seed: int) -> None:
    """Shared-prefix prompts, some concurrent, on a pool small enough to evict and preempt."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(16)] for _ in range(4)]

    def one(i: int) -> None:
        local = random.Random(seed * 1000 + i)
        ids = local.choice(prefixes)[: local.randrange(4, 17)] + [
            local.randrange(1000, 40000) for _ in range(local.randrange(0, 24))
        ]
        worker.complete(ids, max_tokens=local.randrange(1, 8))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(requests)))


def test_a_stream_consumer_holds_exactly_the_cached_set(r: redis.Redis, start: StartWorker) -> None:
    worker = start("w-consume", num_blocks=24)
    workload(worker, 60, seed=1)
    seq = caught_up(r, worker)
    assert published_seqs(r, worker.worker_id) == list(range(1, seq + 1))
    events = [json.loads(f["events"]) for _, f in r.xrange(kv_stream_key(worker.worker_id))]
    assert any(e["type"] == "removed" for batch in events for e in batch), "the pool never evicted"
    consumer = StreamConsumer(r, worker)
    consumer.poll()
    assert consumer.resyncs == 0 and consumer.seq == seq
    assert consumer.cached == set(worker.snapshot()["hashes"]) == worker.sim.block_manager.cached_hashes()
    assert consumer.cached


@pytest.fixture
def small_stream_nodes(r: redis.Redis) -> Iterator[None]:
    """Radix-tree nodes of 4 entries, so that `MAXLEN ~ N` trims at about N even for a small N."""
    before = r.config_get("stream-node-max-entries")["stream-node-max-entries"]
    r.config_set("stream-node-max-entries", 4)
    yield
    r.config_set("stream-node-max-entries", before)


@pytest.mark.usefixtures("small_stream_nodes")
def test_a_consumer_resyncs_from_the_snapshot_after_the_stream_is_trimmed(
    r: redis.Redis, start: StartWorker
) -> None:
    worker = start("w-trim", num_blocks=24, stream_maxlen=8)
    consumer = StreamConsumer(r, worker)
    workload(worker, 30, seed=2)
    seq = caught_up(r, worker)
    kept = published_seqs(r, worker.worker_id)
    assert kept[-1] == seq and kept[0] > 1 and len(kept) <= 8 + 4
    consumer.poll()  # its first entry is not seq 1: a gap from the start
    assert consumer.resyncs == 1 and consumer.cached == worker.sim.block_manager.cached_hashes()
    worker.complete([7] * 9, max_tokens=2)  # a few batches: the consumer follows without a gap
    worker.complete([8] * 13, max_tokens=2)
    caught_up(r, worker)
    consumer.poll()
    assert consumer.resyncs == 1 and consumer.cached == worker.sim.block_manager.cached_hashes()
    workload(worker, 30, seed=3)  # many: those it has not read are trimmed away, so it resyncs again
    caught_up(r, worker)
    consumer.poll()
    assert consumer.resyncs == 2 and consumer.cached == worker.sim.block_manager.cached_hashes()
    assert consumer.seq == worker.snapshot()["seq"]


def test_b_a_restarted_worker_publishes_a_new_incarnation(r: redis.Redis, start: StartWorker) -> None:
    first = start("w-restart")
    first.complete(list(range(1000, 1012)), max_tokens=2)
    caught_up(r, first)
    consumer = StreamConsumer(r, first)
    consumer.poll()
    assert consumer.cached and consumer.incarnation == first.events.incarnation
    first.server.stop()

    second = start("w-restart")
    second.complete(list(range(2000, 2008)), max_tokens=2)
    seq = caught_up(r, second)
    entry = r.hgetall(worker_key("w-restart"))
    assert entry["incarnation"] == second.events.incarnation != first.events.incarnation
    restarted = [
        (int(f["seq"]), json.loads(f["events"]))
        for _, f in r.xrange(kv_stream_key("w-restart"))
        if f["incarnation"] == second.events.incarnation
    ]
    assert restarted[0] == (1, [{"type": "cleared"}]) and [s for s, _ in restarted] == list(range(1, seq + 1))
    consumer.worker = second
    consumer.poll()
    assert consumer.resyncs == 0 and consumer.incarnation == second.events.incarnation
    assert consumer.cached == second.sim.block_manager.cached_hashes()
    assert not consumer.cached & first.sim.block_manager.cached_hashes()


def test_c_the_registry_entry_lives_with_the_worker(r: redis.Redis, start: StartWorker) -> None:
    worker = start("w-registry", heartbeat_s=0.2)
    key = worker_key("w-registry")
    wait_for(lambda: r.exists(key), "the registry entry", timeout=5)
    health = httpx.get(f"{worker.url}/health").json()
    assert r.hgetall(key) == {
        "id": "w-registry",
        "url": "http://w-registry.test:1",
        "model": health["model"],
        "block_size": str(BLOCK_SIZE),
        "num_blocks": "64",
        "max_context_len": str(health["max_context_len"]),
        "backend": "sim",
        "role": "mixed",
        "incarnation": health["incarnation"],
    }
    assert r.sismember(WORKERS, "w-registry")
    time.sleep(1.0)  # longer than the 0.6 s expiry: only the heartbeat keeps it
    assert 0 < r.pttl(key) <= 600 and r.exists(load_key("w-registry"))
    worker.server.stop()
    assert not r.exists(key) and not r.exists(load_key("w-registry"))
    assert not r.sismember(WORKERS, "w-registry")
    assert r.xlen(kv_stream_key("w-registry")) >= 1  # the stream outlives the worker, for late readers


def test_c_an_exiting_worker_leaves_a_newer_incarnations_entry_alone(
    r: redis.Redis, start: StartWorker
) -> None:
    worker = start("w-guard", heartbeat_s=30)
    key = worker_key("w-guard")
    wait_for(lambda: r.exists(key), "the registry entry", timeout=5)
    r.hset(key, "incarnation", "newer")  # a restarted process with the same id got there first
    worker.server.stop()
    assert r.hget(key, "incarnation") == "newer" and r.sismember(WORKERS, "w-guard")
    r.delete(key)
    r.srem(WORKERS, "w-guard")


def test_d_load_reports_follow_running_requests(r: redis.Redis, start: StartWorker) -> None:
    worker = start("w-load", clock=RealClock(), load_period_s=0.05)
    key = load_key("w-load")
    idle = json.loads(wait_for(lambda: r.get(key), "a load report", timeout=5))
    assert (idle["running"], idle["kv_blocks_used"], idle["kv_blocks_total"]) == (0, 0, 64)
    # About 25 modelled steps of 60-70 ms: well over a second of running.
    request = threading.Thread(target=worker.complete, args=(list(range(3000, 3040)), 24))
    request.start()
    busy = wait_for(
        lambda: (load := json.loads(r.get(key) or "{}")).get("running") == 1 and load,
        "a load report with the request running",
        timeout=5,
    )
    assert busy["kv_blocks_used"] >= 10 and busy["ts"] > idle["ts"]
    request.join(30)
    done = wait_for(
        lambda: (load := json.loads(r.get(key) or "{}")).get("running") == 0 and load,
        "a load report with the request done",
        timeout=5,
    )
    assert done["ts"] > busy["ts"] and done["kv_blocks_used"] == 0
    assert 0 < r.pttl(key) <= 1000


def logged(caplog: pytest.LogCaptureFixture, outcome: str) -> Counter[str]:
    """How many lines each background task logged saying `outcome` ("failed", "works again")."""
    lines = [r.getMessage() for r in caplog.records]
    return Counter(task for line in lines for task in TASKS if line.startswith(f"redis: {task} {outcome}"))


def test_the_worker_serves_through_a_redis_outage_and_publishes_once_it_returns(
    start: StartWorker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate.worker.redis")
    port = free_port()
    worker = start("w-outage", url=f"redis://127.0.0.1:{port}/0", heartbeat_s=0.2)
    began = time.monotonic()
    for i in range(5):
        worker.complete(list(range(4000 + i, 4012 + i)), max_tokens=2)
    assert httpx.get(f"{worker.url}/load").json()["kv_blocks_total"] == 64
    assert time.monotonic() - began < 3, "Redis being down slowed requests"
    time.sleep(0.6)  # every task retries a few times (0.1 s, then 0.2 s apart)
    assert logged(caplog, "failed") == dict.fromkeys(TASKS, 1), "one line per outage, not per attempt"
    proc = start_redis_server(port, tmp_path)
    try:
        back = redis.Redis(port=port, decode_responses=True)
        wait_for(lambda: back.exists(worker_key("w-outage")), "re-registration", timeout=5)
        seq = caught_up(back, worker)
        assert published_seqs(back, "w-outage") == list(range(1, seq + 1))  # the ring kept them all
        consumer = StreamConsumer(back, worker)
        consumer.poll()
        assert consumer.resyncs == 0 and consumer.cached == worker.sim.block_manager.cached_hashes()
        back.close()
        wait_for(lambda: logged(caplog, "works again") == dict.fromkeys(TASKS, 1), "every task to recover")
        assert logged(caplog, "failed") == dict.fromkeys(TASKS, 1)
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_cli_worker_registers_and_its_entry_expires_when_it_dies(r: redis.Redis, redis_url: str) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "prefixgate",
        "worker",
        "--sim",
        "--port",
        str(port),
        "--id",
        "w-cli",
        "--redis",
        redis_url,
        "--advertise-url",
        "http://worker.example:9/",
        "--heartbeat",
        "0.2",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def registered() -> dict[str, str]:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            return r.hgetall(worker_key("w-cli"))

        entry = wait_for(registered, "the registry entry", timeout=60)
        assert (entry["url"], entry["backend"], entry["block_size"]) == (
            "http://worker.example:9",
            "sim",
            "16",
        )
        assert r.xrange(kv_stream_key("w-cli"))[0][1]["incarnation"] == entry["incarnation"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    wait_for(lambda: not r.exists(worker_key("w-cli")), "the entry to expire", timeout=2.0)
    assert r.sismember(WORKERS, "w-cli")  # a stale member: readers must check the entry
    r.srem(WORKERS, "w-cli")
