"""Chaos's fleet settings: gateways with fast health checks whose sections a scenario can replace, the
slow or narrow profiles it writes, and the gateway's replicas read from /admin/replicas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench.chaos_fleet import (
    BLOCK_SIZE,
    FAST_HEALTH,
    MODEL,
    WORKER,
    fast_gateway_config,
    replicas,
    routable,
    sim_profile,
    unhealthy,
)
from protocol.loopback_ports import free_port
from tests.bench.stub_server import serving
from workers.sim.profiles import get_profile


def test_a_chaos_gateway_has_fast_health_checks_unless_replaced() -> None:
    config = fast_gateway_config(["http://a"], routing={"policy": "round_robin"})
    assert config["model"] == MODEL and config["models"] == {MODEL: {"tokenizer": "none"}}
    assert config["replicas"] == [{"url": "http://a"}] and config["health"] == FAST_HEALTH
    assert config["routing"] == {"policy": "round_robin"} and "listen" not in config
    slow = {"interval_s": 5.0}
    assert fast_gateway_config([], health=slow)["health"] == slow


def test_the_worker_serves_the_chaos_model_in_16_token_blocks() -> None:
    assert WORKER.model == MODEL and WORKER.block_size == BLOCK_SIZE == 16


def test_a_profile_is_written_with_the_changes_asked_for(tmp_path: Path) -> None:
    base = get_profile("h100-8b")
    slow = json.loads(Path(sim_profile(tmp_path / "p", "slow", step_s=0.25)).read_text())
    assert slow["name"] == "slow" and slow["block_size"] == BLOCK_SIZE
    assert slow["cost"]["step_s"] == 0.25 and slow["max_num_seqs"] == base.max_num_seqs
    narrow = get_profile(sim_profile(tmp_path, "narrow", max_num_seqs=2))
    assert narrow.max_num_seqs == 2 and narrow.cost == base.cost


@pytest.fixture
def gateway() -> Iterator[str]:
    rows: list[dict[str, Any]] = [
        {"id": "a", "healthy": True, "draining": False},
        {"id": "b", "healthy": True, "draining": True},
        {"id": "c", "healthy": False, "draining": False},
    ]

    async def listing(request: web.Request) -> web.Response:
        return web.json_response({"replicas": rows})

    with serving(("GET", "/admin/replicas", listing)) as url:
        yield url


def test_a_replica_is_routable_when_healthy_and_not_draining(gateway: str) -> None:
    assert set(replicas(gateway)) == {"a", "b", "c"}
    assert [routable(gateway, r) for r in "abcd"] == [True, False, False, False]
    assert [unhealthy(gateway, r) for r in "abcd"] == [False, False, True, False]


def test_a_gateway_that_does_not_answer_lists_no_replica() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert replicas(url) == {} and not routable(url, "a") and not unhealthy(url, "a")
