"""What a chosen replica is expected to hold once a request is sent there (docs/design.md §2 step 5),
recorded as the request leaves for it, before any other request is routed, so that the next request
sharing its prefix follows it.

A predicted replica (approximate mode) gets a prediction with a TTL, and what it was predicted to hold
before, which the reuse it reports is checked against (Predictions.learn). An exact replica holds the
prompt once it has computed it, which its events will say; a request sent there meanwhile waits for
that prefill anyway and then reuses it. Either way, until this request ends its prompt is pinned
there (RadixIndex.pin): an exact replica's whatever the events say of an older copy meanwhile, a
predicted one's whatever its capacity bound evicts meanwhile, since an engine does not evict the
blocks of a request it is running.

Reading what was held before (expect) and recording (record) are two steps so that the record, a
walk over every block of the prompt, is made once the request is written upstream (the proxy) rather
than on its way there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.fleet.predictions import Predictions
from gateway.fleet.replicas import Replica
from radix.capacity import Predicted
from radix.index import RadixIndex


@dataclass(slots=True)
class Expectation:
    """One request's record in the index, made once (record) and settled when the request ends."""

    replica: str = ""
    hashes: Sequence[int] = ()
    precise: bool = False
    # Predicted replicas: what it was predicted to hold before this request, and the index's tick then.
    predicted: Predicted | None = None
    recorded_tick: int | None = None
    recorded: bool = False

    @property
    def in_flight(self) -> tuple[str, Sequence[int]] | None:
        """Once recorded: the replica and the hashes pinned for the request's lifetime."""
        return (self.replica, self.hashes) if self.recorded else None


# Nothing to record (no full block, or no prefix route): record and settle leave it as it is.
NOTHING = Expectation()


def expect(index: RadixIndex, chosen: Replica, hashes: Sequence[int], *, precise: bool) -> Expectation:
    """That `chosen` will hold the prompt's blocks `hashes`, with what it held of them before."""
    if not hashes:
        return NOTHING
    if precise:
        return Expectation(chosen.id, hashes, precise=True)
    predicted = index.predicted(chosen.id, hashes, chosen.pending_horizon())
    return Expectation(chosen.id, hashes, predicted=predicted, recorded_tick=index.tick_now(chosen.id))


def record(index: RadixIndex, predictions: Predictions, expectation: Expectation, *, now: float) -> None:
    """Record the expectation in the index (a prediction is shared too), once: later calls do nothing."""
    if expectation.recorded or not expectation.hashes:
        return
    expectation.recorded = True
    if not expectation.precise:
        predictions.record(expectation.replica, expectation.hashes, now)
    index.pin(expectation.replica, expectation.hashes)


def settle(index: RadixIndex, expectation: Expectation) -> None:
    """The request ended: what an exact replica holds is its events' to say again, what a predicted one
    holds its capacity bound's."""
    if expectation.in_flight is not None:
        index.unpin(*expectation.in_flight)
