"""Overload: every queue is bounded and a full fleet says so. Workers refuse past `--max-waiting` with
429; the gateway tries the next choice, and when every choice refuses the client gets the 429 with
Retry-After (OpenAI's error JSON), never a 5xx. The gateway bounds its own requests in flight
(`limits.max_inflight`), so its memory stays bounded under a burst."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from bench import local_fleet
from bench.chaos_fleet import WORKER, fast_gateway_config, sim_profile
from bench.chaos_traffic import Outcome, burst, completion, family_prompt
from bench.local_fleet import Fleet, wait_healthy
from bench.procfs import rss_bytes
from gateway.gateway_config import Limits
from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker

MIB = 2**20
# Requests each narrow worker holds: 2 generating (its batch) and 2 queued (--max-waiting).
RUNNING, WAITING = 2, 2


@pytest.fixture
def narrow_workers(tmp_path: Path, start_sim_worker: Callable[..., SimWorker]) -> list[SimWorker]:
    """Two workers that generate 2 sequences at a time and queue 2 more; a 300-token answer takes
    them about 2.4 s, so a burst finds them full."""
    profile = sim_profile(tmp_path, "narrow", max_num_seqs=RUNNING)
    flags = ("--sim-profile", profile, "--max-waiting", str(WAITING))
    return [start_sim_worker(f"ov-w{i}", *flags) for i in range(2)]


def long_bodies(count: int) -> list[dict]:
    return [completion(family_prompt(i), max_tokens=300) for i in range(count)]


def assert_refused_properly(outcomes: list[Outcome], code: str) -> None:
    for o in outcomes:
        if o.status != 200:
            assert (o.status, o.error) == (429, code), o
            assert o.retry_after is not None and int(o.retry_after) >= 1, o


@pytest.mark.timeout(60)
def test_a_full_fleet_answers_429_with_retry_after_not_a_5xx(
    narrow_workers: list[SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    gateway = start_gateway([w.url for w in narrow_workers], routing={"policy": "least_load"})
    outcomes, extra = asyncio.run(_burst_and_one_more(gateway.url))
    statuses = Counter(o.status for o in outcomes)
    print(f"\nburst of 14 on 2 x ({RUNNING} running + {WAITING} waiting): {dict(statuses)}")
    # Every place in the fleet was taken (a refusal is retried on the other replica), and every request
    # beyond them refused the OpenAI way.
    assert statuses == {200: 2 * (RUNNING + WAITING), 429: 14 - 2 * (RUNNING + WAITING)}
    assert_refused_properly(outcomes, "queue_full")
    assert extra.status_code == 429 and int(extra.headers["Retry-After"]) >= 1
    error = extra.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "queue_full")


async def _burst_and_one_more(url: str) -> tuple[list[Outcome], httpx.Response]:
    # 0.1 s apart, all within the 2.4 s the first answers take: each arrives after the one before it
    # took its place (a worker counts a request as waiting until its first step). One more comes
    # while the fleet is certainly full, its whole answer kept.
    sent = asyncio.ensure_future(burst(url, long_bodies(14), spacing_s=0.1))
    await asyncio.sleep(1.6)
    extra = await asyncio.to_thread(httpx.post, f"{url}/v1/completions", json=long_bodies(1)[0], timeout=30)
    return await sent, extra


@pytest.mark.timeout(60)
def test_a_refusal_outranks_an_unreachable_replica(
    narrow_workers: list[SimWorker],
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    """The last choice failing to connect must not turn the first one's 429 into a 502."""
    full, dead = narrow_workers[0], start_sim_worker("ov-dead")
    gateway = start_gateway(
        [full.url, dead.url],
        routing={"policy": "round_robin"},
        health={"interval_s": 30, "failures": 1000},  # it stays in the rotation while dead
    )
    dead.server.stop()
    # Fill `full` directly, then ask through the gateway: round robin alternates which one is first.
    held = asyncio.run(_fill_then_ask(full.url, gateway.url))
    assert Counter(o.status for o in held) == {429: 4}
    assert_refused_properly(held, "queue_full")


async def _fill_then_ask(worker_url: str, gateway_url: str) -> list[Outcome]:
    # One at a time: the worker's waiting count includes requests not yet past their first step.
    filling = []
    for body in long_bodies(RUNNING + WAITING):
        filling.append(asyncio.ensure_future(burst(worker_url, [body])))
        await asyncio.sleep(0.2)
    asked = await burst(gateway_url, long_bodies(4))
    assert [o.status for done in await asyncio.gather(*filling) for o in done] == [200] * 4
    return asked


@pytest.mark.timeout(60)
def test_the_gateway_refuses_past_its_own_inflight_limit(
    tmp_path: Path, start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    profile = sim_profile(tmp_path, "narrow", max_num_seqs=RUNNING)
    workers = [start_sim_worker(f"inf-w{i}", "--sim-profile", profile) for i in range(2)]
    gateway = start_gateway([w.url for w in workers], limits={"max_inflight": 4})
    outcomes = asyncio.run(burst(gateway.url, long_bodies(12)))
    statuses = Counter(o.status for o in outcomes)
    print(f"\nburst of 12 through a gateway with max_inflight 4: {dict(statuses)}")
    assert statuses == {200: 4, 429: 8}
    assert_refused_properly(outcomes, "gateway_overloaded")
    assert gateway.state.inflight == 0
    ok = httpx.post(f"{gateway.url}/v1/completions", json={**long_bodies(1)[0], "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["model"] == SIM_MODEL


# A burst of 2,000 requests at once on a gateway with the default limits: what it may add to the
# gateway's resident memory, and what a second burst may add on top (growth from one burst to the next
# is a leak).
BURST = 2000
BURST_GROWTH_BOUND = 96 * MIB
REPEAT_GROWTH_BOUND = 16 * MIB


@pytest.mark.timeout(150)
def test_the_gateway_memory_stays_bounded_under_a_burst(fleet: Fleet) -> None:
    workers = [fleet.add(local_fleet.start_worker(fleet.workdir, WORKER, f"mem-w{i}")) for i in range(2)]
    config = fast_gateway_config([w.url for w in workers])
    config.pop("health")  # the defaults, as for limits
    gateway = fleet.add(local_fleet.start_gateway(fleet.workdir, "gateway", config))
    wait_healthy(fleet.children)
    bodies = [completion(family_prompt(i, families=50), max_tokens=8) for i in range(BURST)]
    warm = asyncio.run(burst(gateway.url, bodies[:200]))
    assert {o.status for o in warm} == {200}
    before = rss_bytes(gateway.pid)
    first = asyncio.run(burst(gateway.url, bodies))
    after_first = rss_bytes(gateway.pid)
    second = asyncio.run(burst(gateway.url, bodies))
    after_second = rss_bytes(gateway.pid)
    limit = Limits().max_inflight
    for name, outcomes in (("first", first), ("second", second)):
        statuses = Counter((o.status, o.error) for o in outcomes)
        slowest = max(o.latency_s for o in outcomes)
        print(f"\n{name} burst of {BURST} (max_inflight {limit}): {dict(statuses)}, slowest {slowest:.2f} s")
        # Past the limit a fast 429; below it, served or refused by a full worker; never a 5xx.
        assert set(statuses) <= {(200, None), (429, "gateway_overloaded"), (429, "queue_full")}
        assert statuses[(429, "gateway_overloaded")] > 0 and statuses[(200, None)] >= BURST // 4
        assert all(o.retry_after for o in outcomes if o.status == 429)
    # The burst did not make the gateway take its busy replicas for dead ones.
    listing = httpx.get(f"{gateway.url}/admin/replicas", timeout=5).json()["replicas"]
    assert [r["healthy"] for r in listing] == [True, True]
    print(
        f"gateway RSS: {before / MIB:.1f} MiB before, {after_first / MIB:.1f} after the first burst "
        f"(+{(after_first - before) / MIB:.1f}, bound {BURST_GROWTH_BOUND / MIB:.0f}), "
        f"{after_second / MIB:.1f} after the second (+{(after_second - after_first) / MIB:.1f}, "
        f"bound {REPEAT_GROWTH_BOUND / MIB:.0f})"
    )
    assert after_first - before < BURST_GROWTH_BOUND
    assert after_second - after_first < REPEAT_GROWTH_BOUND
