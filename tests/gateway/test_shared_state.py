"""Several gateways on one Redis act as one: replicas found in the registry, a prefix cached through
gateway A routed to the same replica through gateway B, load placed by A seen by B, and approximate
mode's predictions shared."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from bench.probes import wait_for
from tests.support.gateways import PREFIX, SIM_MODEL, RunningGateway, SimWorker, complete


@pytest.fixture
def redis_workers(redis_url: str, start_sim_worker: Callable[..., SimWorker]) -> list[SimWorker]:
    flags = ("--redis", redis_url, "--heartbeat", "0.2", "--load-period", "0.05")
    return [start_sim_worker(f"shared-w{i}", *flags) for i in range(3)]


def two_gateways(
    start_gateway: Callable[..., RunningGateway], redis_url: str, **config: Any
) -> list[RunningGateway]:
    redis = {"url": redis_url, "poll_interval_s": 0.05}
    return [start_gateway([], wait_for=3, redis=redis, **config) for _ in range(2)]


def test_a_prefix_cached_through_a_is_routed_there_through_b(
    redis_url: str, redis_workers: list[SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    a, b = two_gateways(start_gateway, redis_url)
    assert {r.source for r in b.state.replicas.all()} == {"registry"}
    replica, predicted, _ = complete(a, [*PREFIX, 5, 6, 7])
    assert predicted == 0
    # B never saw that request: only the worker's KV events, through its Redis stream, tell it.
    wait_for(
        lambda: b.state.index.blocks_of(replica) >= len(PREFIX) // 16,
        "B's index to hold the prefix",
        timeout=5,
    )
    again, predicted, cached = complete(b, [*PREFIX, 8, 9, 10, 11])
    assert again == replica
    assert predicted == cached == 16 * (len(PREFIX) // 16)


def test_load_placed_through_a_is_seen_by_b(
    redis_url: str, redis_workers: list[SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    a, b = two_gateways(start_gateway, redis_url, routing={"policy": "least_load"})
    body = {"model": SIM_MODEL, "prompt": PREFIX, "max_tokens": 6000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{a.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # held: a dropped iterator closes the stream
        next(lines)
        busy = response.headers["x-prefixgate-replica"]
        wait_for(lambda: b.state.replicas.get(busy).load()[0] == 1, "B to see the running request", timeout=5)
        # So B's least-load choice avoids it.
        assert complete(b, [20_000 + i for i in range(64)])[0] != busy


def test_registry_replicas_join_and_leave_without_a_restart(
    redis_url: str,
    redis_workers: list[SimWorker],
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    gateway = start_gateway([], wait_for=3, redis={"url": redis_url, "poll_interval_s": 0.05})
    late = start_sim_worker("late", "--redis", redis_url, "--heartbeat", "0.2")
    wait_for(lambda: "late" in gateway.state.replicas, "the late worker to join", timeout=5)
    late.server.stop()  # graceful: it deregisters
    wait_for(lambda: "late" not in gateway.state.replicas, "the stopped worker to leave", timeout=5)
    assert sorted(gateway.state.index.replicas) == sorted(w.id for w in redis_workers)


def test_approximate_predictions_are_shared_between_gateways(
    redis_url: str, redis_workers: list[SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    routing = {"policy": "prefix_aware", "prefix_aware": {"mode": "approximate"}}
    a, b = two_gateways(start_gateway, redis_url, routing=routing)
    assert not a.gw.sync.states  # approximate mode follows no KV events
    replica, _, _ = complete(a, [*PREFIX, 1])
    wait_for(lambda: b.state.index.blocks_of(replica) > 0, "A's prediction to reach B", timeout=5)
    again, predicted, _ = complete(b, [*PREFIX, 2, 3])
    assert again == replica and predicted == 16 * (len(PREFIX) // 16)
