"""prefix_aware: the estimated TTFT trade of cache against queue, the hot-spot guard, temperature."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from policies import ReplicaView, RouteRequest
from policies.prefix_aware import HotSpotGuardConfig, PrefixAware, PrefixAwareConfig


def test_longest_cached_prefix_wins_at_equal_load() -> None:
    policy = PrefixAware()
    replicas = [
        ReplicaView(id="a", matched_blocks=10),
        ReplicaView(id="b", matched_blocks=60),
        ReplicaView(id="c"),
    ]
    for _ in range(5):
        assert policy.choose(RouteRequest(prompt_tokens=1024), replicas) == ["b", "a", "c"]


def test_est_ttft_follows_the_design_formula() -> None:
    policy = PrefixAware(PrefixAwareConfig(decode_penalty_s=0.01))
    replica = ReplicaView(
        id="a", matched_blocks=4, block_size=16, queued_prefill_tokens=1000, running=3, prefill_rate=2000.0
    )
    # (1000 queued + 500 prompt - 64 cached) / 2000 + 0.01 * 3
    assert policy.est_ttft(RouteRequest(prompt_tokens=500), replica) == pytest.approx(1436 / 2000 + 0.03)


def test_a_long_queue_outweighs_a_short_cached_prefix() -> None:
    request = RouteRequest(prompt_tokens=2000)
    holder = ReplicaView(id="holder", matched_blocks=8, queued_prefill_tokens=50_000)  # 128 cached tokens
    idle = ReplicaView(id="idle")
    assert PrefixAware().choose(request, [holder, idle])[0] == "idle"
    # ... but a long cached prefix is worth a moderate queue.
    holder = ReplicaView(id="holder", matched_blocks=120, queued_prefill_tokens=1_000)
    assert PrefixAware().choose(request, [holder, idle])[0] == "holder"


def test_recompute_penalty_keeps_prefixes_home_longer() -> None:
    request = RouteRequest(prompt_tokens=2000)
    holder = ReplicaView(id="holder", matched_blocks=100, queued_prefill_tokens=3_000)  # saves 1,600
    idle = ReplicaView(id="idle")
    assert PrefixAware(PrefixAwareConfig(recompute_penalty=0.0)).choose(request, [holder, idle])[0] == "idle"
    assert (
        PrefixAware(PrefixAwareConfig(recompute_penalty=3.0)).choose(request, [holder, idle])[0] == "holder"
    )


def test_hot_prefix_spills_once_its_replica_is_saturated() -> None:
    """One shared prefix, requests arriving back to back: the holder takes them until it saturates,
    then the others do, even though the cache makes the holder the cheapest by estimate."""
    policy = PrefixAware(PrefixAwareConfig(recompute_penalty=100.0))
    replicas = {rid: ReplicaView(id=rid, max_waiting=8) for rid in ("a", "b", "c", "d")}
    replicas["a"] = replace(replicas["a"], matched_blocks=100)
    picks = []
    for _ in range(40):
        chosen = policy.choose(RouteRequest(prompt_tokens=1700), list(replicas.values()))[0]
        picks.append(chosen)
        r = replicas[chosen]
        replicas[chosen] = replace(
            r, waiting=r.waiting + 1, queued_prefill_tokens=r.queued_prefill_tokens + 100
        )
    assert picks[0] == "a"
    counts = Counter(picks)
    assert set(counts) == {"a", "b", "c", "d"}
    assert counts["a"] < 0.7 * len(picks)


def test_share_guard_applies_only_past_min_outstanding() -> None:
    policy = PrefixAware(
        PrefixAwareConfig(hot_spot_guard=HotSpotGuardConfig(max_share=0.5, min_outstanding=10))
    )
    quiet = [ReplicaView(id="a", matched_blocks=50, running=3), ReplicaView(id="b")]
    assert policy.choose(RouteRequest(prompt_tokens=1000), quiet)[0] == "a"
    busy = [ReplicaView(id="a", matched_blocks=50, running=9), ReplicaView(id="b", running=2)]
    assert policy.choose(RouteRequest(prompt_tokens=1000), busy)[0] == "b"


def test_temperature_samples_but_favours_the_best() -> None:
    config = PrefixAwareConfig(temperature=0.5, seed=7)
    replicas = [ReplicaView(id="best", matched_blocks=50), ReplicaView(id="other")]
    picks = [PrefixAware(config).choose(RouteRequest(prompt_tokens=1000), replicas)[0] for _ in range(1)]
    policy = PrefixAware(config)
    many = Counter(policy.choose(RouteRequest(prompt_tokens=1000), replicas)[0] for _ in range(400))
    assert many["best"] > many["other"] > 0
    again = PrefixAware(config)
    assert again.choose(RouteRequest(prompt_tokens=1000), replicas)[0] == picks[0]


def test_unhealthy_holder_is_skipped() -> None:
    replicas = [ReplicaView(id="a", matched_blocks=100, healthy=False), ReplicaView(id="b")]
    assert PrefixAware().choose(RouteRequest(prompt_tokens=2000), replicas) == ["b"]


def test_a_small_shared_prefix_does_not_attract_new_sessions() -> None:
    """Only one replica holds the shared system block: new sessions still go where the queue is shortest."""
    request = RouteRequest(prompt_tokens=4000)
    replicas = [
        ReplicaView(id="holder", matched_blocks=32, queued_prefill_tokens=200),
        ReplicaView(id="cold"),
    ]
    assert PrefixAware().choose(request, replicas)[0] == "cold"
    assert PrefixAware(PrefixAwareConfig(min_match_ratio=0.0)).choose(request, replicas)[0] == "holder"


def test_new_prefixes_spread_over_equal_replicas() -> None:
    """Four new prefixes on four idle replicas go to four replicas, although one has the fewest
    requests running: each draws its followers to where it lands. A request that continues a prefix
    still goes to its holder."""
    replicas = [ReplicaView(id="a"), *(ReplicaView(id=r, running=3) for r in "bcd")]
    policy = PrefixAware()
    first = [policy.choose(RouteRequest(prompt_tokens=800, prefix_key=k), replicas)[0] for k in range(4)]
    assert sorted(first) == ["a", "b", "c", "d"]
    assert first[0] == "a"  # before any count, the fewest requests running still decides
    holder = [replace(r, matched_blocks=50 if r.id == "b" else 0) for r in replicas]
    assert policy.choose(RouteRequest(prompt_tokens=800, prefix_key=9), holder)[0] == "b"


def test_new_prefixes_pay_no_balance_penalty() -> None:
    """Replica a took the last 20 requests (a session's turns): a continuing request elsewhere would
    be pushed off it, but a new prefix still goes where it starts soonest."""
    policy = PrefixAware()
    busy = [ReplicaView(id="a", matched_blocks=50), ReplicaView(id="b")]
    for _ in range(20):
        assert policy.choose(RouteRequest(prompt_tokens=800), busy)[0] == "a"
    faster = [ReplicaView(id="a"), ReplicaView(id="b", queued_prefill_tokens=500)]
    assert policy.choose(RouteRequest(prompt_tokens=800, prefix_key=1), faster)[0] == "a"
    # The same queues, as a continuing request on neither replica's prefix: a's excess now counts.
    matched = [replace(r, matched_blocks=40) for r in faster]
    assert policy.choose(RouteRequest(prompt_tokens=800, prefix_key=2), matched)[0] == "b"
