"""One bad value in Redis costs one entry: discovery, routing, the KV sync, prediction expiry and
/metrics all carry on (issue 20, item 8).

Each test writes its bad entries with redis-py straight into a redis-server of its own, next to sim
workers publishing there and a gateway reading it, then checks what the gateway does with the good
entries around them, and that /metrics counts the bad ones."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from bench.probes import wait_for
from protocol.redis_keys import PREDICTIONS, WORKERS, kv_stream_key, load_key, worker_key
from radix.hashing import block_hashes
from radix.index import RadixIndex
from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker
from tests.support.redis import private_redis
from tests.support.servers import free_port

FAST = {"heartbeat": "0.2", "load-period": "0.05"}


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server of this test's own: the bad entries written here reach no other test."""
    with private_redis(tmp_path) as url:
        yield url


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    """Raw bytes in and out: a test writes what no worker would."""
    conn = redis.Redis.from_url(redis_url)
    yield conn
    conn.close()


def worker(start: Callable[..., SimWorker], redis_url: str, worker_id: str, **flags: str) -> SimWorker:
    options = FAST | flags
    return start(worker_id, "--redis", redis_url, *(f"--{k}={v}" for k, v in options.items()))


def gateway_on(
    start_gateway: Callable[..., RunningGateway], redis_url: str, count: int, **config: Any
) -> RunningGateway:
    return start_gateway([], wait_for=count, redis={"url": redis_url, "poll_interval_s": 0.05}, **config)


def complete(gateway: RunningGateway, prompt: list[int]) -> httpx.Response:
    body = {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)


def rejected(gateway: RunningGateway, source: str) -> float:
    """prefixgate_gateway_rejected_entries_total{source=...} as /metrics shows it (0 when absent);
    /metrics must answer 200."""
    response = httpx.get(f"{gateway.url}/metrics", timeout=10)
    assert response.status_code == 200, response.text[:500]
    found = re.search(
        rf'^prefixgate_gateway_rejected_entries_total\{{source="{source}"\}} (\S+)$', response.text, re.M
    )
    return float(found.group(1)) if found else 0.0


def assert_index_sound(gateway: RunningGateway) -> None:
    """The index's entry count is what its replicas hold: never negative, never adrift."""
    index = gateway.state.index
    assert len(index) == sum(index.blocks_of(r) for r in index.replicas)


def registry_entry(worker_id: str, url: str, **fields: Any) -> dict[str, Any]:
    entry = {
        "id": worker_id,
        "url": url,
        "model": SIM_MODEL,
        "block_size": "16",
        "num_blocks": "512",
        "max_context_len": "8192",
        "backend": "sim",
        "role": "mixed",
        "incarnation": "bad",
    }
    return entry | fields


def test_bad_registry_entries_and_load_keys_cost_only_themselves(
    redis_url: str,
    client: redis.Redis,
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    good = [worker(start_sim_worker, redis_url, f"good-{i}") for i in range(2)]
    # Their load reports come once a minute: the bad values written over them stay.
    quiet = [worker(start_sim_worker, redis_url, f"quiet-{i}", **{"load-period": "60"}) for i in range(3)]
    wait_for(
        lambda: all(client.exists(load_key(w.id)) for w in quiet), "the quiet workers' first load reports"
    )
    client.set(load_key("quiet-0"), b"not json", px=60_000)
    client.delete(load_key("quiet-1"))
    client.hset(load_key("quiet-1"), "running", "1")  # a hash where a string belongs
    client.set(load_key("quiet-2"), json.dumps({"running": -5, "ts": math.nan}), px=60_000)
    # Entries that are nobody's: each one's url has nothing behind it, so a gateway that took one would
    # route requests where they fail, or hash them at a block size of 0.
    dead = f"http://127.0.0.1:{free_port()}"
    bad = {
        "zero-block-size": registry_entry("zero-block-size", dead, block_size="0"),
        "zero-blocks": registry_entry("zero-blocks", dead, num_blocks="0"),
        "huge-block-size": registry_entry("huge-block-size", dead, block_size=str(2**70)),
        "not-a-number": registry_entry("not-a-number", dead, max_context_len="[1, 2]"),
        "not-a-url": registry_entry("not-a-url", "file:///etc/passwd"),
        "another-id": registry_entry("good-0", dead),
        "no-model": {k: v for k, v in registry_entry("no-model", dead).items() if k != "model"},
        "odd-role": registry_entry("odd-role", dead, role="emperor"),
        "not-utf8": registry_entry("not-utf8", dead, block_size=b"\xff\xfe"),
    }
    for wid, fields in bad.items():
        client.hset(worker_key(wid), mapping=fields)
        client.sadd(WORKERS, wid)
    client.set(worker_key("a-string"), b"a string where a hash belongs")
    client.sadd(WORKERS, "a-string", "x" * 5000)

    gateway = gateway_on(start_gateway, redis_url, len(good) + len(quiet))
    time.sleep(0.3)  # a few more registry reads: none lets a bad entry in
    assert sorted(r.id for r in gateway.state.replicas.all()) == sorted(w.id for w in good + quiet)
    for i in range(12):
        response = complete(gateway, [500 + i * 97 + j for j in range(40)])
        assert response.status_code == 200, response.text
    assert rejected(gateway, "registry") >= len(bad) + 2
    assert rejected(gateway, "load") >= 3
    assert_index_sound(gateway)

    # A worker that joins now is found as ever.
    late = worker(start_sim_worker, redis_url, "late")
    wait_for(lambda: late.id in gateway.state.replicas, "the late worker to join")


def test_a_bad_kv_stream_entry_is_skipped_and_the_sync_goes_on(
    redis_url: str,
    client: redis.Redis,
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    worker(start_sim_worker, redis_url, "kv-w")
    gateway = gateway_on(start_gateway, redis_url, 1)
    state = wait_for(
        lambda: (s := gateway.gw.sync.states.get("kv-w")) and s.synced and s, "the follower to sync"
    )
    incarnation, seq = state.incarnation, state.seq
    key = kv_stream_key("kv-w")
    entry = {"incarnation": incarnation, "seq": str(seq + 1)}
    bad = [
        entry | {"events": json.dumps([{"type": "stored", "hashes": [7, [1, 2]], "parent": None}])},
        entry | {"events": json.dumps([{"type": "removed", "hashes": [7, {"a": 1}]}])},
        entry | {"events": json.dumps([{"type": "stored", "hashes": [2**64], "parent": None}])},
        entry | {"events": json.dumps([{"type": "stored", "hashes": [-1], "parent": None}])},
        entry | {"events": json.dumps([{"type": "stolen"}])},
        entry | {"events": b"\xff not json"},
        entry | {"seq": "nan", "events": "[]"},
        entry | {"seq": str(2**70), "events": "[]"},
        {"incarnation": incarnation, "events": "[]"},
    ]
    last = b""
    for fields in bad:
        last = client.xadd(key, fields)
    # What the worker stores for this prompt comes after the bad entries, under the next seq: applied.
    prompt = [9000 + 13 * i for i in range(96)]
    response = complete(gateway, prompt)
    assert response.status_code == 200, response.text
    hashes = block_hashes(prompt, 16, SIM_MODEL)
    wait_for(lambda: all(gateway.state.index.holds("kv-w", h) for h in hashes), "the good entry after them")
    assert state.stream_id is not None and state.stream_id > last.decode()
    assert state.resyncs == 1, "skipped entries are no hole in the seqs"
    assert rejected(gateway, "kv_stream") >= len(bad)
    assert_index_sound(gateway)
    again = complete(gateway, [*prompt, 1, 2, 3])
    assert again.status_code == 200
    assert int(again.headers["x-prefixgate-predicted-cached-tokens"]) == 16 * len(hashes)


def test_bad_prediction_entries_are_skipped_and_expiry_goes_on(
    redis_url: str,
    client: redis.Redis,
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    worker(start_sim_worker, redis_url, "pred-w")
    routing = {"policy": "prefix_aware", "prefix_aware": {"mode": "approximate"}}
    gateway = gateway_on(start_gateway, redis_url, 1, routing=routing, approximate={"ttl_s": 30})
    entry = {"gateway": "elsewhere", "replica": "pred-w"}
    soon = repr(time.time() + 1.0)
    bad = [
        entry | {"expires_at": "nan", "hashes": "[11, 12]"},
        entry | {"expires_at": "inf", "hashes": "[13]"},
        entry | {"expires_at": "-inf", "hashes": "[14]"},
        entry | {"expires_at": soon, "hashes": "[[15, 16]]"},
        entry | {"expires_at": soon, "hashes": "[1e400]"},
        entry | {"expires_at": soon, "hashes": json.dumps([2**64])},
        entry | {"expires_at": soon, "hashes": json.dumps(list(range(70_000)))},
        entry | {"expires_at": soon, "hashes": '{"17": 1}'},
        entry | {"capacity": "0"},
        entry | {"capacity": str(2**80)},
        {"replica": "pred-w", "expires_at": soon, "hashes": "[18]"},
    ]
    for fields in bad:
        client.xadd(PREDICTIONS, fields)
    # A prediction from another gateway for one second, and one for well past any TTL: both expire.
    good, far = [101, 102, 103], [104]
    client.xadd(PREDICTIONS, entry | {"expires_at": soon, "hashes": json.dumps(good)})
    client.xadd(PREDICTIONS, entry | {"expires_at": repr(time.time() + 1e9), "hashes": json.dumps(far)})
    index = gateway.state.index
    wait_for(lambda: all(index.holds("pred-w", h) for h in good + far), "the good predictions")
    assert not any(index.holds("pred-w", h) for h in range(11, 19)), "a bad entry reached the index"
    assert rejected(gateway, "predictions") >= len(bad)
    wait_for(lambda: not any(index.holds("pred-w", h) for h in good), "the prediction to expire", timeout=5)
    assert index.holds("pred-w", far[0]), "held to the gateway's TTL, not gone early"
    assert complete(gateway, list(range(300, 364))).status_code == 200
    assert_index_sound(gateway)


def test_the_index_stays_consistent_whatever_it_is_given() -> None:
    """The invariant holds in the index itself, for a caller that did not validate."""
    index = RadixIndex()
    index.add_replica("exact")
    index.add_replica("learned", 100, learn=True)
    with pytest.raises(TypeError):
        index.insert("exact", [[1, 2], 5])  # type: ignore[list-item]
    assert len(index) == index.blocks_of("exact") == 1
    with pytest.raises(TypeError):
        index.remove("exact", [5, [1]])  # type: ignore[list-item]
    assert len(index) == index.blocks_of("exact") == 0
    with pytest.raises(ValueError, match="expires_at"):
        index.insert("learned", [1], expires_at=math.nan)
    index.insert("learned", [1, 2], expires_at=10.0)
    index.insert("learned", [3])  # an exact entry on a learning replica
    assert index.expire(11.0) == 2
    index.remove("learned", [3])
    assert len(index) == 0
    index.insert("learned", [4], expires_at=10.0)
    index.insert("learned", [4])  # confirmed: no longer expires
    assert index.expire(11.0) == 0 and index.holds("learned", 4)
