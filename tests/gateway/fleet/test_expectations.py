"""What a routed request leaves in the index as it is forwarded, and after it ends."""

from __future__ import annotations

from gateway.fleet.expectations import NOTHING, expect, record, settle
from gateway.fleet.predictions import Predictions
from radix.index import RadixIndex
from tests.support.replicas import replica

HASHES = [11, 12, 13]


def test_a_predicted_replica_is_predicted_to_hold_the_prompt_for_the_ttl() -> None:
    index = RadixIndex()
    index.add_replica("p", 100, learn=True)
    index.insert("p", HASHES[:1])
    predictions = Predictions(index, ttl_s=30.0)
    expectation = expect(index, replica("p", kind="openai"), HASHES, precise=False)
    # What it held before this request is what its report will be checked against; nothing recorded yet.
    assert expectation.predicted is not None and expectation.recorded_tick is not None
    assert index.match(HASHES)["p"] == 1 and predictions.stats.recorded == 0
    for _ in range(2):  # once only
        record(index, predictions, expectation, now=1000.0)
    assert expectation.in_flight == ("p", HASHES) and predictions.stats.recorded == 1
    assert index.match(HASHES)["p"] == 3
    settle(index, expectation)
    assert index.match(HASHES)["p"] == 3, "a prediction outlives the request: its TTL ends it"


def test_a_predicted_replica_keeps_a_prompt_in_flight_past_its_capacity_bound() -> None:
    """Under load the requests running on an engine hold much of its pool, and it evicts only blocks no
    running request uses: the capacity bound evicts the idle sessions' blocks, not the prompt in flight,
    however long ago it was sent."""
    index = RadixIndex()
    index.add_replica("p", 5, learn=True)
    predictions = Predictions(index, ttl_s=30.0)
    running = expect(index, replica("p", kind="openai"), HASHES, precise=False)
    record(index, predictions, running, now=1000.0)
    index.insert("p", [1, 2])  # a session whose turn ended since: between its turns
    newer = expect(index, replica("p", kind="openai"), [21, 22], precise=False)
    record(index, predictions, newer, now=1001.0)
    # Seven blocks for five: the idle session's go, though the first prompt in flight is older.
    assert "p" not in index.match([1, 2])
    assert index.match(HASHES)["p"] == 3 and index.match([21, 22])["p"] == 2
    settle(index, running)
    index.insert("p", [31, 32])  # another prompt: now the ended one's blocks can go, its tail first
    assert index.match(HASHES)["p"] == 1 and index.match([21, 22])["p"] == 2


def test_an_exact_replica_holds_the_prompt_only_while_the_request_runs() -> None:
    index = RadixIndex()
    index.add_replica("e")
    predictions = Predictions(index, ttl_s=30.0)
    expectation = expect(index, replica("e"), HASHES, precise=True)
    assert expectation.in_flight is None and index.match(HASHES).get("e", 0) == 0
    record(index, predictions, expectation, now=1000.0)
    assert expectation.in_flight == ("e", HASHES) and expectation.predicted is None
    assert index.match(HASHES)["e"] == 3 and predictions.stats.recorded == 0
    settle(index, expectation)
    assert index.match(HASHES).get("e", 0) == 0, "its KV events say what it really stored"


def test_an_expectation_never_recorded_settles_nothing() -> None:
    index = RadixIndex()
    index.add_replica("e")
    index.pin("e", HASHES)  # another request's, in flight
    settle(index, expect(index, replica("e"), HASHES, precise=True))
    assert index.match(HASHES)["e"] == 3


def test_an_exact_replica_evicting_an_older_copy_still_holds_a_prompt_in_flight() -> None:
    """vLLM evicts a cached prefix while a request that will compute it again waits in its queue: the
    removed event must not send the requests sharing that prefix elsewhere in the meantime."""
    index = RadixIndex()
    index.add_replica("e")
    index.insert("e", HASHES)  # stored events: an older request's copy
    expectation = expect(index, replica("e"), HASHES, precise=True)
    record(index, Predictions(index, ttl_s=30.0), expectation, now=1000.0)
    index.remove("e", HASHES)  # the older copy evicted while this request queues
    assert index.match(HASHES)["e"] == 3
    index.insert("e", HASHES[:2])  # its prefill stored two blocks again
    settle(index, expectation)
    assert index.match(HASHES)["e"] == 2


def test_a_prompt_without_full_blocks_leaves_nothing() -> None:
    index = RadixIndex()
    index.add_replica("e")
    nothing = expect(index, replica("e"), [], precise=True)
    record(index, Predictions(index, ttl_s=30.0), nothing, now=0.0)
    assert nothing is NOTHING and not NOTHING.recorded and index.match(HASHES).get("e", 0) == 0
