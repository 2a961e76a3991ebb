"""Every policy: an ordered choice over healthy replicas, and the behaviour its name promises."""

from __future__ import annotations

from collections import Counter

import pytest

from policies import POLICY_NAMES, ReplicaView, RouteRequest, RoutingConfig, build_policy


def fleet(n: int, **overrides) -> list[ReplicaView]:
    return [ReplicaView(id=f"r{i}", **overrides) for i in range(n)]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_choice_is_an_ordering_of_the_healthy_replicas(name: str) -> None:
    policy = build_policy(RoutingConfig(policy=name))
    replicas = fleet(5)
    replicas[2] = ReplicaView(id="r2", healthy=False)
    for i in range(20):
        order = policy.choose(RouteRequest(prompt_tokens=100, session=f"s{i}"), replicas)
        assert sorted(order) == ["r0", "r1", "r3", "r4"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_healthy_replica_means_no_choice(name: str) -> None:
    policy = build_policy(RoutingConfig(policy=name))
    assert policy.choose(RouteRequest(prompt_tokens=10, session="s"), fleet(3, healthy=False)) == []


@pytest.mark.parametrize("name", ["round_robin", "least_load", "prefix_aware", "cache_threshold"])
def test_equal_replicas_and_no_cache_hit_spread_evenly(name: str) -> None:
    """A known failure of a peer router: equal loads, no match, and every request lands on replica 0."""
    policy = build_policy(RoutingConfig(policy=name))
    firsts = Counter(policy.choose(RouteRequest(prompt_tokens=500), fleet(4))[0] for _ in range(40))
    assert firsts == {"r0": 10, "r1": 10, "r2": 10, "r3": 10}


@pytest.mark.parametrize("name", ["random", "power_of_two"])
def test_randomised_policies_spread_and_are_reproducible(name: str) -> None:
    first = [
        build_policy(RoutingConfig(policy=name)).choose(RouteRequest(100), fleet(4))[0] for _ in range(1)
    ]
    policy_a = build_policy(RoutingConfig(policy=name))
    policy_b = build_policy(RoutingConfig(policy=name))
    picks_a = [policy_a.choose(RouteRequest(100), fleet(4))[0] for _ in range(400)]
    picks_b = [policy_b.choose(RouteRequest(100), fleet(4))[0] for _ in range(400)]
    assert picks_a == picks_b
    assert picks_a[0] == first[0]
    counts = Counter(picks_a)
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    assert max(counts.values()) < 2 * min(counts.values())


def test_least_load_picks_the_fewest_outstanding() -> None:
    policy = build_policy(RoutingConfig(policy="least_load"))
    replicas = [
        ReplicaView(id="a", running=3),
        ReplicaView(id="b", running=1, waiting=1),
        ReplicaView(id="c", running=1),
    ]
    assert policy.choose(RouteRequest(10), replicas) == ["c", "b", "a"]


def test_power_of_two_never_picks_the_single_busiest() -> None:
    policy = build_policy(RoutingConfig(policy="power_of_two"))
    replicas = [ReplicaView(id=f"r{i}", running=i) for i in range(5)]
    firsts = {policy.choose(RouteRequest(10), replicas)[0] for _ in range(300)}
    assert "r4" not in firsts
    assert firsts == {"r0", "r1", "r2", "r3"}


def test_round_robin_cycles() -> None:
    policy = build_policy(RoutingConfig(policy="round_robin"))
    assert [policy.choose(RouteRequest(1), fleet(3))[0] for _ in range(6)] == ["r0", "r1", "r2"] * 2
