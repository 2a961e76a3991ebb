"""What a chosen replica is expected to hold once a request is sent there (docs/design.md §2 step 5),
recorded before the request is forwarded so that the next request sharing its prefix follows it.

A predicted replica (approximate mode) gets a prediction with a TTL, and what it was predicted to hold
before, which the reuse it reports is checked against (Predictions.learn). An exact replica holds the
prompt once it has computed it, which its events will say; a request sent there meanwhile waits for
that prefill anyway and then reuses it, so until this request ends its prompt counts as held there
(RadixIndex.settle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.fleet.predictions import Predictions
from gateway.fleet.replicas import Replica
from radix.capacity import Predicted
from radix.index import RadixIndex


@dataclass(frozen=True, slots=True)
class Expectation:
    """One request's record in the index, to be settled when it ends."""

    # Predicted replicas: what it was predicted to hold before this request, and the index's tick then.
    predicted: Predicted | None = None
    recorded_tick: int | None = None
    # Exact replicas: the replica and the hashes held for the request's lifetime.
    in_flight: tuple[str, Sequence[int]] | None = None


NOTHING = Expectation()


def expect(
    index: RadixIndex,
    predictions: Predictions,
    chosen: Replica,
    hashes: Sequence[int],
    *,
    precise: bool,
    now: float,
    request_timeout_s: float,
) -> Expectation:
    """Record that `chosen` will hold the prompt's blocks `hashes`."""
    if not hashes:
        return NOTHING
    if not precise:
        predicted = index.predicted(chosen.id, hashes, chosen.pending_horizon())
        tick = index.tick_now(chosen.id)
        predictions.record(chosen.id, hashes, now)
        return Expectation(predicted=predicted, recorded_tick=tick)
    index.insert(chosen.id, hashes, expires_at=now + request_timeout_s)
    return Expectation(in_flight=(chosen.id, hashes))


def settle(index: RadixIndex, expectation: Expectation) -> None:
    """The request ended: what an exact replica holds is its events' to say again."""
    if expectation.in_flight is not None:
        index.settle(*expectation.in_flight)
