"""Discovery reads a replica's role: what a bundled worker announces in /health and in the Redis registry
(none: a worker from before roles, mixed), what the YAML says of a foreign one; a role the gateway does
not know, or a foreign prefill/decode replica without a protocol, is no replica to route to."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis
from aiohttp import web
from redis.asyncio import Redis

from gateway.fleet.discovery import Probe, ProbeFailed, probe, read_registry
from gateway.gateway_config import ReplicaEntry
from protocol.redis_keys import WORKERS, worker_key
from tests.support.servers import ServerThread

HEALTH = {
    "status": "ok",
    "worker_id": "w",
    "model": "m",
    "incarnation": "i-1",
    "block_size": 16,
    "num_blocks": 64,
    "max_context_len": 2048,
}


@pytest.fixture
def server() -> Iterator[dict[str, Any]]:
    """A server whose /health answers `state["health"]` and /v1/models lists model m."""
    state: dict[str, Any] = {"health": HEALTH}

    async def health(request: web.Request) -> web.Response:
        return web.json_response(state["health"]) if state["health"] is not None else web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    thread = ServerThread(app)
    state["url"] = thread.start()
    yield state
    thread.stop()


def probed(entry: ReplicaEntry) -> Probe:
    async def main() -> Probe:
        async with aiohttp.ClientSession() as session:
            return await probe(session, entry, 5.0)

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("announced", "role"), [(None, "mixed"), ("prefill", "prefill"), ("decode", "decode")]
)
def test_a_bundled_worker_is_what_it_announces(
    server: dict[str, Any], announced: str | None, role: str
) -> None:
    if announced is not None:
        server["health"] = {**HEALTH, "role": announced}
    found = probed(ReplicaEntry(url=server["url"]))
    assert found.kind == "bundled" and found.role == role and found.pd_protocol is None


def test_a_role_the_gateway_does_not_know_is_no_replica(server: dict[str, Any]) -> None:
    server["health"] = {**HEALTH, "role": "encode"}
    with pytest.raises(ProbeFailed, match="announces role 'encode'"):
        probed(ReplicaEntry(url=server["url"]))


def test_a_foreign_replica_takes_its_role_and_protocol_from_the_config(server: dict[str, Any]) -> None:
    server["health"] = None  # vLLM's /health: 200, no body
    entry = ReplicaEntry(
        url=server["url"], kind="openai", role="prefill", pd_protocol="sglang", bootstrap_port=9
    )
    found = probed(entry)
    assert (found.kind, found.role, found.pd_protocol, found.bootstrap_port) == (
        "openai",
        "prefill",
        "sglang",
        9,
    )
    vllm = probed(ReplicaEntry(url=server["url"], kind="openai", role="decode", pd_protocol="vllm"))
    assert (vllm.role, vllm.pd_protocol, vllm.bootstrap_port) == ("decode", "vllm", None)


def test_a_prefill_replica_expected_bundled_that_is_foreign_needs_a_protocol(server: dict[str, Any]) -> None:
    server["health"] = None
    with pytest.raises(ProbeFailed, match="needs pd_protocol"):
        probed(ReplicaEntry(url=server["url"], role="prefill"))


def test_the_registry_names_each_worker_role(redis_url: str) -> None:
    entries = {
        "pd-test-p": {"role": "prefill"},
        "pd-test-d": {"role": "decode"},
        "pd-test-old": {},  # registered by a worker from before roles
        "pd-test-odd": {"role": "encode"},  # a role this gateway does not know: not routed to
    }
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        for wid, extra in entries.items():
            fields = {
                "id": wid,
                "url": f"http://{wid}:1",
                "model": "m",
                "block_size": "16",
                "num_blocks": "8",
            }
            sync.hset(
                worker_key(wid), mapping={**fields, "max_context_len": "512", "incarnation": "i", **extra}
            )
            sync.sadd(WORKERS, wid)

        async def main() -> dict[str, str]:
            client = Redis.from_url(redis_url, decode_responses=True)
            try:
                return {
                    r.probe.id: r.probe.role for r in await read_registry(client) if r.probe.id in entries
                }
            finally:
                await client.aclose()

        assert asyncio.run(main()) == {"pd-test-p": "prefill", "pd-test-d": "decode", "pd-test-old": "mixed"}
    finally:
        for wid in entries:
            sync.delete(worker_key(wid))
            sync.srem(WORKERS, wid)
        sync.close()
