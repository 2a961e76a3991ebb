"""The radix index against a naive reference model, plus the behaviours routing relies on."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import radix.index as index_module
from radix.index import NEVER, RadixIndex


class Reference:
    """Per replica, an ordered list of (hash, expiry), least recently used first, and the requests in
    flight pinning each hash; everything is a scan."""

    def __init__(self, max_entries: int | None) -> None:
        self.max_entries = max_entries
        self.replicas: dict[str, tuple[int | None, list[list]]] = {}
        self.pins: dict[str, Counter[int]] = {}

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
        # The capacity bound passes over pinned blocks once, each becoming the most recently used.
        excess = len(blocks) - capacity if capacity is not None else 0
        for _ in range(len(blocks)):
            if excess <= 0:
                break
            if self.pins[rid][blocks[0][0]]:
                blocks.append(blocks.pop(0))
            else:
                blocks.pop(0)
                excess -= 1
        while self.max_entries is not None and self.total() > self.max_entries:
            largest = max(self.replicas.values(), key=lambda item: len(item[1]))
            largest[1].pop(0)

    def match(self, hashes: list[int]) -> dict[str, int]:
        out = {}
        for rid, (_, blocks) in self.replicas.items():
            held = {r[0] for r in blocks} | set(self.pins[rid])
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
    # slack 0: the deadline rows are trimmed and rebuilt as often as they can be, not past 1,024 hashes.
    @initialize(max_entries=st.one_of(st.none(), st.integers(3, 20)), slack=st.sampled_from([0, 1024]))
    def setup(self, max_entries: int | None, slack: int) -> None:
        self.slack, index_module.DEADLINE_SLACK = index_module.DEADLINE_SLACK, slack
        self.index = RadixIndex(max_entries=max_entries)
        self.ref = Reference(max_entries)
        self.now = 0.0
        self.add("a", None)  # a replica from the start, so that every rule can run at once

    def teardown(self) -> None:
        if hasattr(self, "slack"):
            index_module.DEADLINE_SLACK = self.slack

    @rule(rid=names, capacity=st.one_of(st.none(), st.integers(1, 8)))
    def add(self, rid: str, capacity: int | None) -> None:
        if rid in self.ref.replicas:
            with pytest.raises(ValueError):
                self.index.add_replica(rid, capacity)
            return
        self.index.add_replica(rid, capacity)
        self.ref.replicas[rid] = (capacity, [])
        self.ref.pins[rid] = Counter()

    @precondition(lambda self: self.ref.replicas)
    @rule(data=st.data(), hashes=st.lists(hash_ids, max_size=5, unique=True))
    def pin(self, data: st.DataObject, hashes: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ref.replicas)))
        self.index.pin(rid, hashes)
        self.ref.pins[rid].update(hashes)

    @precondition(lambda self: self.ref.replicas)
    @rule(data=st.data(), hashes=st.lists(hash_ids, max_size=5, unique=True))
    def unpin(self, data: st.DataObject, hashes: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ref.replicas)))
        self.index.unpin(rid, hashes)
        self.ref.pins[rid].subtract(hashes)
        self.ref.pins[rid] = +self.ref.pins[rid]

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
        del self.ref.pins[rid]

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


def test_global_bound_evicts_as_one_entry_at_a_time_from_whichever_is_largest() -> None:
    """In batches, the same entries go as one at a time: "second" gives up one to come level with
    "first", which is then the largest (first among equals) for the last."""
    index = RadixIndex(max_entries=7)
    index.add_replica("first")
    index.add_replica("second")
    index.insert("first", [1, 2, 3, 4])
    index.insert("second", [10, 11, 12])
    index.insert("second", [20, 21])
    assert (index.blocks_of("first"), index.blocks_of("second")) == (3, 4)
    assert index.match([1, 2, 3, 4]) == {"first": 3}  # its least recently used, the leaf, went
    assert index.match([20, 21]) == {"second": 2}


def test_at_the_global_bound_the_deadline_rows_stay_bounded_without_a_rebuild(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """New prompts at the bound evict the least recently used, whose rows are due first: trimmed from
    the top, the rows never outgrow the live entries enough for a whole rebuild (seconds, at millions
    of entries), and every entry still expires when due."""
    rebuilds = []
    monkeypatch.setattr(RadixIndex, "_compact_deadlines", lambda self: rebuilds.append(len(self)))
    monkeypatch.setattr(index_module, "DEADLINE_SLACK", 16)
    index = RadixIndex(max_entries=200)
    index.add_replica("r", learn=True)
    for n in range(2_000):
        index.insert("r", [n * 10 + k for k in range(5)], expires_at=1_000.0 + n)
    assert rebuilds == []
    assert len(index) == 200
    assert index.expire(1_000.0 + 1_998) == 195
    assert index.expire(1_000.0 + 1_999) == 5
    assert len(index) == 0


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


def test_unpinning_a_prompt_in_flight_keeps_what_events_stored() -> None:
    """An exact replica's prompt in flight is pinned; its stored events add the blocks it computed, and
    when the request ends the rest go."""
    index = RadixIndex()
    index.add_replica("a")
    index.pin("a", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"a": 3} and len(index) == 0
    index.insert("a", [1, 2])  # the stored event, for the blocks it computed
    index.unpin("a", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"a": 2}
    assert len(index) == 2 and index.expire(math.inf) == 0
    index.unpin("gone", [1])  # a replica removed meanwhile: nothing to do


def test_a_pinned_block_outlives_removed_events_and_other_requests_ending() -> None:
    """Two requests in flight share a prefix the replica also holds from before: an eviction of the old
    copy and the first request's end leave it held for the second; only the last end releases it."""
    index = RadixIndex()
    index.add_replica("a")
    index.add_replica("b")
    index.insert("a", [1, 2])
    index.insert("b", [1])
    index.pin("a", [1, 2])
    index.pin("a", [1, 2])
    index.remove("a", [1, 2])
    index.clear("a")
    assert index.match([1, 2]) == {"a": 2, "b": 1} and index.blocks_of("a") == 0
    index.unpin("a", [1, 2])
    assert index.match([1, 2]) == {"a": 2, "b": 1}
    index.unpin("a", [1, 2])
    assert index.match([1, 2]) == {"b": 1}
    index.unpin("a", [1, 2])  # more unpins than pins: nothing left to release
    assert index.match([1, 2]) == {"b": 1}


def test_dropping_a_replica_releases_its_pins_before_its_bit_is_reused() -> None:
    index = RadixIndex()
    index.add_replica("a")
    index.pin("a", [1, 2])
    index.drop_replica("a")
    index.add_replica("c")  # takes a's bit
    assert index.match([1, 2]) == {}
    index.unpin("a", [1, 2])
    assert index.match([1, 2]) == {}


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
