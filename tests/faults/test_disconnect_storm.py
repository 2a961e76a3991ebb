"""A disconnect storm: 500 clients start streams through the gateway and all drop them mid-stream.
Every upstream sequence must be aborted — each worker back to nothing running or waiting and no KV
block referenced (only unreferenced cached blocks, refcount 0, stay for reuse) — and the gateway must
hold no request, within a few seconds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from bench.chaos_fleet import WORKER, fast_gateway_config, sim_profile
from bench.chaos_traffic import completion, disconnect_storm_clients, family_prompt
from bench.local_fleet import Fleet, start_gateway, start_worker, wait_healthy
from bench.probes import metric, wait_for

CLIENTS = 500
NUM_BLOCKS = 8192
# Slow steps: 5 tokens/s per stream, so a 1,000-token answer is still going long after every client
# has its first chunk (and the 2 cores are not spent writing tokens nobody reads).
STEP_S = 0.2
SETTLE_S = 5.0


def load(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/load", timeout=5).json()


def gateway_inflight(url: str) -> tuple[float | None, int]:
    """The gateway's in-flight gauge, and the sum of its per-replica in-flight counts."""
    listing = httpx.get(f"{url}/admin/replicas", timeout=5).json()
    return metric(url, "prefixgate_gateway_inflight_requests"), sum(
        r["inflight"] for r in listing["replicas"]
    )


@pytest.mark.timeout(150)
def test_every_upstream_sequence_is_aborted_when_500_clients_drop_mid_stream(fleet: Fleet) -> None:
    profile = sim_profile(fleet.workdir, "slow", step_s=STEP_S)
    flags = ("--sim-profile", profile, "--num-blocks", str(NUM_BLOCKS), "--max-waiting", "1024")
    workers = [fleet.add(start_worker(fleet.workdir, WORKER, f"ds-w{i}", *flags)) for i in range(2)]
    config = fast_gateway_config([w.url for w in workers], routing={"policy": "round_robin"})
    gateway = fleet.add(start_gateway(fleet.workdir, "gateway", config))
    wait_healthy(fleet.children)
    # 25 families of prompts: shared prefix blocks are referenced by many sequences at once.
    bodies = [completion(family_prompt(i, families=25), max_tokens=1000) for i in range(CLIENTS)]
    peak = lambda: ([load(w.url) for w in workers], gateway_inflight(gateway.url))  # noqa: E731
    storm = asyncio.run(disconnect_storm_clients(gateway.url, bodies, hold_timeout_s=60, before_drop=peak))
    loads, inflight = storm.at_peak
    print(
        f"\n{storm.streaming} of {CLIENTS} streams started (slowest first chunk "
        f"{storm.max_first_chunk_s:.2f} s), refused {dict(storm.refused)}, errors {len(storm.errors)}; "
        f"before the drop: gateway in flight {inflight[0]:.0f}, "
        + ", ".join(f"{ld['running']} running / {ld['kv_blocks_used']} blocks used" for ld in loads)
    )
    assert storm.streaming == CLIENTS and not storm.errors
    # Before the drop every stream is held at both ends: that is what must all be given back.
    assert inflight == (CLIENTS, CLIENTS)
    assert sum(ld["running"] + ld["waiting"] for ld in loads) == CLIENTS
    assert all(ld["kv_blocks_used"] > 0 for ld in loads)

    def settled() -> bool:
        loads = [load(w.url) for w in workers]
        idle = all(ld["running"] == ld["waiting"] == ld["kv_blocks_used"] == 0 for ld in loads)
        return idle and gateway_inflight(gateway.url) == (0, 0)

    polled = time.monotonic()
    wait_for(settled, "every sequence to be aborted and every block freed", timeout=SETTLE_S)
    took = time.monotonic() - polled
    freed = time.monotonic() - storm.dropped_at
    print(f"all aborted and freed {freed:.2f} s after the drop ({took:.2f} s of polling)")
    for worker in workers:
        # Blocks with refcount 0 stay registered for reuse: cached, but not used.
        cached = len(httpx.get(f"{worker.url}/kv/snapshot", timeout=5).json()["hashes"])
        assert 0 < cached <= NUM_BLOCKS
    # The fleet serves at once afterwards.
    answer = httpx.post(
        f"{gateway.url}/v1/completions", json=completion(family_prompt(1), max_tokens=2), timeout=30
    )
    assert answer.status_code == 200
