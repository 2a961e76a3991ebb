"""Replica state without I/O: load as report plus the gateway's own placements since, the prefill
rate learned from TTFTs, and the routing decision over the index."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.fleet.replicas import LoadReport, Replica, ReplicaSet
from gateway.forward.router import MIN_SPEED_SAMPLES, decide, routing_rates
from policies import RoutingConfig, build_pd, build_policy
from radix import RadixIndex, block_hashes
from radix.capacity import pending_horizon
from tests.support.replicas import MODEL, replica


def test_load_adds_only_what_was_placed_after_the_report() -> None:
    replicas = ReplicaSet()
    r = replica("a")
    replicas.add(r)
    early = replicas.dispatched(r, now=1.0, prefill_tokens=100)
    r.report = LoadReport(running=2, waiting=1, queued_prefill_tokens=50, at=2.0)
    late = replicas.dispatched(r, now=3.0, prefill_tokens=40)
    # `early` is in the report already; `late` is not, and adds a waiting request and its tokens.
    assert r.load() == (2, 2, 90)
    replicas.started(r, late, ttft_s=0.1, alpha=0.5, min_tokens=1)
    assert r.load() == (3, 1, 50)
    replicas.finished(r, late)
    replicas.finished(r, early)
    assert r.load() == (2, 1, 50) and not r.inflight


def test_the_prefill_rate_learns_from_ttfts_of_real_prefills() -> None:
    replicas = ReplicaSet()
    r = replica("a", prefill_rate=1000.0)
    replicas.add(r)
    small = replicas.dispatched(r, now=0.0, prefill_tokens=10)
    replicas.started(r, small, ttft_s=1.0, alpha=0.5, min_tokens=64)
    assert r.prefill_rate == 1000.0  # too few tokens to say anything about prefill speed
    big = replicas.dispatched(r, now=0.0, prefill_tokens=3000)
    replicas.dispatched(r, now=0.0, prefill_tokens=500)  # waits behind `big`
    # 3000 own tokens in 1 s (the small request already runs: nothing queued ahead): halfway to 3000/s.
    replicas.started(r, big, ttft_s=1.0, alpha=0.5, min_tokens=64)
    assert r.prefill_rate == pytest.approx(2000.0)
    replicas.started(r, big, ttft_s=0.001, alpha=0.5, min_tokens=64)  # once per request
    assert r.prefill_rate == pytest.approx(2000.0)
    # 500 own tokens behind the 500 of `queued`, still waiting when it was placed: 1000 tokens in 1 s.
    last = replicas.dispatched(r, now=0.0, prefill_tokens=500)
    replicas.started(r, last, ttft_s=1.0, alpha=0.5, min_tokens=64)
    assert r.prefill_rate == pytest.approx(2000.0 + 0.5 * (500 + 500 - 2000.0))


def test_draining_and_unhealthy_replicas_are_not_routable() -> None:
    r = replica("a")
    assert r.view(0, 0, r.prefill_rate).healthy
    r.draining = True
    assert not r.view(0, 0, r.prefill_rate).healthy
    r.draining, r.healthy = False, False
    assert not r.view(0, 0, r.prefill_rate).healthy


def test_decide_matches_per_block_size_and_prefers_the_holder() -> None:
    tokens = list(range(100, 164))
    small, large, cold = replica("small", 4), replica("large", 16), replica("cold", 4)
    index = RadixIndex()
    for r in (small, large, cold):
        index.add_replica(r.id)
    index.insert("small", block_hashes(tokens, 4, MODEL)[:10])
    index.insert("large", block_hashes(tokens, 16, MODEL)[:3])
    decision = decide(build_policy(RoutingConfig()), index, [small, large, cold], tokens)
    assert set(decision.hashes) == {4, 16}
    assert {v.id: v.matched_blocks for v in decision.views} == {"small": 10, "large": 3, "cold": 0}
    assert decision.order[0] == "large"  # 48 cached tokens beat 40
    rows = {row["replica"]: row for row in decision.explain()}
    assert rows["large"]["cached_tokens"] == 48 and rows["large"]["rank"] == 0
    assert rows["cold"]["est_ttft_s"] == pytest.approx(64 / 1000.0)


def test_decide_without_tokens_still_routes() -> None:
    index = RadixIndex()
    replicas = [replica("a"), replica("b")]
    for r in replicas:
        index.add_replica(r.id)
    decision = decide(build_policy(RoutingConfig(policy="round_robin")), index, replicas, None)
    assert decision.prompt_tokens == 0 and decision.hashes == {} and len(decision.order) == 2


def test_replicas_of_one_speed_route_by_their_pooled_rate_and_a_distinct_one_by_its_own() -> None:
    learned = {"a": 24_000.0, "b": 28_000.0, "c": 26_500.0, "fresh": 10_000.0, "slow": 9_000.0}
    # Speeds over many TTFTs: a, b and c within sampling noise, slow a third of theirs.
    speeds = {"a": 25_000.0, "b": 26_000.0, "c": 27_000.0, "slow": 8_700.0}
    replicas = []
    for rid, rate in learned.items():
        r = replica(rid)
        r.prefill_rate, r.rate_samples = rate, 0 if rid == "fresh" else MIN_SPEED_SAMPLES
        r.speed_work, r.speed_seconds = speeds.get(rid, 0.0), 1.0 if rid in speeds else 0.0
        replicas.append(r)
    rates = routing_rates(replicas)
    # a, b and c differ by sampling noise; fresh has no samples yet (its prior would shut it out).
    assert rates["a"] == rates["b"] == rates["c"] == rates["fresh"] == 25_250.0  # the median of four
    assert rates["slow"] == pytest.approx(25_250.0 * 8_700.0 / 25_500.0), "three times slower: another kind"
    # Nothing learned anywhere: every replica keeps what it has.
    fresh = [replica("x"), replica("y")]
    assert routing_rates(fresh) == {"x": fresh[0].prefill_rate, "y": fresh[1].prefill_rate}


def test_a_rate_that_only_looked_apart_for_a_few_ttfts_routes_as_its_peers() -> None:
    """The identical replicas of a replay learned rates 30 % apart in 77 % of decisions (a rate of a
    few TTFTs); only a speed over MIN_SPEED_SAMPLES TTFTs sets one apart."""
    replicas = ReplicaSet()
    peers = [replica(rid) for rid in ("a", "b", "c")]
    for r in peers:
        replicas.add(r)
    # Each TTFT of its own, 2000 tokens: a and b at 1 s each, c caught behind decode steps at 3 s.
    for _ in range(MIN_SPEED_SAMPLES - 1):
        for r, ttft in zip(peers, (1.0, 1.0, 3.0), strict=True):
            replicas.started(r, replicas.dispatched(r, 0.0, 2000), ttft_s=ttft, alpha=0.2, min_tokens=64)
    assert peers[2].prefill_rate < 0.5 * peers[0].prefill_rate  # its own rate says another kind
    assert len(set(routing_rates(peers).values())) == 1, "too few TTFTs to say so"
    for r, ttft in zip(peers, (1.0, 1.0, 3.0), strict=True):
        replicas.started(r, replicas.dispatched(r, 0.0, 2000), ttft_s=ttft, alpha=0.2, min_tokens=64)
    rates = routing_rates(peers)
    assert rates["c"] == pytest.approx(rates["a"] / 3), "persistently 3x slower: another kind"


def test_free_blocks_are_the_report_less_what_was_placed_after_it() -> None:
    replicas = ReplicaSet()
    r = replica("a")
    replicas.add(r)
    assert r.free_blocks() is None and r.view(0, 0, 1.0).free_blocks is None  # nothing reported
    early = replicas.dispatched(r, now=1.0, prefill_tokens=0, kv_blocks=5)
    r.report = LoadReport(kv_blocks_used=30, kv_blocks_total=100, at=2.0)
    late = replicas.dispatched(r, now=3.0, prefill_tokens=0, kv_blocks=10)
    assert r.free_blocks() == 60, "the early request is in the report already"
    replicas.finished(r, late)
    replicas.finished(r, early)
    assert r.view(0, 0, 1.0).free_blocks == 70


def test_a_view_says_what_part_a_replica_plays_in_a_pair() -> None:
    view = replica("p", role="prefill").view(0, 0, 1.0)
    assert (view.role, view.pd_protocol, view.local_prefill) == ("prefill", None, True)
    sglang = replica("d", kind="openai", role="decode", pd_protocol="sglang").view(0, 0, 1.0)
    assert (sglang.role, sglang.pd_protocol, sglang.local_prefill) == ("decode", "sglang", False)
    assert replica("v", kind="openai", role="decode", pd_protocol="vllm").view(0, 0, 1.0).local_prefill


def test_decide_pairs_only_models_served_by_prefill_and_decode_replicas() -> None:
    tokens = list(range(100, 500))
    index = RadixIndex()
    mixed = [replica("a"), replica("b")]
    pd_fleet = [replica("p", role="prefill"), replica("d", role="decode")]
    for r in mixed + pd_fleet:
        index.add_replica(r.id)
    index.insert("p", block_hashes(tokens, 4, MODEL)[:50])
    policy, pd = build_policy(RoutingConfig()), build_pd(RoutingConfig())
    plain = decide(policy, index, mixed, tokens, pd=pd)
    assert plain.policy == "prefix_aware" and plain.prefill == {} and len(plain.order) == 2
    paired = decide(policy, index, pd_fleet, tokens, pd=pd)
    assert (paired.policy, paired.order, paired.prefill) == ("pd", ["d"], {"d": "p"})
    rows = {row["replica"]: row for row in paired.explain()}
    assert rows["p"]["role"] == "prefill" and rows["p"]["rank"] is None and rows["p"]["cached_tokens"] == 200
    assert rows["d"]["prefill_replica"] == "p" and rows["d"]["rank"] == 0
    # A route whose body cannot name a prefill replica: the decode replica computes the prompt.
    assert decide(policy, index, pd_fleet, tokens, pd=pd, transfer=False).prefill == {}


def test_a_siblings_requests_count_in_the_load_and_end_with_it() -> None:
    """`serve --workers N`: what the other processes placed here weighs as this process's own does, and
    a sibling that exits takes its requests with it."""
    replicas = ReplicaSet()
    told: list[tuple[object, ...]] = []
    replicas.announce = told.append
    r = replica("a")
    r.report = LoadReport(running=1, waiting=0, queued_prefill_tokens=0, kv_blocks_total=100, at=2.0)
    replicas.add(r)
    replicas.sibling_dispatched(1, "a", 7, at=1.0, prefill_tokens=500, kv_blocks=9)  # in the report
    replicas.sibling_dispatched(1, "a", 8, at=3.0, prefill_tokens=300, kv_blocks=5)
    replicas.sibling_dispatched(2, "a", 8, at=3.0, prefill_tokens=200, kv_blocks=4)  # another's handle 8
    replicas.sibling_dispatched(2, "unknown", 1, at=3.0, prefill_tokens=1, kv_blocks=1)
    assert r.load() == (1, 2, 500) and r.free_blocks() == 91
    replicas.sibling_started(1, "a", 8)
    assert r.load() == (2, 1, 200)
    own = replicas.dispatched(r, now=4.0, prefill_tokens=50, kv_blocks=1)
    assert r.load() == (2, 2, 250)
    replicas.sibling_gone(2)
    assert r.load() == (2, 1, 50)
    replicas.sibling_finished(1, "a", 8)
    replicas.started(r, own, ttft_s=0.1, alpha=0.5, min_tokens=1)
    replicas.finished(r, own)
    replicas.finished(r, own)  # told once
    assert r.load() == (1, 0, 0) and set(r.sibling_inflight) == {(1, 7)}
    assert told == [("dispatched", "a", own, 4.0, 50, 1), ("started", "a", own), ("finished", "a", own)]


def _scanned(r: Replica) -> tuple[tuple[int, int, int], int | None]:
    """load() and free_blocks() as a scan of every request in flight would give them."""
    running, waiting, queued, placed = r.report.running, r.report.waiting, r.report.queued_prefill_tokens, 0
    for req in itertools.chain(r.inflight.values(), r.sibling_inflight.values()):
        if req.dispatched <= r.report.at:
            continue
        placed += req.kv_blocks
        if req.started:
            running += 1
        else:
            waiting += 1
            queued += req.prefill_tokens
    free = None
    if r.report.kv_blocks_total > 0:
        free = max(r.report.kv_blocks_total - r.report.kv_blocks_used - placed, 0)
    return (running, waiting, queued), free


_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "dispatch",
                "start",
                "finish",
                "report",
                "sibling",
                "sibling_start",
                "sibling_end",
                "sibling_gone",
            ]
        ),
        st.integers(0, 7),
        st.integers(0, 500),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_the_load_kept_as_requests_come_and_go_is_the_one_a_scan_reads(
    ops: list[tuple[str, int, int]],
) -> None:
    """The sum of what was placed after the last report is kept as requests are dispatched, start and
    end (here and in siblings) and recounted at each report: after any sequence, it equals a scan."""
    replicas = ReplicaSet()
    r = replica("a")
    replicas.add(r)
    clock = itertools.count(1)
    handles: list[int] = []
    for op, k, n in ops:
        now = float(next(clock))
        if op == "dispatch":
            tick = None if k == 7 else n  # any order of ticks; some requests not recorded
            handles.append(
                replicas.dispatched(r, now, prefill_tokens=n, recorded_tick=tick, kv_blocks=n // 16)
            )
        elif op == "start" and handles:
            replicas.started(r, handles[k % len(handles)], ttft_s=0.1, alpha=0.5, min_tokens=1)
        elif op == "finish" and handles:
            replicas.finished(r, handles.pop(k % len(handles)))
        elif op == "report":
            # A report describes some earlier moment, or none yet seen (at may go back: a slow poll).
            r.report = LoadReport(
                running=k,
                waiting=k // 2,
                queued_prefill_tokens=n,
                kv_blocks_used=n,
                kv_blocks_total=n + 300,
                at=now - k,
            )
        elif op == "sibling":
            replicas.sibling_dispatched(k % 2, "a", k, now - n % 3, prefill_tokens=n, kv_blocks=n // 16)
        elif op == "sibling_start":
            replicas.sibling_started(k % 2, "a", k)
        elif op == "sibling_end":
            replicas.sibling_finished(k % 2, "a", k)
        elif op == "sibling_gone":
            replicas.sibling_gone(k % 2)
        assert (r.load(), r.free_blocks()) == _scanned(r)
        assert r.pending_horizon() == pending_horizon(r.inflight.values())


def test_requests_that_end_under_a_long_waiting_one_do_not_pile_up_in_the_horizons_heap() -> None:
    replicas = ReplicaSet()
    r = replica("a")
    replicas.add(r)
    stuck = replicas.dispatched(r, 0.0, prefill_tokens=10, recorded_tick=1)
    for n in range(1000):
        replicas.finished(r, replicas.dispatched(r, 1.0 + n, prefill_tokens=10, recorded_tick=2 + n))
        # At most two in flight as each is placed: the heap is compacted past 2 x 2 + 64 entries.
        assert len(r._recorded) <= 2 * 2 + 65
    assert r.pending_horizon() == 1
    replicas.started(r, stuck, ttft_s=0.1, alpha=0.5, min_tokens=1)
    assert r.pending_horizon() == float("inf")
