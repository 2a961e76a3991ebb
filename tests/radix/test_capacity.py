"""Learning a predicted replica's capacity: the model's own rules (radix.capacity.Learner), then the
index applying them to its LRU (RadixIndex.predicted, correct, set_capacity)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import pytest

from radix.capacity import (
    BOUNDS_KEPT,
    GHOSTS_PER_BLOCK,
    MIN_LEARNED_CAPACITY,
    PRIOR_SLACK,
    Learner,
    Predicted,
    capacity_prior,
    pending_horizon,
)
from radix.index import RadixIndex


@dataclass
class Request:
    started: bool
    recorded_tick: int | None


def test_a_guessed_prior_is_loosened_a_known_pool_is_kept() -> None:
    assert capacity_prior(100, guessed=True) == 100 * PRIOR_SLACK
    assert capacity_prior(100, guessed=False) == 100
    assert capacity_prior(None, guessed=True) is None


def test_the_horizon_is_the_earliest_tick_of_a_request_still_waiting_for_its_first_token() -> None:
    waiting = [Request(False, 40), Request(False, 12), Request(True, 3), Request(False, None)]
    assert pending_horizon(waiting) == 12
    assert pending_horizon([Request(True, 3)]) == math.inf == pending_horizon([])


def learner_of(hashes: list[int]) -> Learner:
    learner = Learner()
    for h in hashes:
        learner.ticks[h] = learner.tick
        learner.tick += 1
    return learner


def test_a_prediction_is_the_leading_held_blocks_then_the_leading_dropped_ones() -> None:
    learner = learner_of([10, 11, 12])
    for h in (13, 14, 15):
        learner.evicted(h, capacity=100)
    predicted = learner.predicted([10, 11, 13, 15, 12], horizon=7)
    # 12 is held but comes after a block that is not: a prefix ends at its first gap.
    assert predicted == Predicted(ticks=(0, 1), ghosted=(3, 1), horizon=7)
    assert predicted.blocks == 2
    assert learner.predicted([99, 10], horizon=math.inf).blocks == 0


def test_ghosts_are_bounded_per_block_of_capacity_with_a_floor() -> None:
    learner = Learner()
    for h in range(GHOSTS_PER_BLOCK * MIN_LEARNED_CAPACITY + 10):
        learner.evicted(h, capacity=None)
    assert len(learner.ghosts) == GHOSTS_PER_BLOCK * MIN_LEARNED_CAPACITY
    assert 0 not in learner.ghosts and next(iter(learner.ghosts)) == 10
    learner.evicted(-1, capacity=MIN_LEARNED_CAPACITY * 2)
    assert len(learner.ghosts) == GHOSTS_PER_BLOCK * MIN_LEARNED_CAPACITY + 1


def test_a_shortfall_is_evidence_only_outside_the_horizon() -> None:
    predicted = Predicted(ticks=(5, 6, 9), ghosted=(), horizon=9)
    assert learner_of([]).lacked(predicted, realised=1) == 6
    assert learner_of([]).lacked(predicted, realised=2) is None, "tick 9 was recorded by a request on its way"


def test_the_bound_is_the_median_of_the_latest_ones_never_below_the_floor() -> None:
    learner = Learner()
    lefts = [500, 10, 300, 200, 900, 100, 700, 400, 600, 800]
    for n, left in enumerate(lefts, 1):
        kept = [max(x, MIN_LEARNED_CAPACITY) for x in lefts[:n]][-BOUNDS_KEPT:]
        assert learner.bound(left) == statistics.median_high(kept)


def test_a_regain_of_dropped_blocks_raises_the_capacity_and_forgets_the_bounds() -> None:
    learner = Learner()
    learner.bound(100)
    predicted = Predicted(ticks=(1,), ghosted=(30, 20, 10), horizon=math.inf)
    assert learner.regained(predicted, realised=1, capacity=100, held=90) is None
    assert learner.bounds, "no regain: the bounds stand"
    # Two dropped blocks reused: the earliest was dropped 30 drops ago.
    assert learner.regained(predicted, realised=3, capacity=100, held=90) == 120
    assert not learner.bounds
    assert learner.regained(predicted, realised=3, capacity=500, held=90) == 500
    assert learner.regained(predicted, realised=3, capacity=None, held=90) is None


# -- as the index applies it ----------------------------------------------------------------------------

LEASE = 100.0  # a prediction's expiry: far enough never to matter here


def predicted_fleet(capacity: int | None, prefixes: int, blocks: int) -> tuple[RadixIndex, list[list[int]]]:
    """One learning replica that was sent `prefixes` prompts of `blocks` blocks each, in order."""
    index = RadixIndex()
    index.add_replica("r", capacity, learn=True)
    chains = [[1000 * p + b for b in range(blocks)] for p in range(prefixes)]
    for chain in chains:
        index.insert("r", chain, expires_at=LEASE)
    return index, chains


def test_a_shorter_reuse_than_predicted_evicts_the_older_blocks_and_bounds_the_capacity() -> None:
    index, chains = predicted_fleet(capacity=None, prefixes=30, blocks=10)
    assert index.capacity_of("r") is None and index.blocks_of("r") == 300
    asked = chains[12]
    predicted = index.predicted("r", asked)
    assert predicted.blocks == 10 and predicted.ghosted == ()
    index.insert("r", asked, expires_at=LEASE)  # the request is recorded as it is routed
    # The replica reused 4 of the 10 blocks: its 5th was gone, so were all blocks used before it.
    index.correct("r", predicted, realised=4)
    assert all(not index.holds("r", h) for chain in chains[:12] for h in chain)
    assert all(index.holds("r", h) for chain in chains[13:] for h in chain)
    assert all(index.holds("r", h) for h in asked), "the request itself is cached there now"
    assert index.capacity_of("r") == index.blocks_of("r") == 180
    # Later shortfalls evict as much, but one report alone can be an outlier (a block that went while
    # its request waited in the replica's queue): the capacity is the median of the latest bounds, and
    # tightens as the looser ones age out, never below the floor.
    bounds = [180]
    for chain in chains[20 : 21 + BOUNDS_KEPT]:
        index.correct("r", index.predicted("r", chain), realised=0)
        assert not index.holds("r", chain[0])
        bounds.append(max(index.blocks_of("r"), MIN_LEARNED_CAPACITY))
        assert index.capacity_of("r") == statistics.median_high(bounds[-BOUNDS_KEPT:])
    assert index.capacity_of("r") < 180 and bounds[-1] == MIN_LEARNED_CAPACITY
    # A regain shows those bounds too tight: they are dropped, and the next shortfall alone bounds it.
    fresh = [[500_000 + 1000 * p + b for b in range(10)] for p in range(18)]
    for chain in fresh[:12]:
        index.insert("r", chain, expires_at=LEASE)
    predicted = index.predicted("r", fresh[0])
    assert predicted.blocks == 0 and predicted.ghosted
    index.insert("r", fresh[0], expires_at=LEASE)
    index.correct("r", predicted, realised=10)
    assert index.capacity_of("r") > max(bounds[-BOUNDS_KEPT:])
    for chain in fresh[12:]:
        index.insert("r", chain, expires_at=LEASE)
    oldest = next(chain for chain in fresh[1:] if index.holds("r", chain[0]))
    index.correct("r", index.predicted("r", oldest), realised=0)
    left = index.blocks_of("r")
    assert index.capacity_of("r") == left > statistics.median_high([*bounds[-BOUNDS_KEPT + 1 :], left])


def test_a_longer_reuse_than_predicted_of_evicted_blocks_raises_the_capacity() -> None:
    index, chains = predicted_fleet(capacity=100, prefixes=30, blocks=10)
    assert index.blocks_of("r") == 100 and index.match(chains[0]) == {}
    predicted = index.predicted("r", chains[0])
    # Prefix 0 was the first dropped, leaf first: its root 191 drops ago, its leaf 200.
    assert predicted.blocks == 0 and predicted.ghosted == tuple(range(191, 201))
    index.insert("r", chains[0], expires_at=LEASE)
    # Yet the replica reused all of it: it holds what the bound keeps and all 200 dropped since.
    index.correct("r", predicted, realised=10)
    assert index.capacity_of("r") == 300
    # Blocks the bound never held (another client's traffic, a TTL) are no evidence about it.
    index.correct("r", index.predicted("r", [999_999, 999_998]), realised=2)
    assert index.capacity_of("r") == 300
    index.insert("r", chains[1], expires_at=LEASE)
    assert index.blocks_of("r") == 110
    # A capacity learned by another gateway applies at once.
    index.set_capacity("r", 70)
    assert index.blocks_of("r") == 70 and index.capacity_of("r") == 70
    assert index.predicted("r", [*chains[29][:3], 424242, chains[29][4]]).blocks == 3


def test_learning_needs_a_learning_replica() -> None:
    index = RadixIndex()
    index.add_replica("exact")
    index.insert("exact", [1, 2])
    with pytest.raises(ValueError, match="does not learn"):
        index.predicted("exact", [1])


def test_lacking_a_block_a_request_on_its_way_recorded_is_no_eviction() -> None:
    index, chains = predicted_fleet(capacity=None, prefixes=10, blocks=4)
    on_its_way = index.tick_now("r")
    index.insert("r", [77, 78, 79], expires_at=LEASE)  # routed, not yet computed by the replica
    asked = [77, 78, 79, 80]
    index.correct("r", index.predicted("r", asked, horizon=on_its_way), realised=0)
    assert index.capacity_of("r") is None and index.blocks_of("r") == 43
    # Once that request has its first token the blocks are the replica's: lacking them is evidence.
    index.correct("r", index.predicted("r", asked), realised=0)
    assert index.capacity_of("r") == 64 and not index.holds("r", chains[0][0])


def test_a_shortfall_evicts_around_the_blocks_of_requests_in_flight() -> None:
    """An engine does not evict what a running request uses: a report that the replica lacked a block
    drops the idle blocks used before it, not those a request in flight pins (they become the most
    recently used), and the capacity bound it sets counts them."""
    index, chains = predicted_fleet(capacity=None, prefixes=30, blocks=10)
    index.pin("r", chains[1])  # a request in flight since, with an older prompt than chains[2]
    index.correct("r", index.predicted("r", chains[12]), realised=0)
    assert not any(index.holds("r", h) for chain in (chains[0], *chains[2:13]) for h in chain)
    assert index.match(chains[1])["r"] == 10 and all(index.holds("r", h) for h in chains[1])
    assert index.capacity_of("r") == index.blocks_of("r") == 10 + 170
    # Still in flight, it is the most recently used: the bound takes the idle chains[13] first.
    index.insert("r", [900 + b for b in range(10)], expires_at=LEASE)
    assert all(index.holds("r", h) for h in chains[1]) and not index.holds("r", chains[13][0])
    index.unpin("r", chains[1])
    index.insert("r", [910 + b for b in range(10)], expires_at=LEASE)
    assert index.blocks_of("r") == 180 and not index.holds("r", chains[14][0])


def test_a_replica_all_pinned_keeps_its_prompts_in_flight_and_the_global_bound_still_holds() -> None:
    index = RadixIndex(max_entries=12)
    index.add_replica("r", capacity_blocks=4, learn=True)
    index.pin("r", [1, 2, 3, 4, 5, 6])
    index.insert("r", [1, 2, 3, 4, 5, 6], expires_at=LEASE)
    assert index.blocks_of("r") == 6, "nothing unpinned to evict: the bound waits for the request to end"
    index.pin("r", [7, 8, 9, 10, 11, 12, 13, 14])
    index.insert("r", [7, 8, 9, 10, 11, 12, 13, 14], expires_at=LEASE)
    # The gateway's memory bound is not the engine's: it drops entries pinned or not, and a pinned
    # block stays matched until its request ends.
    assert len(index) == 12 and index.match([1, 2, 3, 4, 5, 6])["r"] == 6
    index.unpin("r", [1, 2, 3, 4, 5, 6])
    assert index.match([1, 2, 3, 4, 5, 6]).get("r", 0) < 6
