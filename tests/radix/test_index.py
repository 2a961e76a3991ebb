"""The radix index against a naive reference model, plus the behaviours routing relies on."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radix.index import BOUNDS_KEPT, MIN_LEARNED_CAPACITY, NEVER, RadixIndex


class Reference:
    """Per replica, an ordered list of (hash, expiry), least recently used first; everything is a scan."""

    def __init__(self, max_entries: int | None) -> None:
        self.max_entries = max_entries
        self.replicas: dict[str, tuple[int | None, list[list]]] = {}

    def total(self) -> int:
        return sum(len(blocks) for _, blocks in self.replicas.values())

    def insert(self, rid: str, hashes: list[int], expires_at: float) -> None:
        capacity, blocks = self.replicas[rid]
        for h in reversed(hashes):
            row = next((r for r in blocks if r[0] == h), None)
            if row is None:
                blocks.append([h, expires_at])
            else:
                blocks.remove(row)
                blocks.append([h, max(row[1], expires_at)])
        while capacity is not None and len(blocks) > capacity:
            blocks.pop(0)
        while self.max_entries is not None and self.total() > self.max_entries:
            largest = max(self.replicas.values(), key=lambda item: len(item[1]))
            largest[1].pop(0)

    def match(self, hashes: list[int]) -> dict[str, int]:
        out = {}
        for rid, (_, blocks) in self.replicas.items():
            held = {r[0] for r in blocks}
            depth = 0
            while depth < len(hashes) and hashes[depth] in held:
                depth += 1
            if depth:
                out[rid] = depth
        return out


hash_ids = st.integers(0, 12)
chains = st.lists(hash_ids, min_size=0, max_size=8)
names = st.sampled_from(["a", "b", "c", "d"])


class IndexMachine(RuleBasedStateMachine):
    @initialize(max_entries=st.one_of(st.none(), st.integers(3, 20)))
    def setup(self, max_entries: int | None) -> None:
        self.index = RadixIndex(max_entries=max_entries)
        self.ref = Reference(max_entries)
        self.now = 0.0

    @rule(rid=names, capacity=st.one_of(st.none(), st.integers(1, 8)))
    def add(self, rid: str, capacity: int | None) -> None:
        if rid in self.ref.replicas:
            with pytest.raises(ValueError):
                self.index.add_replica(rid, capacity)
            return
        self.index.add_replica(rid, capacity)
        self.ref.replicas[rid] = (capacity, [])

    @precondition(lambda self: self.ref.replicas)
    @rule(data=st.data(), hashes=chains, ttl=st.one_of(st.none(), st.integers(1, 5)))
    def insert(self, data: st.DataObject, hashes: list[int], ttl: int | None) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ref.replicas)))
        expires_at = NEVER if ttl is None else self.now + ttl
        self.index.insert(rid, hashes, expires_at)
        self.ref.insert(rid, hashes, expires_at)

    @precondition(lambda self: self.ref.replicas)
    @rule(data=st.data(), hashes=st.lists(hash_ids, max_size=5))
    def remove(self, data: st.DataObject, hashes: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ref.replicas)))
        self.index.remove(rid, hashes)
        blocks = self.ref.replicas[rid][1]
        blocks[:] = [r for r in blocks if r[0] not in set(hashes)]

    @precondition(lambda self: self.ref.replicas)
    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ref.replicas)))
        self.index.clear(rid)
        self.ref.replicas[rid][1].clear()

    @precondition(lambda self: self.ref.replicas)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ref.replicas)))
        self.index.drop_replica(rid)
        del self.ref.replicas[rid]

    @rule(step=st.integers(0, 3))
    def advance_clock(self, step: int) -> None:
        self.now += step
        dropped = self.index.expire(self.now)
        expected = 0
        for _, blocks in self.ref.replicas.values():
            keep = [r for r in blocks if r[1] > self.now]
            expected += len(blocks) - len(keep)
            blocks[:] = keep
        assert dropped == expected

    @rule(hashes=chains)
    def match(self, hashes: list[int]) -> None:
        assert self.index.match(hashes) == self.ref.match(hashes)

    @invariant()
    def same_contents(self) -> None:
        if not hasattr(self, "index"):
            return
        assert len(self.index) == self.ref.total()
        assert sorted(self.index.replicas) == sorted(self.ref.replicas)
        for rid, (_, blocks) in self.ref.replicas.items():
            assert self.index.blocks_of(rid) == len(blocks)
            assert all(self.index.holds(rid, h) for h, _ in blocks)


TestIndexAgainstReference = IndexMachine.TestCase
TestIndexAgainstReference.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestIndexAgainstReference.pytestmark = [pytest.mark.fuzz]


def test_match_reports_leading_depth_per_replica() -> None:
    index = RadixIndex()
    for rid in ("a", "b", "c"):
        index.add_replica(rid)
    index.insert("a", [1, 2, 3, 4])
    index.insert("b", [1, 2])
    index.insert("c", [2, 3, 4])  # holds later blocks but not the root: no match
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.match([]) == {}
    assert index.match([9]) == {}


def test_gap_in_the_chain_stops_the_match() -> None:
    index = RadixIndex()
    index.add_replica("a")
    index.insert("a", [1, 2, 3])
    index.remove("a", [2])
    assert index.match([1, 2, 3]) == {"a": 1}


def test_capacity_evicts_leaves_before_roots() -> None:
    index = RadixIndex()
    index.add_replica("a", capacity_blocks=4)
    index.insert("a", [1, 2, 3])
    index.insert("a", [1, 7, 8])  # 4 distinct blocks would be 5: the oldest leaf (3) goes
    assert not index.holds("a", 3)
    assert index.match([1, 2]) == {"a": 2}
    assert index.match([1, 7, 8]) == {"a": 3}


def test_global_bound_takes_from_the_largest_replica() -> None:
    index = RadixIndex(max_entries=5)
    index.add_replica("small")
    index.add_replica("big")
    index.insert("small", [1])
    index.insert("big", [10, 11, 12, 13])
    index.insert("big", [20])
    assert len(index) == 5
    index.insert("big", [30])
    assert len(index) == 5
    assert index.blocks_of("small") == 1


def test_predictions_expire_exact_entries_do_not() -> None:
    index = RadixIndex()
    index.add_replica("a")
    index.add_replica("b")
    index.insert("a", [1, 2], expires_at=10.0)
    index.insert("b", [1, 2])
    assert index.expire(9.9) == 0
    assert index.expire(10.0) == 2
    assert index.match([1, 2]) == {"b": 2}
    assert index.expire(math.inf) == 0


def test_settling_an_in_flight_prompt_keeps_what_events_confirmed() -> None:
    """An exact replica's prompt in flight is held as timed entries; its stored events make the blocks
    it computed exact, and when the request ends the rest go."""
    index = RadixIndex()
    index.add_replica("a")
    index.insert("a", [1, 2, 3], expires_at=100.0)
    assert index.match([1, 2, 3]) == {"a": 3}
    index.insert("a", [1, 2])  # the stored event, for the blocks it computed
    index.settle("a", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"a": 2}
    assert len(index) == 2 and index.expire(math.inf) == 0
    index.settle("gone", [1])  # a replica removed meanwhile: nothing to do


def test_refreshed_prediction_lives_to_its_new_expiry() -> None:
    index = RadixIndex()
    index.add_replica("a")
    index.insert("a", [1], expires_at=5.0)
    index.insert("a", [1], expires_at=9.0)
    assert index.expire(6.0) == 0
    assert index.match([1]) == {"a": 1}
    assert index.expire(9.0) == 1


def test_dropped_replica_frees_its_slot_for_a_new_one() -> None:
    index = RadixIndex()
    index.add_replica("a")
    index.insert("a", [1, 2])
    index.drop_replica("a")
    index.add_replica("z")
    assert index.match([1, 2]) == {}
    index.insert("z", [1])
    assert index.match([1, 2]) == {"z": 1}


def test_many_replicas_beyond_machine_word() -> None:
    index = RadixIndex()
    for i in range(100):
        index.add_replica(f"r{i}")
        index.insert(f"r{i}", list(range(i % 7 + 1)))
    result = index.match(list(range(10)))
    assert result == {f"r{i}": i % 7 + 1 for i in range(100)}


def test_unknown_replica_is_a_clear_error() -> None:
    index = RadixIndex()
    with pytest.raises(KeyError, match="not in the index"):
        index.insert("ghost", [1])


# -- learning a predicted replica's capacity ----------------------------------------------------------

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
