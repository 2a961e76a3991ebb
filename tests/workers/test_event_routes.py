"""The KV event feed over HTTP (workers.event_routes) on the tiny random model: a consumer of
snapshot and long-polls holds exactly the cached set, and readers left behind get 410; and
the bounds the long-poll's query parameters are held to."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.probes import wait_for
from protocol.errors import ApiError
from protocol.kv_events import EventBatch, apply_batches
from tests.support.workers import RunningWorker, StartWorker, idle, random_ids
from tests.workers.worker_http import error_of, greedy
from workers.engine.engine_core import EngineConfig
from workers.event_routes import query_number


class Consumer:
    """What a gateway does over HTTP: a snapshot, then the batches after it, by long-poll."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        snap = self.http.get("/kv/snapshot").json()
        self.incarnation, self.seq, self.cached = snap["incarnation"], snap["seq"], set(snap["hashes"])
        self.event_types: set[str] = set()

    def poll(self, timeout: float) -> int:
        response = self.http.get(
            "/kv/events", params={"after": self.seq, "timeout": timeout, "incarnation": self.incarnation}
        )
        assert response.status_code == 200, response.text
        body = response.json()
        batches = [EventBatch.from_json(b) for b in body["batches"]]
        assert [b.seq for b in batches] == list(range(self.seq + 1, self.seq + 1 + len(batches)))
        apply_batches(self.cached, batches)
        self.event_types |= {e.type for b in batches for e in b.events}
        if batches:
            self.seq = batches[-1].seq
        return body["seq"]

    def catch_up(self) -> None:
        while self.poll(0) != self.seq:
            pass


def test_an_event_consumer_holds_exactly_the_workers_cached_set(make_worker: StartWorker) -> None:
    """A random workload with shared prefixes over a pool small enough to evict."""
    worker = make_worker(EngineConfig(block_size=4, num_blocks=40, max_num_seqs=4))
    rng = random.Random(8)
    families = [random_ids(rng.randrange(8, 30), seed=100 + i) for i in range(4)]
    prompts = [rng.choice(families) + random_ids(rng.randrange(1, 12), seed=200 + i) for i in range(40)]
    live = Consumer(worker.url)
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            live.poll(timeout=0.5)

    follower = threading.Thread(target=follow)
    follower.start()
    client = worker.client()
    with ThreadPoolExecutor(6) as pool:
        list(
            pool.map(
                lambda p: client.completions.create(
                    model=worker.model, prompt=p, max_tokens=rng.randrange(1, 6), **greedy()
                ),
                prompts,
            )
        )
    stop.set()
    follower.join()
    late = Consumer(worker.url)
    wait_for(lambda: idle(worker), "the worker to be idle")
    live.catch_up()
    late.catch_up()
    truth = set(worker.engine.block_manager.cached_hashes())
    assert live.cached == truth and late.cached == truth and truth
    assert {"stored", "removed"} <= live.event_types, "the small pool was meant to evict"
    replay: set[int] = set()
    everything = httpx.get(f"{worker.url}/kv/events", params={"after": 0, "limit": 100_000}).json()
    apply_batches(replay, [EventBatch.from_json(b) for b in everything["batches"]])
    assert everything["batches"][0]["events"] == [{"type": "cleared"}] and replay == truth


def test_a_long_poll_returns_as_soon_as_events_arrive(tiny_worker: RunningWorker) -> None:
    seq = httpx.get(f"{tiny_worker.url}/kv/snapshot").json()["seq"]
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        waiting = pool.submit(
            httpx.get, f"{tiny_worker.url}/kv/events", params={"after": seq, "timeout": 20}, timeout=30
        )
        time.sleep(0.2)
        assert not waiting.done()
        tiny_worker.client().completions.create(
            model=tiny_worker.model, prompt=random_ids(12, seed=9), max_tokens=1, **greedy()
        )
        body = waiting.result().json()
    assert time.monotonic() - started < 10
    assert body["batches"] and body["batches"][0]["seq"] == seq + 1
    assert any(e["type"] == "stored" for b in body["batches"] for e in b["events"])
    quiet = httpx.get(f"{tiny_worker.url}/kv/events", params={"after": body["seq"], "timeout": 0.2}).json()
    assert quiet["batches"] == []


def test_readers_too_far_behind_or_from_another_incarnation_get_410(make_worker: StartWorker) -> None:
    worker = make_worker(event_capacity=2)
    for i in range(3):
        worker.client().completions.create(
            model=worker.model, prompt=random_ids(9, seed=20 + i), max_tokens=1
        )
    current = httpx.get(f"{worker.url}/kv/snapshot").json()
    assert current["seq"] >= 4 and current["block_size"] == 4 and current["model"] == "tiny-llama"
    for params in (
        {"after": 0},
        {"after": current["seq"] + 5},
        {"after": current["seq"], "incarnation": "old"},
    ):
        gone = httpx.get(f"{worker.url}/kv/events", params=params)
        assert error_of(gone, 410)["code"] == "events_gone"
        assert gone.json()["seq"] == current["seq"] and gone.json()["incarnation"] == current["incarnation"]
    fresh = httpx.get(f"{worker.url}/kv/events", params={"after": current["seq"] - 1}).json()
    assert [b["seq"] for b in fresh["batches"]] == [current["seq"]]


# -- the long-poll's query parameters -------------------------------------------------------------------


def refused(
    query: dict[str, str], name: str, parse: Callable[[str], float], default: float | None
) -> ApiError:
    with pytest.raises(ApiError) as error:
        query_number(query, name, parse, default, 0, 10)
    assert error.value.status == 400 and error.value.param == name and error.value.code == "invalid_value"
    return error.value


def test_a_query_number_in_bounds_is_parsed_and_a_missing_one_takes_its_default() -> None:
    assert query_number({"after": "7"}, "after", int, None, 0, 10) == 7
    assert query_number({"timeout": "2.5"}, "timeout", float, 0.0, 0, 10) == 2.5
    assert query_number({"after": "10"}, "after", int, None, 0, 10) == 10, "the bounds are inclusive"
    assert query_number({}, "timeout", float, 3.0, 0, 10) == 3.0


def test_a_required_query_number_that_is_missing_is_named() -> None:
    assert "after is required" in refused({}, "after", int, None).message


@pytest.mark.parametrize("raw", ["x", "-1", "11", "1.5", "nan", ""])
def test_an_integer_query_out_of_bounds_or_unparsable_says_what_it_must_be(raw: str) -> None:
    message = refused({"limit": raw}, "limit", int, 5).message
    assert message == f"limit must be an integer in [0, 10], got {raw!r}"


@pytest.mark.parametrize("raw", ["soon", "10.01", "-0.5", "nan", "inf"])
def test_a_number_query_out_of_bounds_or_unparsable_says_what_it_must_be(raw: str) -> None:
    message = refused({"timeout": raw}, "timeout", float, 0.0).message
    assert message == f"timeout must be a number in [0, 10], got {raw!r}"
