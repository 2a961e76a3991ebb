"""cache_threshold: the best match above the threshold, the smallest cache below it, and the least
loaded replica whenever the fleet is imbalanced by both the absolute and the relative measure."""

from __future__ import annotations

from collections import Counter

import pytest

from policies import ConfigError, ReplicaView, RouteRequest, RoutingConfig, build_policy, parse_routing
from policies.cache_threshold import CacheThreshold, CacheThresholdConfig

BS = 16


def view(rid: str, matched: int = 0, cached: int = 0, running: int = 0, **kw: object) -> ReplicaView:
    """A replica holding `matched` blocks of the request and `cached` blocks in all."""
    return ReplicaView(
        id=rid, block_size=BS, matched_blocks=matched, cached_blocks=cached, running=running, **kw
    )


def test_a_match_above_the_threshold_goes_to_the_best_match_however_busy() -> None:
    policy = CacheThreshold()
    replicas = [view("a", matched=2, running=0), view("b", matched=7, running=40), view("c", running=0)]
    # 7 blocks of 16 = 112 of 320 tokens: 0.35 > 0.3.
    assert policy.choose(RouteRequest(prompt_tokens=320), replicas) == ["b", "a", "c"]


def test_a_match_at_or_below_the_threshold_goes_to_the_smallest_cache() -> None:
    policy = CacheThreshold()
    replicas = [view("a", matched=6, cached=900), view("b", cached=100, running=5), view("c", cached=300)]
    # 6 blocks = 96 of 320 tokens: exactly 0.3 is not above it.
    assert policy.choose(RouteRequest(prompt_tokens=320), replicas) == ["b", "c", "a"]
    assert (
        CacheThreshold(CacheThresholdConfig(cache_threshold=0.2)).choose(
            RouteRequest(prompt_tokens=320), replicas
        )[0]
        == "a"
    )


def test_a_match_longer_than_the_prompt_counts_as_the_whole_prompt() -> None:
    policy = CacheThreshold()
    # Both hold the whole 32-token prompt; the tie goes to the less loaded one.
    replicas = [view("a", matched=9, running=3), view("b", matched=2, running=1)]
    assert policy.choose(RouteRequest(prompt_tokens=32), replicas) == ["b", "a"]
    assert policy.match_ratio(RouteRequest(prompt_tokens=32), replicas) == 1.0
    assert policy.match_ratio(RouteRequest(prompt_tokens=0), replicas) == 0.0


@pytest.mark.parametrize(
    ("busy", "idle", "overrides"),
    [
        (100, 30, True),  # 70 apart, 3.3x
        (94, 30, False),  # 64 apart: not more than 64
        (200, 134, False),  # 66 apart, 1.49x: not over 1.5x
    ],
)
def test_the_imbalance_override_needs_both_the_absolute_and_the_relative_gap(
    busy: int, idle: int, overrides: bool
) -> None:
    policy = CacheThreshold()
    replicas = [view("hot", matched=20, running=busy), view("cold", running=idle, cached=10**6)]
    expected = ["cold", "hot"] if overrides else ["hot", "cold"]
    assert policy.choose(RouteRequest(prompt_tokens=320), replicas) == expected


def test_an_idle_fleet_with_empty_caches_is_spread_evenly() -> None:
    policy = build_policy(RoutingConfig(policy="cache_threshold"))
    replicas = [view(f"r{i}") for i in range(4)]
    firsts = Counter(policy.choose(RouteRequest(prompt_tokens=500), replicas)[0] for _ in range(40))
    assert firsts == {"r0": 10, "r1": 10, "r2": 10, "r3": 10}


def test_unhealthy_replicas_are_never_chosen_even_with_the_best_match() -> None:
    policy = CacheThreshold()
    replicas = [view("a", matched=20, healthy=False), view("b", cached=5), view("c", cached=1)]
    assert policy.choose(RouteRequest(prompt_tokens=320), replicas) == ["c", "b"]
    assert policy.choose(RouteRequest(prompt_tokens=320), [view("a", healthy=False)]) == []


def test_knobs_come_from_yaml_and_are_checked() -> None:
    routing = parse_routing(
        {"policy": "cache_threshold", "cache_threshold": {"cache_threshold": 0.5, "balance_abs_threshold": 8}}
    )
    policy = build_policy(routing)
    assert policy.name == "cache_threshold"
    assert isinstance(policy, CacheThreshold) and policy.config.balance_rel_threshold == 1.5
    with pytest.raises(ConfigError, match=r"routing\.cache_threshold\.balance_rel_threshold"):
        parse_routing({"cache_threshold": {"balance_rel_threshold": 0.5}})
    with pytest.raises(ConfigError, match=r"routing\.cache_threshold\.threshold: unknown key"):
        parse_routing({"cache_threshold": {"threshold": 0.5}})
