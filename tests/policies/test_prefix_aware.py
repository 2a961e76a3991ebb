"""prefix_aware: the stated model (own TTFT plus the fleet's recompute), its ties, its limits, temperature."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from policies import ReplicaView, RouteRequest
from policies.prefix_aware import PrefixAware, PrefixAwareConfig


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


def test_cost_adds_the_recompute_of_what_the_best_holder_has() -> None:
    policy = PrefixAware(PrefixAwareConfig(recompute_penalty=2.0))
    request = RouteRequest(prompt_tokens=1000)
    lacking = ReplicaView(id="b", matched_blocks=10, queued_prefill_tokens=200, prefill_rate=1000.0)
    # own: (200 + 1000 - 160) / 1000; the fleet's: 2 x (800 - 160) / 1000
    assert policy.cost(request, lacking, best_cached=800, weight=2.0) == pytest.approx(1.04 + 1.28)


def test_each_request_waiting_in_the_fleet_adds_a_recompute_to_the_weight() -> None:
    assert PrefixAware().recompute_weight(0) == 1.0
    assert PrefixAware().recompute_weight(5) == 6.0
    config = PrefixAwareConfig(recompute_penalty=0.5, waiting_weight=0.25)
    assert PrefixAware(config).recompute_weight(4) == pytest.approx(1.5)
    assert PrefixAware(PrefixAwareConfig(waiting_weight=0.0)).recompute_weight(9) == 1.0


@pytest.mark.parametrize("penalty", [0.0, 1.0, 3.0])
def test_a_turn_leaves_its_history_only_when_the_holder_is_slower_by_more_than_the_recompute(
    penalty: float,
) -> None:
    """A session's turn (2,000 tokens, 1,600 of them held by `holder`): it moves to an idle replica
    exactly when the holder's queue costs more than (1 + penalty) times the recompute."""
    request = RouteRequest(prompt_tokens=2000)
    policy = PrefixAware(PrefixAwareConfig(recompute_penalty=penalty))
    margin = (1 + penalty) * 1600  # in tokens at equal rates
    below = ReplicaView(id="holder", matched_blocks=100, queued_prefill_tokens=int(margin) - 1)
    above = replace(below, queued_prefill_tokens=int(margin) + 1)
    idle = ReplicaView(id="idle")
    assert policy.choose(request, [below, idle])[0] == "holder"
    assert policy.choose(request, [above, idle])[0] == "idle"


@pytest.mark.parametrize("waiting", [1, 4])
def test_a_busier_fleet_keeps_a_turn_with_its_history_longer(waiting: int) -> None:
    """The same turn with `waiting` requests queued on a third replica: the holder keeps it until its
    queue costs more than (2 + waiting) recomputes, and with waiting_weight 0 only until 2."""
    request = RouteRequest(prompt_tokens=2000)
    busy = ReplicaView(id="busy", waiting=waiting, queued_prefill_tokens=100_000)
    margin = (2 + waiting) * 1600
    holder = ReplicaView(id="holder", matched_blocks=100, queued_prefill_tokens=margin - 1)
    idle = ReplicaView(id="idle")
    assert PrefixAware().choose(request, [holder, idle, busy])[0] == "holder"
    assert (
        PrefixAware().choose(request, [replace(holder, queued_prefill_tokens=margin + 1), idle, busy])[0]
        == "idle"
    )
    constant = PrefixAware(PrefixAwareConfig(waiting_weight=0.0))
    assert (
        constant.choose(request, [replace(holder, queued_prefill_tokens=2 * 1600 + 1), idle, busy])[0]
        == "idle"
    )


def test_a_new_prefix_goes_where_it_starts_soonest() -> None:
    request = RouteRequest(prompt_tokens=800, prefix_key=5)
    replicas = [
        ReplicaView(id="a", queued_prefill_tokens=300),
        ReplicaView(id="b", queued_prefill_tokens=100),
    ]
    assert PrefixAware().choose(request, replicas) == ["b", "a"]


def test_a_short_shared_prefix_attracts_only_as_far_as_it_saves() -> None:
    """Only one replica holds a 512-token system prompt of a 4,000-token request: it wins while its
    queue is under what the prompt saves there plus the recompute elsewhere, no further."""
    request = RouteRequest(prompt_tokens=4000)
    holder = ReplicaView(id="holder", matched_blocks=32, queued_prefill_tokens=1000)
    cold = ReplicaView(id="cold")
    assert PrefixAware().choose(request, [holder, cold])[0] == "holder"
    assert PrefixAware().choose(request, [replace(holder, queued_prefill_tokens=1100), cold])[0] == "cold"


def test_ties_go_to_the_fewest_requests_then_the_emptiest_cache() -> None:
    request = RouteRequest(prompt_tokens=800, prefix_key=3)
    replicas = [
        ReplicaView(id="a", running=2, cached_blocks=10),
        ReplicaView(id="b", running=1, cached_blocks=50),
        ReplicaView(id="c", running=1, cached_blocks=20),
    ]
    assert PrefixAware().choose(request, replicas) == ["c", "b", "a"]


def test_full_ties_spread_distinct_prefixes_and_keep_one_prefix_in_place() -> None:
    replicas = [ReplicaView(id=r) for r in "abcd"]
    policy = PrefixAware()
    firsts = {policy.choose(RouteRequest(prompt_tokens=800, prefix_key=k), replicas)[0] for k in range(4)}
    assert firsts == {"a", "b", "c", "d"}
    again = {policy.choose(RouteRequest(prompt_tokens=800, prefix_key=7), replicas)[0] for _ in range(5)}
    assert len(again) == 1


def test_hot_prefix_spills_as_its_holders_queue_grows() -> None:
    """One shared prefix, requests arriving back to back: the holder takes them until its queue costs
    more than the recompute elsewhere, then the others do, and cache it too."""
    policy = PrefixAware()
    replicas = {rid: ReplicaView(id=rid) for rid in ("a", "b", "c", "d")}
    replicas["a"] = replace(replicas["a"], matched_blocks=100)
    picks = []
    for _ in range(120):
        chosen = policy.choose(RouteRequest(prompt_tokens=1700), list(replicas.values()))[0]
        picks.append(chosen)
        r = replicas[chosen]
        # It now holds the prefix and queues the request's uncached part.
        replicas[chosen] = replace(
            r, matched_blocks=100, queued_prefill_tokens=r.queued_prefill_tokens + 1700 - r.cached_tokens
        )
    assert picks[0] == "a"
    counts = Counter(picks)
    assert set(counts) == {"a", "b", "c", "d"}
    assert counts["a"] < 0.4 * len(picks)
    assert picks[:32] == ["a"] * 32  # until a's queue of 3,200 tokens outweighs 1,700 + 1,600 elsewhere


def test_a_replica_at_its_queue_limit_ranks_last_whatever_it_holds() -> None:
    request = RouteRequest(prompt_tokens=2000)
    full = ReplicaView(id="full", matched_blocks=120, waiting=8, max_waiting=8)
    other = ReplicaView(id="other", queued_prefill_tokens=50_000)
    assert PrefixAware().choose(request, [full, other]) == ["other", "full"]


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


def test_the_removed_corrections_are_refused_by_name() -> None:
    """Configs written for the stack of corrections this model replaced fail loudly, naming the key."""
    for key in ("min_match_ratio", "balance_penalty_tokens", "hot_spot_guard", "tie_tolerance_s"):
        with pytest.raises(ValueError, match=key):
            PrefixAwareConfig.model_validate({key: 1})
