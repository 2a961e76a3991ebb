"""The KV event log against a real block manager: numbering, the ring, snapshots, and the invariant
that a consumer replaying the batches holds exactly the block manager's cached set."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.kv_events import EventBatch, KVEvent, apply_batches
from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence
from workers.kv_event_log import EventsGone, KVEventLog

ONE = SamplingParams(max_tokens=1)


def replay(batches: list[EventBatch]) -> set[int]:
    cached: set[int] = set()
    apply_batches(cached, batches)
    return cached


def test_an_incarnation_starts_with_a_lone_cleared_batch() -> None:
    log = KVEventLog()
    assert log.seq == 1
    [first] = log.after(0)
    assert first == EventBatch(log.incarnation, 1, (KVEvent("cleared"),))
    assert log.snapshot().hashes == frozenset() and log.snapshot().seq == 1
    assert KVEventLog().incarnation != log.incarnation
    assert log.seal() is None, "nothing pending, nothing sealed"


def test_batches_are_numbered_and_retained_in_a_bounded_ring() -> None:
    log = KVEventLog(incarnation="inc", capacity=3)
    for h in range(10, 15):
        log.on_stored([h], None)
        batch = log.seal()
        assert batch is not None and batch.seq == log.seq and batch.incarnation == "inc"
    assert log.seq == 6
    assert [b.seq for b in log.after(3)] == [4, 5, 6]
    assert [b.seq for b in log.after(3, limit=2)] == [4, 5]
    assert log.after(6) == []
    with pytest.raises(EventsGone) as gone:
        log.after(2)
    assert gone.value.seq == 6 and gone.value.incarnation == "inc"
    with pytest.raises(EventsGone):
        log.after(7)  # a number from some earlier incarnation's future
    assert log.snapshot().hashes == frozenset(range(10, 15))


def test_one_wake_up_per_burst_of_events() -> None:
    wakes: list[int] = []
    log = KVEventLog(on_pending=lambda: wakes.append(1))
    log.on_stored([1, 2], None)
    log.on_removed([1])
    log.on_stored([3], 2)
    assert len(wakes) == 1
    batch = log.seal()
    assert batch is not None
    assert batch.events == (
        KVEvent("stored", (1, 2), None),
        KVEvent("removed", (1,)),
        KVEvent("stored", (3,), 2),
    )
    log.on_cleared()
    assert len(wakes) == 2
    log.seal()
    assert log.snapshot().hashes == frozenset()


def test_json_round_trip() -> None:
    batch = EventBatch(
        "abc",
        7,
        (
            KVEvent("stored", (2**64 - 1, 5), 9),
            KVEvent("stored", (4,), None),
            KVEvent("removed", (5,)),
            KVEvent("cleared"),
        ),
    )
    wire = batch.to_json()
    assert wire["events"][0] == {"type": "stored", "hashes": [2**64 - 1, 5], "parent": 9}
    assert wire["events"][2] == {"type": "removed", "hashes": [5]}
    assert wire["events"][3] == {"type": "cleared"}
    assert EventBatch.from_json(wire) == batch
    with pytest.raises(ValueError):
        KVEvent.from_json({"type": "moved"})


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=30),
    seed=st.integers(0, 2**16),
)
def test_replaying_batches_yields_the_block_managers_cached_set(prompts: list[list[int]], seed: int) -> None:
    """Random admissions, releases, flushes and seal points over a pool small enough to evict."""
    rng = random.Random(seed)
    log = KVEventLog(capacity=10_000)
    bm = BlockManager(6, 2, "m", **log.callbacks())
    live: list[Sequence] = []
    reader: set[int] = set()
    reader_seq = 0
    for i, prompt in enumerate(prompts):
        seq = Sequence(i, prompt, ONE, 0.0)
        cached = bm.lookup(seq)
        if cached < len(prompt) and bm.admit(seq, len(prompt)):
            bm.mark_computed(seq, len(prompt) - seq.num_computed_tokens)
            live.append(seq)
        while live and (len(live) > 2 or rng.random() < 0.5):
            bm.free(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.05:
            bm.reset()
        if rng.random() < 0.5:
            log.seal()
            new = log.after(reader_seq)
            apply_batches(reader, new)
            reader_seq = log.seq
            assert reader == log.snapshot().hashes == bm.cached_hashes()
    log.seal()
    assert replay(log.after(0)) == bm.cached_hashes() == log.snapshot().hashes
    apply_batches(reader, log.after(reader_seq))
    assert reader == bm.cached_hashes()


def test_a_snapshot_plus_the_later_batches_equals_the_full_replay() -> None:
    log = KVEventLog()
    log.on_stored([1, 2, 3], None)
    log.seal()
    snap = log.snapshot()
    log.on_removed([3])
    log.on_stored([4], 2)
    log.seal()
    resumed = set(snap.hashes)
    apply_batches(resumed, log.after(snap.seq))
    assert resumed == replay(log.after(0)) == {1, 2, 4}


def test_appending_from_another_thread_while_sealing_loses_nothing() -> None:
    log = KVEventLog(capacity=100_000)

    def engine() -> None:
        for h in range(20_000):
            log.on_stored([h], h - 1 if h else None)
            if h % 3 == 0:
                log.on_removed([h])

    thread = threading.Thread(target=engine)
    thread.start()
    while thread.is_alive():
        log.seal()
    thread.join()
    log.seal()
    expected = {h for h in range(20_000) if h % 3}
    assert replay(log.after(0)) == expected == log.snapshot().hashes
    assert [b.seq for b in log.after(0)] == list(range(1, log.seq + 1))
